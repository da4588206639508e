"""The calibration's kernel timings against the same kernels run by planlab's executor, at the same
moment: does ``planlab calibrate`` measure what the executor does?

Runs a one-process plan of ``--model`` in this process with planlab's interpreter, and after each
iteration one round of the calibration's kernel cases (``planlab.costmodel.calibrate._Case``, in
the calibration's chunks, so each case is as warm as when calibrating) whose shapes are the
model's. Alternating the two in one loop puts both under the same load, which on a shared
machine drifts from minute to minute. Prints, per operator, the lower quartile of the
calibration's samples and of the executor's task durations (forward less the executor's cost per
task, measured as ``calibrate`` measures it), and their ratio; and the optimizer step in the
iteration against the profile's fit, if ``--profile`` is given.

    .venv/bin/python benchmarks/kernels_in_situ.py [--model gpt-small] [--iterations 24] [--profile cpu.json]
"""

from __future__ import annotations

import argparse
from collections import defaultdict

BATCH = 8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-small")
    ap.add_argument("--iterations", type=int, default=24)
    ap.add_argument("--profile", default=None, help="a profile: also compare its optimizer fit")
    args = ap.parse_args()

    import torch

    from planlab.costmodel.calibrate import CHUNK, _Case, _cases, measure_task_overheads, typical_s
    from planlab.executor.interpreter import Interpreter
    from planlab.executor.run import keep_freed_memory
    from planlab.graph.trace import trace
    from planlab.models.registry import ModelSpec, build_model
    from planlab.plan.materialize import materialize
    from planlab.search_spaces.builtin import get_space
    from planlab.search_spaces.space import Context

    torch.set_num_threads(1)
    keep_freed_memory()
    spec = ModelSpec(args.model)
    graph = trace(*build_model(spec, batch=BATCH))
    plan = get_space("megatron").build(
        Context(graph, spec, BATCH, "cpu", 1, 1, 1), dict(dp=1, tp=1, pp=1, microbatch=BATCH)
    )
    program = materialize(plan, graph)
    module, inputs = build_model(spec, batch=BATCH, device="cpu", seed=0)
    interp = Interpreter(program, graph, 0, module, inputs, {}, lr=1e-3)
    interp.record = True

    # the model's operators whose local shapes the calibration measures: (kind, case shape) -> operator
    tasks = [t for _, t in program.devices[0].tasks_in_order() if t.kind.value == "F" and t.shapes]
    wanted: dict[tuple, str] = {}
    for t in tasks:
        s = t.shapes
        key = {
            "linear": lambda: ("linear", (s[0][0] * s[0][1], s[0][-1], s[1][0])) if len(s[0]) == 3 else None,
            "attention": lambda: ("attention", tuple(s[0])),
            "layer_norm": lambda: ("layer_norm", (s[0][0] * s[0][1], s[0][-1])),
            "activation": lambda: ("activation", (s[0][0] * s[0][1], s[0][-1])),
            "add": lambda: ("add", (s[-1][0] * s[-1][1], s[-1][-1])) if len(s[0]) == len(s[1]) else None,
        }.get(t.op_kind, lambda: None)()
        if key is not None:
            wanted.setdefault(key, t.op)
    cases = _cases(False)
    chunks = sorted({i // CHUNK for i, (k, shape, _, _) in enumerate(cases) if (k, shape) in wanted})
    if not chunks:
        raise SystemExit(f"none of {args.model}'s kernel shapes is among the calibration's cases")
    groups = []
    for ch in chunks:
        group = [
            (k, shape, _Case(k, make, ins, torch.float32))
            for k, shape, make, ins in cases[ch * CHUNK : (ch + 1) * CHUNK]
        ]
        for _, _, c in group:  # warm up every set once, as the calibration does
            for _ in range(len(c.sets)):
                c.sample()
            c.fwd.clear()
            c.bwd.clear()
        groups.append(group)

    samples: dict[tuple[str, str], list[float]] = defaultdict(list)
    for _ in range(args.iterations):
        interp.run_iteration()
        for t in interp.timeline:
            samples[(t.kind, t.task)].append(t.end_s - t.start_s)
        for group in groups:
            for _, _, c in group:
                c.sample()
    from planlab.costmodel.profile import Profile

    overheads, _ = measure_task_overheads(Profile("cpu", (), ()), quick=True)
    fwd_overhead = overheads.get("F", 0.0)
    print(
        f"{args.model}, {args.iterations} iterations; the executor's cost per forward task {fwd_overhead * 1e6:.1f} us"
    )
    for group in groups:
        for kind, shape, c in group:
            op = wanted.get((kind, shape))
            if op is None:
                continue
            ef = typical_s(samples[("F", op)]) - fwd_overhead
            eb = typical_s(samples[("B", op)])
            cf, cb = typical_s(c.fwd), typical_s(c.bwd)
            print(
                f"  {kind}{list(shape)} ({op}): forward calibration {cf * 1e6:7.1f} us, executor {ef * 1e6:7.1f} us, "
                f"ratio {cf / ef:.2f} | backward {cb * 1e6:7.1f} us, {eb * 1e6:7.1f} us, ratio {cb / eb:.2f}"
            )
    opt = [typical_s(v) for (k, _), v in samples.items() if k == "O"]
    if opt:
        line = f"  optimizer step in the iteration: {opt[0] * 1e3:.2f} ms"
        if args.profile:
            from planlab.costmodel import CostModel

            cost = CostModel.load("cpu", 1, profile=args.profile)
            task = next(t for _, t in program.devices[0].tasks_in_order() if t.kind.value == "O")
            line += f"; the profile's price {cost.task_time_s(task, 'fp32') * 1e3:.2f} ms"
        print(line)


if __name__ == "__main__":
    main()
