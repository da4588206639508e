"""Where a published row's predicted iteration goes, per device class, from the simulated timeline:
computation by kind (GEMMs with dense weights, the experts' GEMMs, attention, the routing's
operators, the rest), communication by kind (collectives by kind and group, pipeline messages), and what the class waits
for (exposed communication, pipeline bubble, the rest idle).

Each row of a set of ``benchmarks/data/`` is built as ``validate_published.py`` builds it,
materialized and simulated with its timeline; a task's kind is read from the Program (its
operator's kind, its collective and group), so nothing is parsed from names.

    .venv/bin/python benchmarks/time_breakdown.py --set megatron-bridge-25.09-h100 [--row NAME]
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from planlab.costmodel import load_cluster
from planlab.explore import Setup, make_context, training_flops
from planlab.plan.program import TaskKind
from planlab.plan.software_passes import build_program
from planlab.published import load_sets
from planlab.search_spaces.builtin import get_space
from planlab.search_spaces.experts import EXPERT_WEIGHTS
from planlab.simulator.engine import simulate

DATA = Path(__file__).resolve().parent / "data"

# operator kinds of a mixture of experts' dispatch and combine around the experts' GEMMs
ROUTING_KINDS = frozenset({"scatter", "gather", "one_hot", "cumsum", "topk"})
ATTENTION_KINDS = frozenset({"attention"})


def kind_of(task, expert_ops: frozenset[str]) -> str:
    """The breakdown's kind of one task of a Program."""
    if task.kind is TaskKind.COLLECTIVE:
        return f"{task.collective} ({len(task.group)} ranks)"
    if task.kind in (TaskKind.SEND, TaskKind.RECV):
        return "pipeline messages"
    if task.kind is TaskKind.OPTIMIZER:
        return "optimizer"
    op = task.op_kind
    if op == "matmul" and task.op in expert_ops:
        return "GEMM (experts)"
    if op in ("linear", "matmul"):
        return "GEMM (dense)"
    if op in ATTENTION_KINDS:
        return "attention core"
    if op in ROUTING_KINDS:
        return "routing (dispatch, combine)"
    if task.kind is TaskKind.LOCAL:
        return "local copies"
    return f"element-wise ({op or task.kind.name.lower()})"


def report(s, row, top: int) -> None:
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
    plan = get_space("megatron").build(ctx, row.knobs())
    program = build_program(plan, graph, cost)
    res = simulate(program, cost, model_flops=training_flops(graph), timeline=True)
    expert_ops = frozenset(
        op.name for op in graph.operators if op.kind == "matmul" and any(EXPERT_WEIGHTS.search(t) for t in op.inputs)
    )
    print(f"\n== {row.row}: {row.gpus} x {cost.cluster.device.name}, software {cost.software}, {row.precision}")
    print(f"   predicted {res.iter_time_s:.2f} s against {s.measured_s(row):.2f} s measured")
    for d in res.devices:
        dp = program.device(d.device)
        kinds = {t.name: kind_of(t, expert_ops) for _, t in dp.tasks_in_order()}
        busy: dict[str, Counter] = {"compute": Counter(), "comm": Counter()}
        for e in res.events:
            if e.device == d.device and e.stream in busy:
                busy[e.stream][kinds.get(e.name, kinds.get(e.name.removeprefix("re:"), "other"))] += e.end_s - e.start_s
        print(
            f"   device {d.device} (x{d.members}): {d.finish_s:.2f} s = computing {d.compute_s:.2f} + exposed "
            f"communication {d.exposed_comm_s:.2f} + bubble {d.bubble_s:.2f} + idle {d.idle_s:.2f}"
        )
        for stream, label in (("compute", "computing"), ("comm", "communicating (exposed or not)")):
            shown = ", ".join(f"{k} {v:.2f}" for k, v in busy[stream].most_common(top) if v >= 0.005)
            print(f"      {label}: {shown}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", required=True, metavar="NAME", help="a set of benchmarks/data")
    ap.add_argument("--row", default=None, help="one row of the set (default: every runnable row)")
    ap.add_argument("--top", type=int, default=10, help="how many kinds to print per stream and device class")
    ap.add_argument("--data", default=str(DATA), help="the folder of the sets")
    args = ap.parse_args()
    (s,) = load_sets(args.data, [args.set])
    rows = [r for r in s.rows if r.runnable and (args.row is None or r.row == args.row)]
    if not rows:
        ap.error(
            f"no runnable row {args.row!r} in set {args.set!r}; choose from {[r.row for r in s.rows if r.runnable]}"
        )
    for row in rows:
        report(s, row, args.top)


if __name__ == "__main__":
    main()
