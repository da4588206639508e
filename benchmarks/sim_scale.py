"""One simulated iteration at cluster scale: wall time and peak memory.

Cases (issue "The simulator at cluster scale"):
1. GPT-3 175B on 1,024 A100s (128 DGX A100 nodes): TP 8, PP 16, DP 8, 1F1B, global batch 1536,
   micro-batch 1. Target: materialize + simulate in at most 1 s and 1 GiB.
2. A 1T-parameter GPT (128 layers x 25,600 hidden, 160 heads; Narayanan et al. 2021, table 1's
   1T row) on 3,072 A100s (384 nodes): TP 8, PP 64, DP 6, global batch 3072, micro-batch 1.
   with full recompute (as Megatron-LM trains it). Target: at most 5 s.

Wall and CPU time are both printed: on a machine shared with other work the CPU time is the
fairer figure. Tracing the model on meta tensors is done once per model and shared by every plan an
exploration evaluates; it is reported on its own line. Each case runs in a fresh process so
the peak resident memory printed is that case's. Run: .venv/bin/python benchmarks/sim_scale.py
"""

from __future__ import annotations

import multiprocessing as mp
import resource
import sys
import time

CASES = {
    "gpt3-175b on 1024 A100": dict(
        model=("gpt3-175b", {}),
        nodes=128,
        batch=1536,
        knobs=dict(tp=8, pp=16, dp=8, microbatch=1, schedule="1f1b"),
        target_s=1.0,
        target_gib=1.0,
    ),
    "gpt-1t on 3072 A100": dict(
        model=("gpt", dict(layers=128, hidden=25600, heads=160, seq=2048, vocab=51200)),
        nodes=384,
        batch=3072,
        knobs=dict(tp=8, pp=64, dp=6, microbatch=1, schedule="1f1b", recompute="full"),
        target_s=5.0,
        target_gib=None,
    ),
}


def _case(name: str, out) -> None:
    from planlab.explore import Setup, make_context
    from planlab.models import ModelSpec
    from planlab.plan import materialize
    from planlab.search_spaces import get_space
    from planlab.simulator import simulate

    c = CASES[name]
    model, args = c["model"]
    spec = ModelSpec(model, tuple(sorted(args.items())))
    t0 = time.perf_counter()
    ctx, cost, graph = make_context(Setup(spec, "dgx-a100-80g", c["nodes"], c["batch"]))
    t1 = time.perf_counter()
    rss_trace = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    plan = get_space("megatron").build(ctx, c["knobs"])
    t2, c2 = time.perf_counter(), time.process_time()
    program = materialize(plan, graph, symmetric=True, node_of=cost.cluster.node_of)
    t3 = time.perf_counter()
    res = simulate(program, cost, model_flops=3 * graph.flops)
    t4, c4 = time.perf_counter(), time.process_time()
    out.put(
        dict(
            name=name,
            trace_s=t1 - t0,
            build_s=t2 - t1,
            materialize_s=t3 - t2,
            simulate_s=t4 - t3,
            cpu_s=c4 - c2,
            rss_trace_gib=rss_trace,
            rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            classes=len(program.devices),
            devices=program.num_devices,
            microbatches=plan.microbatches,
            operators=len(graph.operators),
            summary=res.summary(),
        )
    )


def main() -> None:
    ctx = mp.get_context("spawn")
    for name, c in CASES.items():
        q = ctx.Queue()
        p = ctx.Process(target=_case, args=(name, q))
        p.start()
        r = q.get()
        p.join()
        wall = r["materialize_s"] + r["simulate_s"]
        print(
            f"{name}: {r['operators']} operators, {r['devices']} devices in {r['classes']} classes, "
            f"{r['microbatches']} micro-batches"
        )
        print(f"  trace (once per model) {r['trace_s']:.2f} s; build plan {r['build_s']:.2f} s")
        print(
            f"  materialize {r['materialize_s']:.2f} s + simulate {r['simulate_s']:.2f} s = {wall:.2f} s "
            f"(target {c['target_s']} s, ratio {wall / c['target_s']:.2f}; CPU time {r['cpu_s']:.2f} s, "
            f"ratio {r['cpu_s'] / c['target_s']:.2f})"
        )
        gib = f"peak RSS {r['rss_gib']:.2f} GiB (after tracing {r['rss_trace_gib']:.2f} GiB)"
        if c["target_gib"]:
            gib += f" (target {c['target_gib']} GiB, ratio {r['rss_gib'] / c['target_gib']:.2f})"
        print("  " + gib)
        print(f"  -> {r['summary']}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
