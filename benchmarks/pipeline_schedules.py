"""Pipeline schedules side by side, simulated: 1F1B, interleaved 1F1B, ZB-H1, ZB-V and DualPipe.

GPT-3 175B on 64 A100s (8 DGX nodes): TP 8 x PP 8, global batch 64, micro-batch 2 (32
micro-batches; DualPipe feeds the two halves of each from the two ends), sequence parallelism and
full recomputation. For each schedule: the simulated iteration, the peak memory of the fullest GPU,
the bubble (iteration minus the busiest rank's work), and the bubble the papers' formulas give with
equal forward, input-gradient and weight-gradient times (1F1B's per-micro-batch stage time ``t``
taken from the simulated 1F1B run): 1F1B (p-1) t, interleaved (p-1) t / v, ZB-H1 (p-1) t / 3
(Qi et al. 2024), ZB-V 0 (its paper's table), DualPipe (p/2 - 1)(F&B + B - 3W) with F&B = F + B
(no overlap credited) in the units of a half micro-batch's chunk, (p/2 - 1) t / 3 (DeepSeek-V3
report, table 2). Signed differences are printed; nothing is measured on GPUs here.

Run: .venv/bin/python benchmarks/pipeline_schedules.py [--nodes 8] [--pp 8]
"""

from __future__ import annotations

import argparse
import os
import time

GIB = 2**30


def formula_bubble(schedule: str, p: int, t: float, v: int) -> float:
    """The papers' bubble with equal F, I and W times, ``t`` = F + B of one stage and micro-batch."""
    return {
        "1f1b": (p - 1) * t,
        "interleaved": (p - 1) * t / v,
        "zb-h1": (p - 1) * t / 3,
        "zb-v": 0.0,
        "dualpipe": (p / 2 - 1) * t / 3,
    }[schedule]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--pp", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    from planlab.explore import Setup, make_context
    from planlab.models import ModelSpec
    from planlab.plan.software_passes import build_program
    from planlab.search_spaces import get_space
    from planlab.simulator import simulate

    t0 = time.perf_counter()
    ctx, cost, graph = make_context(Setup(ModelSpec("gpt3-175b"), "dgx-a100-80g", args.nodes, args.batch))
    p, dp = args.pp, args.nodes * 8 // (8 * args.pp)
    m = args.batch // (dp * 2)
    print(
        f"gpt3-175b on {args.nodes * 8} GPUs, tp=8 pp={p} dp={dp}, {m} micro-batches of 2, traced in "
        f"{time.perf_counter() - t0:.1f} s, load average {os.getloadavg()[0]:.1f}"
    )
    base = dict(dp=dp, tp=8, pp=p, microbatch=2, sequence_parallel=True, recompute="full")
    t = None
    for sched, v in (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 1), ("dualpipe", 1)):
        t1 = time.perf_counter()
        plan = get_space("megatron").build(ctx, dict(base, schedule=sched, virtual_stages=v))
        prog = build_program(plan, graph, cost)
        res = simulate(prog, cost, model_flops=3.0 * graph.flops)
        busy = max(d.compute_s for d in res.devices)
        bubble = res.iter_time_s - busy
        if sched == "1f1b":
            t = busy / m
        want = formula_bubble(sched, p, t, 2)
        print(
            f"  {sched:12s} iteration {res.iter_time_s:7.3f} s  peak {res.peak_mem_bytes / GIB:6.1f} GiB  "
            f"bubble {bubble:6.3f} s  formula {want:6.3f} s  (simulated - formula {bubble - want:+.3f} s)  "
            f"[{time.perf_counter() - t1:.1f} s]"
        )


if __name__ == "__main__":
    main()
