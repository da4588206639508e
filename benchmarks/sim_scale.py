"""One simulated iteration at cluster scale: wall time and peak memory.

Cases (issue "The simulator at cluster scale"):
1. GPT-3 175B on 1,024 A100s (128 DGX A100 nodes): TP 8, PP 16, DP 8, 1F1B, global batch 1536,
   micro-batch 1. Target: materialize + simulate in at most 1 s and 1 GiB.
2. A 1T-parameter GPT (128 layers x 25,600 hidden, 160 heads; Narayanan et al. 2021, table 1's
   1T row) on 3,072 A100s (384 nodes): TP 8, PP 64, DP 6, global batch 3072, micro-batch 1.
   with full recompute (as Megatron-LM trains it). Target: at most 5 s.
3-5. Plans whose operators sit on different meshes (issue "Every plan simulated in a second"), each on
   1,024 A100s, target 1 s each: an interlaced pipeline of a 43B GPT with a 256k vocabulary (pp 4 x tp
   8 x dp 32), its token embedding and output layer split along the vocabulary over every device; an
   alpa plan of the same model with pp 2 x tp 8 stage meshes (dp 64); a 3f1b plan of AlphaFold2 with 3
   recycling passes (pp 4 x dp 256).
6. Mixtral 8x7B (EP 8, PP 4) and DeepSeek-V3 (EP 64) on 64 and 1,024 H100s (DGX H100 nodes), with
   expert parallelism's all-to-all dispatch and combine. Target: at most 5 s each. And DeepSeek-V3 as its
   report trained it: 2,048 H800, DualPipe over 16 uneven stages, EP 64, ZeRO-1, FP8. Target: 5 s.
7. LLaMA-3 405B at sequence 131,072 on 16,384 H100s (2,048 DGX H100 nodes): TP 8, CP 16 (all-to-all
   over heads), PP 16, DP 8, global batch 128 (16M tokens), micro-batch 1, ZeRO-2, as Llama 3's Table 4
   row, its 126 layers on uneven stages (7, 14 x 8, 7), with the torch software's fused attention.
   Target: at most 5 s. And the same with ring attention (``cp_kind=ring``, in zigzag order as
   Megatron-Core balances it), target 5 s, and with contiguous chunks (``cp_layout=contiguous``);
   and as Llama 3 ran it (``cp_kind=allgather``: keys and values all-gathered, zigzag chunks), 5 s.

Wall and CPU time are both printed: on a machine shared with other work the CPU time is the
fairer figure. Tracing the model on meta tensors is done once per model and shared by every plan an
exploration evaluates; it is reported on its own line. Each case runs in a fresh process so
the peak resident memory printed is that case's.

Each case's Program is built as a user's run builds it (``build_program``: the cluster's default
software and precision), reduced to device classes; the number of classes is printed.

Then one interlaced plan of that kind explored alone as a whole process (``planlab explore ... --space
interlaced`` with every knob fixed) on 32 and on 1,024 A100s, target 10 s each.

Then, for case 1 as a user meets it (issue "Every plan simulated in a second"), measured against
the targets side by side:
- the plan file's size (version 3; target 200 KB);
- ``planlab simulate plan.json`` as a whole process, twice with an empty trace cache (the first
  traces the model and fills the caches, the second loads the graph and the Program from them): wall
  time, target 1.5 s for the second; and where the second's time goes (imports, loading the plan, the
  graph and the Program from the caches, simulate, the table), measured in a process of its own;
- writing the plan's outputs (best_plan.json, timeline.png, memory.png; target 1 s, CPU time), from
  the Drawing an exploration's worker sends, after the simulation that records the timeline and the
  Drawing made of it (printed apart, with the Drawing's pickled size).

Run: .venv/bin/python benchmarks/sim_scale.py [CASE ...] [--skip-explore] [--skip-whole]
(CASE: part of a case's name, e.g. mixtral deepseek; naming cases skips the explorations and the whole-process runs)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pickle
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# plan_quality.py's large-vocabulary GPT (48 x 8192, 43B parameters, Megatron-LM's vocabulary-parallel
# embedding and loss)
GPT_43B = dict(layers=48, hidden=8192, heads=64, seq=2048, vocab=256000, vocab_parallel=1)

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
    "interlaced gpt-43b (256k vocabulary) on 1024 A100": dict(
        model=("gpt", GPT_43B),
        nodes=128,
        batch=1024,
        space="interlaced",
        knobs=dict(pp=4, tp=8, dp=32, microbatch=1, embed_layout="vocab", head_layout="vocab"),
        target_s=1.0,
        target_gib=None,
    ),
    "alpa pp 2 x tp 8 gpt-43b on 1024 A100": dict(
        model=("gpt", GPT_43B),
        nodes=128,
        batch=1024,
        space="alpa",
        knobs=dict(pp=2, tp=8, microbatch=1),
        target_s=1.0,
        target_gib=None,
    ),
    "3f1b alphafold2 (3 recycles) on 1024 A100": dict(
        model=("alphafold2", dict(recycles=3)),
        nodes=128,
        batch=1024,
        space="3f1b",
        knobs=dict(pp=4, dp=256, microbatch=1),
        target_s=1.0,
        target_gib=None,
    ),
    # Mixtral 8x7B with Megatron-Core's expert parallelism across DGX H100 nodes: EP 8 inside the
    # data-parallel replicas, PP 4, TP 1 (issue 19: 64 to 1,024 H100 in at most 5 s each).
    "mixtral-8x7b on 64 H100": dict(
        model=("mixtral-8x7b", {}),
        cluster="dgx-h100",
        nodes=8,
        batch=256,
        knobs=dict(tp=1, pp=4, dp=16, ep=8, microbatch=1, schedule="1f1b", zero=1),
        target_s=5.0,
        target_gib=None,
    ),
    "mixtral-8x7b on 1024 H100": dict(
        model=("mixtral-8x7b", {}),
        cluster="dgx-h100",
        nodes=128,
        batch=1024,
        knobs=dict(tp=1, pp=4, dp=256, ep=8, microbatch=1, schedule="1f1b", zero=1),
        target_s=5.0,
        target_gib=None,
    ),
    # DeepSeek-V3 at its published shape, EP 64 over 8 nodes as DeepSeek trained it; 61 layers have no
    # even pipeline split (DeepSeek's PP 16 needs uneven stages, issue 19 part B), so no pipeline here.
    "deepseek-v3 on 64 H100": dict(
        model=("deepseek-v3", {}),
        cluster="dgx-h100",
        nodes=8,
        batch=64,
        knobs=dict(tp=1, pp=1, dp=64, ep=64, microbatch=1, zero=1),
        target_s=5.0,
        target_gib=None,
    ),
    "deepseek-v3 on 1024 H100": dict(
        model=("deepseek-v3", {}),
        cluster="dgx-h100",
        nodes=128,
        batch=1024,
        knobs=dict(tp=1, pp=1, dp=1024, ep=64, microbatch=1, zero=1),
        target_s=5.0,
        target_gib=None,
    ),
    # DeepSeek-V3 at its report's shape (benchmarks/data/deepseek-v3-2024): 2,048 H800 (256 HGX H800 nodes),
    # PP 16 with its 61 layers on uneven stages (3, 14 x 4, 2), EP 64 inside DP 128, ZeRO-1, FP8 GEMMs,
    # 15,360 sequences of 4,096 a step, micro-batch 2 (unstated; the least DualPipe takes), DualPipe, the MLA
    # up-projections recomputed and the experts' SwiGLU input kept in FP8, on the hai-llm software as the row.
    "deepseek-v3 as published (dualpipe, pp 16 uneven, ep 64) on 2048 H800": dict(
        model=("deepseek-v3", {}),
        cluster="hgx-h800",
        nodes=256,
        batch=15360,
        knobs=dict(
            tp=1,
            pp=16,
            dp=128,
            ep=64,
            microbatch=2,
            schedule="dualpipe",
            zero=1,
            recompute="selective",
            recompute_mla_up_proj=True,  # section 3.2.3; the SwiGLU's FP8 input (3.3.3) is hai-llm's glu_input_bytes
            first_stage_layers=3,
            last_stage_layers=2,
        ),
        software="hai-llm",  # as the published row (benchmarks/data/deepseek-v3-2024.csv)
        precision="fp8",
        target_s=5.0,
        target_gib=None,
    ),
    # Llama 3's long-context stage (Dubey et al. 2024, Table 4): TP 8, CP 16, PP 16, DP 8 on 16,384 H100,
    # 16M tokens a batch. Its 126 layers on 16 stages as section 3.3.2 says: one layer fewer on the first
    # and the last stage (7, 14 x 8, 7), with the uneven-stage knobs a user sets; ZeRO-2 as its FSDP shards
    # optimizer states and gradients but keeps the gathered weights from forward to backward (section 3.3).
    "llama3-405b at 131072 tokens (cp 16) on 16384 H100": dict(
        model=("llama3-405b", dict(seq=131072)),
        cluster="dgx-h100",
        nodes=2048,
        batch=128,
        knobs=dict(
            tp=8, cp=16, pp=16, dp=8, microbatch=1, schedule="1f1b", zero=2, first_stage_layers=7, last_stage_layers=7
        ),
        software="torch",  # fused attention: megatron's unfused one keeps the s x s scores (2 TiB a layer here)
        target_s=5.0,
        target_gib=None,
    ),
}
# the same with ring attention (cp_kind=ring): key/value blocks passed around the 16 context-parallel
# devices (on 16 nodes: tp 8 fills a node) with the blocks' computation, in zigzag order (cp_layout=auto:
# rank i holds chunks i and 31 - i, as Megatron-Core and Llama 3 balance the causal mask); and with
# contiguous chunks (the last rank paces the ring), the what-if beside it
_A2A = CASES["llama3-405b at 131072 tokens (cp 16) on 16384 H100"]
CASES["llama3-405b at 131072 tokens (cp 16, ring) on 16384 H100"] = dict(
    _A2A, knobs=dict(_A2A["knobs"], cp_kind="ring")
)
CASES["llama3-405b at 131072 tokens (cp 16, ring, contiguous) on 16384 H100"] = dict(
    _A2A, knobs=dict(_A2A["knobs"], cp_kind="ring", cp_layout="contiguous")
)
# and as Llama 3 ran it (section 3.3.2): the keys and values all-gathered over the 16 devices, zigzag chunks
CASES["llama3-405b at 131072 tokens (cp 16, allgather) on 16384 H100"] = dict(
    _A2A, knobs=dict(_A2A["knobs"], cp_kind="allgather")
)
# all-to-all over heads (cp_kind=a2a) does not fit this shape: the attention reads its 8 key/value heads
# unrepeated (grouped-query attention), one per tensor-parallel rank at tp 8, which cp 16 cannot split
del CASES["llama3-405b at 131072 tokens (cp 16) on 16384 H100"]


def _case(name: str, out) -> None:
    from planlab.explore import Setup, make_context
    from planlab.models import ModelSpec
    from planlab.plan.software_passes import build_program
    from planlab.search_spaces import get_space
    from planlab.simulator import simulate

    c = CASES[name]
    model, args = c["model"]
    spec = ModelSpec(model, tuple(sorted(args.items())))
    t0 = time.perf_counter()
    ctx, cost, graph = make_context(
        Setup(
            spec,
            c.get("cluster", "dgx-a100-80g"),
            c["nodes"],
            c["batch"],
            software=c.get("software"),
            precision=c.get("precision"),
        )
    )
    t1 = time.perf_counter()
    rss_trace = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    plan = get_space(c.get("space", "megatron")).build(ctx, c["knobs"])
    t2, c2 = time.perf_counter(), time.process_time()
    program = build_program(plan, graph, cost, symmetric=True)
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


PLAN_KB_TARGET = 200.0
SECOND_SIMULATE_TARGET_S = 1.5
WRITE_TARGET_S = 1.0


def _write_plan(name: str, path: Path) -> None:
    """The plan of case ``name`` as a plan file (in a process of its own)."""
    from planlab.explore import Setup, make_context
    from planlab.models import ModelSpec
    from planlab.plan import save_plan
    from planlab.search_spaces import get_space

    c = CASES[name]
    model, args = c["model"]
    ctx, _, _ = make_context(
        Setup(ModelSpec(model, tuple(sorted(args.items()))), "dgx-a100-80g", c["nodes"], c["batch"])
    )
    save_plan(get_space("megatron").build(ctx, c["knobs"]), path)


def _simulate_phases(path: str, cache: str, out) -> None:
    """Where a ``planlab simulate`` process with a warm trace cache spends its time."""
    os.environ["PLANLAB_CACHE_DIR"] = cache
    t0 = time.perf_counter()
    from planlab.cli import _device_table_text  # noqa: F401 (the command's own imports)
    from planlab.costmodel import CostModel
    from planlab.models.trace_cache import trace_model
    from planlab.plan import load_plan
    from planlab.plan.program_cache import cached_program
    from planlab.plan.shared_params import training_flops
    from planlab.simulator import simulate

    t = [time.perf_counter()]
    plan = load_plan(path)
    t.append(time.perf_counter())
    cost = CostModel.load(plan.cluster, plan.nodes)
    graph = trace_model(plan.model, plan.global_batch)
    t.append(time.perf_counter())
    program = cached_program(plan, graph, cost, plan_text=Path(path).read_text(encoding="utf-8"))
    t.append(time.perf_counter())
    res = simulate(program, cost, model_flops=training_flops(graph))
    t.append(time.perf_counter())
    _device_table_text(res)
    t.append(time.perf_counter())
    names = ("imports", "load plan", "graph from the cache", "program from the cache", "simulate", "table")
    out.put(dict(zip(names, [t[0] - t0] + [b - a for a, b in zip(t, t[1:])])))


def _write_outputs(path: str, cache: str, out) -> None:
    """The seconds to simulate the plan with its timeline and reduce it to a Drawing (where an
    exploration's candidate is simulated), then to write its outputs from the Drawing, as
    ``write_outputs`` does (CPU seconds each)."""
    os.environ["PLANLAB_CACHE_DIR"] = cache
    folder = Path(path).parent
    from planlab.costmodel import CostModel
    from planlab.drawing import drawing_of
    from planlab.models.trace_cache import trace_model
    from planlab.plan import load_plan, materialize, save_plan
    from planlab.plan.shared_params import training_flops
    from planlab.plotting import memory_plot, timeline_plot
    from planlab.simulator import simulate

    plan = load_plan(path)
    cost = CostModel.load(plan.cluster, plan.nodes)
    graph = trace_model(plan.model, plan.global_batch)
    t0 = time.perf_counter()
    program = materialize(plan, graph, symmetric=True, node_of=cost.cluster.node_of)
    res = simulate(program, cost, model_flops=training_flops(graph), timeline=True)
    t1, c1 = time.perf_counter(), time.process_time()
    drawing = drawing_of(res)
    t2, c2 = time.perf_counter(), time.process_time()
    save_plan(plan, folder / "best_plan.json")
    c3 = time.process_time()
    timeline_plot(drawing, folder / "timeline.png", title=plan.describe())
    c4 = time.process_time()
    memory_plot(drawing, folder / "memory.png", title=plan.describe())
    t5, c5 = time.perf_counter(), time.process_time()
    out.put(
        dict(
            events=len(res.events),
            timeline_sim_s=t1 - t0,
            drawing_cpu_s=c2 - c1,
            drawing_kb=len(pickle.dumps(drawing)) / 1000,
            cpu={"best_plan.json": c3 - c2, "timeline.png": c4 - c3, "memory.png": c5 - c4},
            wall_s=t5 - t2,
        )
    )


def _in_child(target, *args):
    q = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=target, args=(*args, q))
    p.start()
    r = q.get()
    p.join()
    return r


def whole_process(name: str) -> None:
    """Case ``name`` as a user runs it: plan file size, `planlab simulate` twice, output writing."""
    planlab = Path(sys.executable).with_name("planlab")
    with tempfile.TemporaryDirectory() as tmp:
        plan = Path(tmp) / "plan.json"
        p = mp.get_context("spawn").Process(target=_write_plan, args=(name, plan))
        p.start()
        p.join()
        kb = plan.stat().st_size / 1000
        print(f"{name}, as a user runs it (load average {os.getloadavg()[0]:.1f}):")
        print(f"  plan file {kb:.0f} KB (target {PLAN_KB_TARGET:.0f} KB, ratio {kb / PLAN_KB_TARGET:.2f})")
        env = dict(os.environ, PLANLAB_CACHE_DIR=str(Path(tmp) / "cache"))
        walls, cpus = [], []
        for _ in range(2):
            t0, c0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
            subprocess.run([str(planlab), "simulate", str(plan)], env=env, check=True, capture_output=True)
            c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            walls.append(time.perf_counter() - t0)
            cpus.append(c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime)
        print(
            f"  planlab simulate plan.json, whole process: first (traces, fills the cache) {walls[0]:.2f} s, "
            f"second {walls[1]:.2f} s wall (target {SECOND_SIMULATE_TARGET_S} s, ratio "
            f"{walls[1] / SECOND_SIMULATE_TARGET_S:.2f}), {cpus[1]:.2f} s CPU (ratio "
            f"{cpus[1] / SECOND_SIMULATE_TARGET_S:.2f}); load average {os.getloadavg()[0]:.1f}"
        )
        phases = _in_child(_simulate_phases, str(plan), env["PLANLAB_CACHE_DIR"])
        print("  second run's time, in a process of its own: " + ", ".join(f"{k} {v:.2f} s" for k, v in phases.items()))
        w = _in_child(_write_outputs, str(plan), env["PLANLAB_CACHE_DIR"])
        cpu = sum(w["cpu"].values())
        print(
            f"  outputs: the simulation recording the timeline ({w['events']:,} events) {w['timeline_sim_s']:.2f} s; "
            f"its Drawing {w['drawing_cpu_s']:.2f} s CPU ({w['drawing_kb']:.0f} KB pickled, what a worker sends); "
            f"then writing {w['wall_s']:.2f} s wall, {cpu:.2f} s CPU (target {WRITE_TARGET_S} s, ratio "
            f"{cpu / WRITE_TARGET_S:.2f}): " + ", ".join(f"{k} {v:.2f} s CPU" for k, v in w["cpu"].items())
        )


EXPLORE_TARGET_S = 10.0
# nodes, global batch, knobs (every knob of the interlaced space fixed). On 32 A100 the plan is tp 8 x pp 4:
# with tp 2 x dp 4 and no ZeRO, 43B parameters' states do not fit, the plan is pruned and nothing is simulated.
INTERLACED_EXPLORE = {
    32: (4, 64, dict(pp=4, tp=8, dp=1, microbatch=1)),
    1024: (128, 1024, dict(pp=4, tp=8, dp=32, microbatch=1)),
}


def explore_interlaced(devices: int) -> None:
    """One interlaced plan (embedding and output layer over every device) explored alone by
    ``planlab explore`` as a whole process, twice: with an empty trace cache, then with it filled."""
    nodes, batch, knobs = INTERLACED_EXPLORE[devices]
    knobs = dict(knobs, zero=0, sequence_parallel=0, recompute="none", embed_layout="vocab", head_layout="vocab")
    planlab = Path(sys.executable).with_name("planlab")
    cmd = [str(planlab), "explore", "--model", "gpt", "--cluster", "dgx-a100-80g", "--nodes", str(nodes)]
    cmd += [a for k, v in GPT_43B.items() for a in ("--model-arg", f"{k}={v}")]
    cmd += ["--global-batch", str(batch), "--space", "interlaced", "--jobs", "1"]
    cmd += [a for k, v in knobs.items() for a in ("--set", f"{k}={v}")]
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, PLANLAB_CACHE_DIR=str(Path(tmp) / "cache"))
        walls, cpus = [], []
        for run in range(2):
            t0, c0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
            out = Path(tmp) / f"out{run}"
            subprocess.run(cmd + ["--out", str(out)], env=env, check=True, capture_output=True)
            c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            walls.append(time.perf_counter() - t0)
            cpus.append(c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime)
    print(
        f"interlaced gpt-43b, one plan explored alone on {devices} A100 ({knobs}), whole process: first "
        f"(traces, fills the cache) {walls[0]:.2f} s wall, {cpus[0]:.2f} s CPU; second {walls[1]:.2f} s wall "
        f"(target {EXPLORE_TARGET_S} s, ratio {walls[1] / EXPLORE_TARGET_S:.2f}), {cpus[1]:.2f} s CPU (ratio "
        f"{cpus[1] / EXPLORE_TARGET_S:.2f}); load average {os.getloadavg()[0]:.1f}"
    )
    sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="*", metavar="CASE", help="only the cases whose name contains one of these")
    ap.add_argument("--skip-explore", action="store_true", help="without the interlaced explorations")
    ap.add_argument("--skip-whole", action="store_true", help="without case 1 as a user runs it")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    for name, c in CASES.items():
        if args.cases and not any(o in name for o in args.cases):
            continue
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
            f"ratio {r['cpu_s'] / c['target_s']:.2f}; load average {os.getloadavg()[0]:.1f})"
        )
        gib = f"peak RSS {r['rss_gib']:.2f} GiB (after tracing {r['rss_trace_gib']:.2f} GiB)"
        if c["target_gib"]:
            gib += f" (target {c['target_gib']} GiB, ratio {r['rss_gib'] / c['target_gib']:.2f})"
        print("  " + gib)
        print(f"  -> {r['summary']}")
        sys.stdout.flush()
    if not args.skip_explore and not args.cases:
        for devices in INTERLACED_EXPLORE:
            explore_interlaced(devices)
    if not args.skip_whole and not args.cases:
        whole_process("gpt3-175b on 1024 A100")


if __name__ == "__main__":
    main()
