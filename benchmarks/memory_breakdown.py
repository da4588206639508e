"""Where a published row's device memory goes: the capacity and what the software reserves of it,
then per device class the static bytes (weights, gradients, optimizer states) and the buffers
alive at the class's fullest moment, by kind and by the operator that made them.

Each row of a set of ``benchmarks/data/`` is built as ``validate_published.py`` builds it (the
row's cluster, model, ``megatron`` space knobs, software and precision), materialized and
simulated. The dynamic part is replayed task by task in each class's schedule order (allocations,
then frees), so its peak is the simulated peak less the static bytes up to what overlapped
collectives hold at the simulated moment.

    .venv/bin/python benchmarks/memory_breakdown.py --set megatron-core-moe-h100 [--row NAME] [--top 8]
        [--knob KNOB=VALUE ...]   (a what-if: e.g. --knob pipeline_group=4)
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from planlab.costmodel import load_cluster
from planlab.errors import ConfigError
from planlab.explore import Setup, make_context, training_flops
from planlab.memory_bound import memory_lower_bound_bytes
from planlab.plan.software_passes import build_program
from planlab.published import load_sets
from planlab.search_spaces.builtin import get_space
from planlab.simulator.engine import simulate

DATA = Path(__file__).resolve().parent / "data"
GiB = 2**30
MiB = 2**20


def fullest_moment(dp, graph) -> tuple[int, str, Counter, Counter]:
    """Replay one device program's tasks in order: the most dynamic bytes alive at once, the task
    where, and those bytes by buffer kind and by (kind, the operator kind that made the tensor)."""
    by_kind: Counter = Counter()
    by_maker: Counter = Counter()
    sizes: dict = {}
    best = (0, "", Counter(), Counter())
    for action, task in dp.tasks_in_order():
        for b, n in task.alloc:
            sizes[(b, action.microbatch)] = (n, _maker(b, graph))
            by_kind[b.kind] += n
            by_maker[(b.kind, _maker(b, graph))] += n
        total = sum(by_kind.values())
        if total > best[0]:
            best = (total, f"{action} {task}", Counter(by_kind), Counter(by_maker))
        for b in task.free:
            n, maker = sizes.pop((b, action.microbatch), (0, ""))
            by_kind[b.kind] -= n
            by_maker[(b.kind, maker)] -= n
    return best


def _maker(b, graph) -> str:
    """The kind of operator that made a buffer's tensor ('' where it is no graph tensor)."""
    op = graph.producer.get(b.tensor)
    return op.kind if op is not None else ""


def row_plan(row, overrides: dict | None = None):
    """``(cost model, graph, plan)`` of a published row, built as ``validate_published.py`` builds it,
    with ``overrides`` (knob: value, the ``--knob`` what-ifs) in place of the row's own knobs."""
    per_node = load_cluster(row.cluster).node.devices_per_node
    setup = Setup(
        row.spec(),
        row.cluster,
        row.nodes(per_node),
        row.global_batch,
        software=row.software,
        precision=row.precision_arg,
    )
    ctx, cost, graph = make_context(setup)
    plan = get_space("megatron").build(ctx, {**row.knobs(), **(overrides or {})})
    return cost, graph, plan


def report(row, top: int, overrides: dict) -> None:
    cost, graph, plan = row_plan(row, overrides)
    mem = cost.software.memory
    cap = cost.cluster.device.memory_bytes
    what_if = "".join(f", {k}={v}" for k, v in overrides.items())
    print(f"\n== {row.row}{what_if}: {row.model} on {row.gpus} x {cost.cluster.device.name}, software {cost.software}")
    print(
        f"   capacity {cap / GiB:.2f} GiB - CUDA context {mem.cuda_context_bytes / MiB:.0f} MiB - NCCL "
        f"{mem.nccl_bytes / MiB:.0f} MiB - workspace {mem.workspace_bytes / MiB:.0f} MiB, x (1 - fragmentation "
        f"{mem.fragmentation:.2f}) = usable {cost.device_memory_bytes / GiB:.2f} GiB"
    )
    static, acts = memory_lower_bound_bytes(plan, graph, cost.precision, cost.software)
    print(f"   explorer's bound: static {static / GiB:.2f} + saved activations {acts / GiB:.2f} GiB")
    program = build_program(plan, graph, cost)
    res = simulate(program, cost, model_flops=training_flops(graph))
    print(
        f"   simulated: {res.iter_time_s:.3f} s, peak {res.peak_mem_bytes / GiB:.2f} GiB{' -- ' + res.reason if res.reason else ''}"
    )
    for d in sorted(res.devices, key=lambda d: -d.peak_mem_bytes):
        dp = program.device(d.device)
        dyn, where, kinds, makers = fullest_moment(dp, graph)
        print(
            f"   device {d.device} (x{d.members}): peak {d.peak_mem_bytes / GiB:.2f} GiB = weights "
            f"{dp.param_bytes / GiB:.2f} + gradients {dp.grad_bytes / GiB:.2f} + optimizer states "
            f"{dp.optimizer_bytes / GiB:.2f} + kept FP8 weight casts {dp.cast_weight_bytes / GiB:.2f} + buffers "
            f"(replayed: {dyn / GiB:.2f}, at {where})"
        )
        shown = ", ".join(f"{k.name.lower()} {v / GiB:.2f}" for k, v in kinds.most_common() if v > MiB)
        print(f"      by kind: {shown}")
        shown = ", ".join(
            f"{k.name.lower()} of {m or '-'} {v / GiB:.2f}" for (k, m), v in makers.most_common(top) if v > MiB
        )
        print(f"      largest: {shown}")


def run_rows(ap: argparse.ArgumentParser, report_row) -> None:
    """Parse the command line of a per-row breakdown (``ap`` with its ``--set``, ``--row`` and
    ``--top``; ``--data`` added here) and run ``report_row(set, row, top, overrides)`` for each runnable row."""
    ap.add_argument("--data", default=str(DATA), help="the folder of the sets")
    ap.add_argument(
        "--knob", action="append", default=[], metavar="KNOB=VALUE", help="a what-if: change one of the row's knobs"
    )
    args = ap.parse_args()
    overrides = {}
    for text in args.knob:
        key, sep, value = text.partition("=")
        if not sep or not key.strip():
            ap.error(f"--knob {text!r}: expected KNOB=VALUE, e.g. pipeline_group=4")
        overrides[key.strip()] = value.strip()
    try:
        (s,) = load_sets(args.data, [args.set])
    except ConfigError as e:
        ap.error(str(e))
    rows = [r for r in s.rows if r.runnable and (args.row is None or r.row == args.row)]
    if not rows:
        ap.error(
            f"no runnable row {args.row!r} in set {args.set!r}; choose from {[r.row for r in s.rows if r.runnable]}"
        )
    for row in rows:
        report_row(s, row, args.top, overrides)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", required=True, metavar="NAME", help="a set of benchmarks/data")
    parser.add_argument("--row", default=None, help="one row of the set (default: every runnable row)")
    parser.add_argument("--top", type=int, default=8, help="how many (kind, maker) groups to print per device class")
    run_rows(parser, lambda s, row, top, overrides: report(row, top, overrides))
