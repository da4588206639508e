"""Where a published row's predicted iteration goes, per device class, from the simulated timeline:
computation by kind (GEMMs with dense weights, the experts' GEMMs, attention, the routing's
operators, the rest), communication by kind (collectives by kind and group, pipeline messages),
and what the class waits for (exposed communication, pipeline bubble, the rest idle).

Each row of a set of ``benchmarks/data/`` is built as ``validate_published.py`` builds it,
materialized and simulated with its timeline; a task's kind is read from the Program (its
operator's kind, its collective and group), so nothing is parsed from names. One limit: the
timeline keeps each part of a DualPipe pair (``planlab/simulator/pairs.py``) as one event, named
after the part's fullest task, so a paired schedule's kinds are its parts', not every task's; the
class totals (computing, exposed communication, bubble) hold.

    .venv/bin/python benchmarks/time_breakdown.py --set megatron-bridge-25.09-h100 [--row NAME]
"""

from __future__ import annotations

import argparse
from collections import Counter

from planlab.explore import training_flops
from planlab.plan.program import TaskKind
from planlab.plan.software_passes import build_program
from planlab.search_spaces.experts import EXPERT_WEIGHTS
from planlab.simulator.engine import simulate

from memory_breakdown import row_plan, run_rows  # the same rows and command line

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


def report(s, row, top: int, overrides: dict) -> None:
    cost, graph, plan = row_plan(row, overrides)
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


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", required=True, metavar="NAME", help="a published set of benchmarks/data")
    parser.add_argument("--row", default=None, help="one row of it (default: every runnable row)")
    parser.add_argument("--top", type=int, default=10, help="how many kinds to print per stream and device class")
    run_rows(parser, report)
