"""ZeRO stages and ZB-H1 against 1F1B, simulated on GPT-3 6.7B on two DGX A100 nodes (16 GPUs).

1. Data parallelism over 16 GPUs, micro-batch 2, global batch 256 (8 micro-batches per replica):
   ZeRO 0 to 3, the static memory per GPU (weights, gradients, optimizer states), the simulated
   peak, iteration time and the communication left exposed.
2. TP 4 x PP 4 (one replica), global batch 32, micro-batch 4 (8 micro-batches) and 16
   (2 micro-batches): 1F1B against ZB-H1, iteration time and pipeline bubble of the first stage.

Times are the simulator's with the built-in A100 spec; nothing is measured on GPUs here.
Run: .venv/bin/python benchmarks/zero_and_zb.py
"""

from __future__ import annotations

import time

GIB = 2**30


def main() -> None:
    from planlab.explore import Setup, make_context
    from planlab.models import ModelSpec
    from planlab.plan import materialize
    from planlab.search_spaces import get_space
    from planlab.simulator import simulate

    space = get_space("megatron")
    for batch, cases in (
        (256, [dict(dp=16, tp=1, pp=1, microbatch=2, zero=z) for z in range(4)]),
        (32, [dict(dp=1, tp=4, pp=4, microbatch=mb, schedule=s) for mb in (4, 16) for s in ("1f1b", "zb-h1")]),
    ):
        t0 = time.perf_counter()
        ctx, cost, graph = make_context(Setup(ModelSpec("gpt3-6.7b"), "dgx-a100-80g", 2, batch))
        print(f"gpt3-6.7b, global batch {batch}, traced in {time.perf_counter() - t0:.1f} s")
        for knobs in cases:
            plan = space.build(ctx, knobs)
            t0 = time.perf_counter()
            prog = materialize(plan, graph, symmetric=True, node_of=cost.cluster.node_of)
            res = simulate(prog, cost, model_flops=3.0 * graph.flops)
            dev = res.devices[0]
            static = max(d.static_bytes for d in prog.devices)
            what = " ".join(f"{k}={v}" for k, v in knobs.items())
            print(
                f"  {what:48s} iteration {res.iter_time_s:7.3f} s  static {static / GIB:5.1f} GiB  "
                f"peak {res.peak_mem_bytes / GIB:6.1f} GiB  exposed comm {dev.exposed_comm_s:6.3f} s  "
                f"bubble {dev.bubble_s:6.3f} s  ({time.perf_counter() - t0:.1f} s)"
            )


if __name__ == "__main__":
    main()
