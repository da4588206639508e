"""The executor's overhead: planlab's Interpreter running a single-device plan against a plain
PyTorch training step (forward, backward, Adam) of the same model, on this CPU, one thread.

Both run in this process (the Interpreter in a one-rank gloo group), alternating step by
step so that a load from elsewhere on the machine hits both alike; the script prints both
median step times and planlab / plain per repetition, and the median ratio over the
repetitions (target: at most 1.10). ``--profile`` prints the Interpreter's hottest functions
(cProfile) instead.

Run: .venv/bin/python benchmarks/executor_overhead.py [--model gpt-small] [--batch 8] [--steps 30] [--repeats 5]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import socket
import statistics
import time

import torch
import torch.distributed as dist

from planlab.executor import Interpreter
from planlab.executor.run import keep_freed_memory
from planlab.models import ModelSpec, build_model
from planlab.plan import materialize, trace_plan_model
from planlab.search_spaces import Context, get_space


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_interpreter(spec: ModelSpec, batch: int, lr: float) -> Interpreter:
    """A single-device plan of ``spec`` (one micro-batch) in an Interpreter on rank 0."""
    from planlab.graph import trace

    meta, meta_inputs = build_model(spec, batch=batch)
    graph = trace(meta, meta_inputs)
    plan = get_space("megatron").build(
        Context(graph, spec, batch, "cpu", 1, 1, 1), dict(dp=1, tp=1, pp=1, microbatch=batch)
    )
    graph = trace_plan_model(plan)
    program = materialize(plan, graph)
    module, inputs = build_model(spec, batch=batch, device="cpu", seed=0)
    return Interpreter(program, graph, 0, module, inputs, {}, lr=lr)


def plain_step(spec: ModelSpec, batch: int, lr: float):
    """A closure running one plain PyTorch training step of ``spec``; returns the loss."""
    model, inputs = build_model(spec, batch=batch, device="cpu", seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=lr)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = model(*inputs)
        loss.backward()
        opt.step()
        return float(loss.detach())

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-small")
    ap.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5, help="repetitions; the median ratio is printed last")
    ap.add_argument("--profile", action="store_true", help="cProfile the Interpreter's steps")
    ap.add_argument(
        "--malloc-default",
        action="store_true",
        help="leave glibc's malloc as it is (the executor's workers keep freed memory)",
    )
    a = ap.parse_args()
    torch.set_num_threads(1)
    kept = False if a.malloc_default else keep_freed_memory()  # as each worker does; for both runs alike
    args = tuple(sorted((k, int(v)) for k, v in (kv.split("=", 1) for kv in a.model_arg)))
    spec = ModelSpec(a.model, args)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        interp = make_interpreter(spec, a.batch, 1e-3)
        plain = plain_step(spec, a.batch, 1e-3)
        tasks = sum(len(interp.dp.block(x).tasks) for x in interp.dp.schedule)
        for _ in range(a.warmup):
            l_plan, l_plain = interp.run_iteration(), plain()
        if abs(l_plan - l_plain) > 1e-4:
            raise SystemExit(f"losses differ after warm-up: planlab {l_plan:.6f}, plain {l_plain:.6f}")
        if a.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(a.steps):
                interp.run_iteration()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
            return
        print(
            f"{spec.name}{dict(args) if args else ''}, batch {a.batch}, 1 thread, {tasks} tasks per step, "
            f"{a.warmup} warm-up + {a.steps} timed steps each per repetition, freed memory kept in the process: "
            f"{kept}"
        )
        print(
            f"  {'rep':>3s}  {'plain wall':>10s} {'planlab wall':>12s} {'ratio':>6s}   {'plain CPU':>9s} "
            f"{'planlab CPU':>11s} {'ratio':>6s}   (median per step, ms)"
        )
        walls, cpus, per_task = [], [], []
        for rep in range(a.repeats):
            t_plan, t_plain, c_plan, c_plain = [], [], [], []
            for _ in range(a.steps):  # alternate, so load from elsewhere hits both alike
                t0, c0 = time.perf_counter(), time.process_time()
                interp.run_iteration()
                t1, c1 = time.perf_counter(), time.process_time()
                plain()
                t2, c2 = time.perf_counter(), time.process_time()
                t_plan.append(t1 - t0)
                t_plain.append(t2 - t1)
                c_plan.append(c1 - c0)
                c_plain.append(c2 - c1)
            mp, mq = statistics.median(t_plan), statistics.median(t_plain)
            cp, cq = statistics.median(c_plan), statistics.median(c_plain)
            walls.append(mp / mq)
            cpus.append(cp / cq)
            per_task.append((cp - cq) / tasks)
            print(
                f"  {rep:3d}  {mq * 1e3:10.3f} {mp * 1e3:12.3f} {mp / mq:6.3f}   {cq * 1e3:9.3f} {cp * 1e3:11.3f} "
                f"{cp / cq:6.3f}"
            )
        print(
            f"  median over {a.repeats} repetitions: planlab/plain {statistics.median(walls):.3f} wall, "
            f"{statistics.median(cpus):.3f} CPU (target <= 1.10); per-task overhead "
            f"{statistics.median(per_task) * 1e6:.1f} us CPU"
        )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
