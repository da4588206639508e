"""Peak memory of each rank against its pieces and the whole model: every rank builds only the
regions of parameters it holds, so its peak resident set grows with its pieces (16 bytes per
element while training: weight, gradient, Adam's two moments), not with the whole model.

Runs a GPT of about 120M parameters (470 MiB of fp32 weights) under tensor-, pipeline- and
tensor x pipeline-parallel plans on 2 and 4 local gloo processes (no numeric check: its
single-process reference would hold the whole model) and prints, per rank, the weights it
holds, what its pieces take while training, its peak RSS and the part of it above the
process's start-up (Python, torch, the process group), beside the whole model's weights.

Run: .venv/bin/python benchmarks/executor_memory.py [--layers 4 --hidden 1024 --vocab 32768 --seq 64 --batch 4]
"""

from __future__ import annotations

import argparse

from planlab.executor import launch_local
from planlab.executor.shards import held_elements, rank_bytes
from planlab.graph import trace
from planlab.models import ModelSpec, build_model
from planlab.plan import materialize
from planlab.search_spaces import Context, get_space

MIB = 2**20
PLANS = [
    (2, dict(dp=1, tp=2, pp=1)),
    (2, dict(dp=1, tp=1, pp=2)),
    (4, dict(dp=1, tp=2, pp=2)),
    (4, dict(dp=1, tp=1, pp=4)),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=4)
    a = ap.parse_args()
    spec = ModelSpec(
        "gpt", (("heads", a.heads), ("hidden", a.hidden), ("layers", a.layers), ("seq", a.seq), ("vocab", a.vocab))
    )
    meta, inputs = build_model(spec, batch=a.batch)
    graph = trace(meta, inputs)
    whole = 4 * graph.num_params
    print(
        f"{spec}: {graph.num_params / 1e6:.1f}M parameters, whole model {whole / MIB:.0f} MiB of fp32 weights "
        f"({4 * whole / MIB:.0f} MiB with gradients and Adam states); batch {a.batch}"
    )
    print(
        f"{'plan':22s} {'rank':>4s} {'weights held':>13s} {'pieces x16':>11s} {'peak RSS':>10s} "
        f"{'above start-up':>15s} {'above / whole weights':>22s}"
    )
    for n, knobs in PLANS:
        plan = get_space("megatron").build(
            Context(graph, spec, a.batch, "cpu", n, n, 1),
            dict(knobs, microbatch=a.batch // max(1, knobs["dp"]) // knobs["pp"]),
        )
        program = materialize(plan, graph)
        res = launch_local(plan, n, steps=2, check=False)
        name = " ".join(f"{k}={v}" for k, v in knobs.items() if v > 1)
        for r in range(n):
            above = res.peak_mem_bytes[r] - res.base_mem_bytes[r]
            print(
                f"{name:22s} {r:4d} {4 * held_elements(program, r) / MIB:9.0f} MiB {rank_bytes(program, r) / MIB:7.0f} "
                f"MiB {res.peak_mem_bytes[r] / MIB:6.0f} MiB {above / MIB:11.0f} MiB {above / whole:22.2f}"
            )


if __name__ == "__main__":
    main()
