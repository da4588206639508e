"""Time to build, materialize and simulate GPT-3 175B plans on 128 A100s (16 DGX nodes).

Prints one line per plan: the knobs, seconds for each stage, the number of device classes,
and the simulated iteration. Run: .venv/bin/python benchmarks/simulate_speed.py
"""

import time

from planlab.explore import Setup, make_context
from planlab.models import ModelSpec
from planlab.plan import materialize
from planlab.search_spaces import get_space
from planlab.simulator import device_classes, simulate


def main() -> None:
    t = time.perf_counter()
    ctx, cost, graph = make_context(Setup(ModelSpec("gpt3-175b"), "dgx-a100-80g", 16, 1536))
    print(f"trace GPT-3 175B at batch 1536: {time.perf_counter() - t:.2f} s, {len(graph.operators)} operators")
    space = get_space("megatron")
    for knobs in (
        dict(pp=16, dp=1, tp=8, microbatch=1),
        dict(pp=8, dp=2, tp=8, microbatch=1),
        dict(pp=16, dp=2, tp=4, microbatch=2),
    ):
        t0 = time.perf_counter()
        plan = space.build(ctx, knobs)
        t1 = time.perf_counter()
        program = materialize(plan, graph)
        t2 = time.perf_counter()
        res = simulate(program, cost, model_flops=3 * graph.flops)
        t3 = time.perf_counter()
        classes = len(set(device_classes(program, cost.cluster)))
        print(
            f"{knobs}: build {t1 - t0:.2f} s, materialize {t2 - t1:.2f} s, simulate {t3 - t2:.2f} s "
            f"({classes} device classes of {program.num_devices}, {plan.microbatches} micro-batches) -> "
            f"{res.summary()}"
        )


if __name__ == "__main__":
    main()
