"""Measured timelines: the executor's per-task times as simulator events, and the
comparison of a simulated iteration with a measured one, task by task.

Both timelines are lists of :class:`~planlab.simulator.Event` (device, stream,
action, task name, start, end), so they write the same Chrome/Perfetto trace
(:func:`~planlab.simulator.write_chrome_trace`) and can be opened side by side.
A task is matched to its twin by ``(device, action, task name, occurrence)``:
a block may hold several tasks of one name, and the simulator fuses consecutive
compute tasks into segments but still emits one event per task.

Measured times are wall-clock times of the blocking call on the rank's process,
relative to the start of the iteration (after a barrier): a send (``S``) is the
time to issue the non-blocking ``isend``, a receive (``R``) includes the wait
for its sender, a collective (``C``) includes the wait for the slowest member.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from planlab.plan.program import Program
from planlab.simulator.result import TRACE_THREADS, Event, SimResult, write_chrome_trace

#: The trace stream each task kind is drawn on, as in the simulator.
STREAMS: dict[str, str] = {
    "F": "compute",
    "B": "compute",
    "L": "compute",
    "O": "compute",
    "C": "comm",
    "S": "comm",
    "R": "wait",
}
KINDS: tuple[str, ...] = ("F", "B", "C", "S", "R", "L", "O")


@dataclass(frozen=True)
class Prediction:
    """The Program of a plan and its simulation with every device (no symmetry) and a timeline."""

    program: Program
    sim: SimResult


def predict(plan, *, profile: str | None = None, cost=None) -> Prediction:
    """Materialize ``plan`` as the executor runs it, check it for deadlocks and simulate every
    device with a timeline, priced by ``cost`` (a CostModel), else by the plan's cluster spec and
    software or by a calibration ``profile`` (checked before any work)."""
    from planlab.costmodel import CostModel
    from planlab.plan import materialize, trace_plan_model
    from planlab.plan.shared_params import training_flops
    from planlab.simulator import find_deadlock, simulate

    if cost is None:
        cost = CostModel.load(
            plan.cluster,
            plan.nodes,
            profile=profile,
            software=plan.software or None,
            precision=plan.precision or None,
        )
    graph = trace_plan_model(plan)
    program = materialize(plan, graph)
    if program.num_tasks() < 200_000:
        find_deadlock(program)
    sim = simulate(program, cost, model_flops=training_flops(graph), timeline=True, symmetry=False)
    return Prediction(program, sim)


def measured_events(timings: Iterable[dict]) -> list[Event]:
    """Events from the executor's task timings (dicts with device, action, task, kind, start_s, end_s)."""
    return [
        Event(int(t["device"]), STREAMS[t["kind"]], t["action"], t["task"], float(t["start_s"]), float(t["end_s"]))
        for t in timings
    ]


def write_trace(path: str | os.PathLike, events: Sequence[Event]) -> None:
    """A Chrome/Perfetto trace of ``events`` in the simulator's format (a process per device,
    a thread per stream)."""
    write_chrome_trace(path, [(e.device, e.stream, e.action, e.name, e.start_s, e.end_s) for e in events])


def read_trace(path: str | os.PathLike) -> list[Event]:
    """The task events of a Chrome/Perfetto trace written by :func:`write_trace`,
    ``planlab run --trace`` or ``--predicted-trace`` (or ``SimResult.write_trace``), in file order."""
    import json

    from planlab.errors import ConfigError

    try:
        events = json.loads(Path(path).read_text())["traceEvents"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{os.fspath(path)!r} is not a trace written by planlab ({e})") from None
    names = {v: k for k, v in TRACE_THREADS.items()}
    return [
        Event(
            int(e["pid"]), names.get(e["tid"], "other"), e["cat"], e["name"], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6
        )
        for e in events
        if e.get("ph") == "X"
    ]


def task_lists(events: Iterable[Event]) -> dict[tuple[int, str], list[str]]:
    """Per ``(device, action)``, the task names in start order (ties kept in event order)."""
    out: dict[tuple[int, str], list[str]] = defaultdict(list)
    for e in sorted(events, key=lambda e: (e.device, e.start_s)):
        out[(e.device, e.action)].append(e.name)
    return dict(out)


def _kinds(program: Program) -> dict[tuple[int, str, str], str]:
    """``(device, action, task name) -> kind code`` from the Program."""
    out: dict[tuple[int, str, str], str] = {}
    for dp in program.devices:
        for a, t in dp.tasks_in_order():
            out[(dp.device, str(a), t.name)] = t.kind.value
    return out


def _keyed(events: Iterable[Event]) -> dict[tuple[int, str, str, int], Event]:
    seen: dict[tuple[int, str, str], int] = defaultdict(int)
    out = {}
    for e in sorted(events, key=lambda e: (e.device, e.start_s)):
        k = (e.device, e.action, e.name)
        out[k + (seen[k],)] = e
        seen[k] += 1
    return out


def task_table(program: Program, predicted: Sequence[Event], measured: Sequence[Event]):
    """One row per task: device, action, name, occurrence, kind, ``predicted_s``, ``measured_s``,
    ``miss_s`` (measured - predicted). Tasks present on one side only have NaN on the other."""
    import pandas as pd

    kinds = _kinds(program)
    p, m = _keyed(predicted), _keyed(measured)
    rows = []
    for key in list(p) + [k for k in m if k not in p]:
        dev, action, name, occ = key
        pe, me = p.get(key), m.get(key)
        ps = pe.end_s - pe.start_s if pe else float("nan")
        ms = me.end_s - me.start_s if me else float("nan")
        rows.append(
            dict(
                device=dev,
                action=action,
                name=name,
                occurrence=occ,
                kind=kinds.get((dev, action, name), "?"),
                predicted_s=ps,
                measured_s=ms,
                miss_s=ms - ps,
            )
        )
    return pd.DataFrame(
        rows, columns=["device", "action", "name", "occurrence", "kind", "predicted_s", "measured_s", "miss_s"]
    )


def kind_table(tasks) -> "pd.DataFrame":  # noqa: F821
    """Per task kind (F, B, C, S, R, L, O): task count, predicted and measured total seconds
    over all devices, and measured / predicted."""
    import pandas as pd

    g = tasks.groupby("kind").agg(
        tasks=("name", "size"), predicted_s=("predicted_s", "sum"), measured_s=("measured_s", "sum")
    )
    g = g.reindex([k for k in KINDS if k in g.index] + [k for k in g.index if k not in KINDS]).fillna(0)
    g["tasks"] = g["tasks"].astype(int)
    g["ratio"] = g["measured_s"] / g["predicted_s"].where(g["predicted_s"] > 0)
    g.index.name = "kind"
    return pd.DataFrame(g)


def compare(program: Program, predicted: Sequence[Event], measured: Sequence[Event]):
    """The comparison report as a DataFrame: :func:`kind_table` of :func:`task_table`;
    ``attrs["tasks"]`` holds the per-task table."""
    tasks = task_table(program, predicted, measured)
    out = kind_table(tasks)
    out.attrs["tasks"] = tasks
    return out


def largest_misses(tasks, n: int = 5):
    """The ``n`` tasks whose measured time differs most from the prediction (absolute seconds)."""
    t = tasks.dropna(subset=["miss_s"])
    return t.loc[t["miss_s"].abs().sort_values(ascending=False).index[:n]]


def format_report(report, n: int = 5) -> str:
    """Text of :func:`compare`'s result: the per-kind table in milliseconds and the ``n`` largest misses."""
    lines = [
        "predicted against measured, all devices (ms):",
        f"  {'kind':4s} {'tasks':>6s} {'predicted':>11s} {'measured':>11s} {'ratio':>7s}",
    ]
    for kind, r in report.iterrows():
        ratio = f"{r['ratio']:.2f}" if r["ratio"] == r["ratio"] else "-"
        lines.append(
            f"  {kind:4s} {int(r['tasks']):6d} {r['predicted_s'] * 1e3:11.3f} {r['measured_s'] * 1e3:11.3f} {ratio:>7s}"
        )
    tasks = report.attrs.get("tasks")
    if tasks is not None and len(tasks):
        lines.append("largest misses (ms):")
        for _, r in largest_misses(tasks, n).iterrows():
            lines.append(
                f"  device {r['device']} {r['action']:>5s} {r['kind']}:{r['name']:32s} predicted "
                f"{r['predicted_s'] * 1e3:8.3f}, measured {r['measured_s'] * 1e3:8.3f} "
                f"({r['miss_s'] * 1e3:+.3f})"
            )
    return "\n".join(lines)
