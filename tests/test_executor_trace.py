"""Measured timelines: 2 gloo ranks run a DP, a TP and a PP plan of gpt-tiny; the measured
trace must hold the same tasks as the simulated one (every device simulated, no symmetry),
in the same order per device and action, and the report must cover every task kind run."""

import json
from collections import defaultdict

import pytest

from planlab.cli import main
from planlab.executor import launch_local
from planlab.executor.timeline import compare, format_report, largest_misses, measured_events, predict, task_lists
from planlab.plan import save_plan
from planlab.search_spaces import Context, get_space

from conftest import traced

PLANS = {
    "dp": dict(dp=2, tp=1, pp=1, microbatch=2),  # 2 micro-batches, gradient all-reduce
    "tp": dict(dp=1, tp=2, pp=1, microbatch=8),  # Megatron column/row parallel
    "pp": dict(dp=1, tp=1, pp=2, microbatch=2),  # 1F1B, 4 micro-batches, sends and receives
}


def _plan(name):
    spec, g = traced("gpt-tiny", 8)
    return get_space("megatron").build(Context(g, spec, 8, "cpu", 2, 2, 1), PLANS[name])


def _trace_task_lists(path):
    """Per (device, action) the task names of a Chrome trace file, in start order."""
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    out = defaultdict(list)
    for e in sorted(events, key=lambda e: (e["pid"], e["ts"])):
        out[(e["pid"], e["cat"])].append(e["name"])
    return dict(out)


def _program_task_lists(program):
    out = defaultdict(list)
    for dp in program.devices:
        for a, t in dp.tasks_in_order():
            out[(dp.device, str(a))].append(t.name)
    return dict(out)


@pytest.mark.parametrize("name", ["tp", "pp"])
def test_measured_tasks_equal_simulated_tasks(name):
    plan = _plan(name)
    pred = predict(plan)
    res = launch_local(plan, 2, steps=2, lr=1e-2, check=False, record=True)
    measured = measured_events(res.timeline)
    assert {e.device for e in measured} == {0, 1}
    assert task_lists(measured) == _program_task_lists(pred.program)  # the Program's order on every device
    # the simulated trace: the same tasks per device and action, in the same order on each stream (an
    # overlapped collective may start on the simulated comm stream before compute listed ahead of it)
    sim = pred.sim.events
    assert {k: sorted(v) for k, v in task_lists(measured).items()} == {k: sorted(v) for k, v in task_lists(sim).items()}
    for stream in ("compute", "comm"):
        assert task_lists([e for e in measured if e.stream == stream]) == task_lists(
            [e for e in sim if e.stream == stream]
        )
    streams = {e.stream for e in measured}
    assert streams == ({"compute", "comm"} if name == "tp" else {"compute", "comm", "wait"})
    assert all(0 <= e.start_s <= e.end_s for e in measured)
    for dev in (0, 1):  # one rank runs its tasks one after another
        ev = sorted((e for e in measured if e.device == dev), key=lambda e: e.start_s)
        assert all(a.end_s <= b.start_s for a, b in zip(ev, ev[1:]))

    report = compare(pred.program, pred.sim.events, measured)
    kinds = {"F", "B", "L", "O"} | ({"C"} if name == "tp" else {"S", "R"})
    assert set(report.index) == kinds
    tasks = report.attrs["tasks"]
    assert len(tasks) == len(measured) and not tasks[["predicted_s", "measured_s"]].isna().any().any()
    assert report["tasks"].sum() == len(measured)
    assert (report["measured_s"] > 0).all() and (report["predicted_s"] > 0).all()
    top = largest_misses(tasks, 5)
    assert len(top) == 5 and list(top["miss_s"].abs()) == sorted(top["miss_s"].abs(), reverse=True)
    text = format_report(report)
    assert "largest misses" in text and all(f"\n  {k} " in text for k in kinds)


def test_cli_run_writes_both_traces_with_the_same_tasks(tmp_path, capsys):
    """The DP plan through ``planlab run --trace``: measured and predicted trace files side by side."""
    plan_file = tmp_path / "dp.json"
    save_plan(_plan("dp"), plan_file)
    measured, predicted = tmp_path / "measured.json", tmp_path / "predicted.json"
    assert (
        main(
            [
                "run",
                str(plan_file),
                "--nproc",
                "2",
                "--steps",
                "2",
                "--trace",
                str(measured),
                "--predicted-trace",
                str(predicted),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "PASSED" in out and "predicted against measured" in out and "largest misses" in out
    m, p = _trace_task_lists(measured), _trace_task_lists(predicted)
    assert m == p and {d for d, _ in m} == {0, 1}
    assert sum(map(len, m.values())) == sum(map(len, _program_task_lists(predict(_plan("dp")).program).values()))
    meta = [e for e in json.loads(measured.read_text())["traceEvents"] if e["ph"] == "M"]
    assert {(e["pid"], e["args"]["name"]) for e in meta if e["name"] == "thread_name"} == {
        (d, s) for d in (0, 1) for s in ("compute", "comm", "wait")
    }


def test_read_trace_returns_the_events_written(tmp_path):
    """A simulated trace read back (as the calibration notebook compares `planlab run`'s two files):
    the same events, streams and times; a file that is not a trace is a ConfigError naming it."""
    from planlab.errors import ConfigError
    from planlab.executor.timeline import read_trace

    sim = predict(_plan("pp")).sim
    sim.write_trace(tmp_path / "p.json")
    back = read_trace(tmp_path / "p.json")
    assert [(e.device, e.stream, e.action, e.name) for e in back] == [
        (e.device, e.stream, e.action, e.name) for e in sim.events
    ]
    assert {e.stream for e in back} == {"compute", "comm", "wait"}
    assert max(abs(a.start_s - b.start_s) + abs(a.end_s - b.end_s) for a, b in zip(back, sim.events)) < 1e-12
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="bad.json' is not a trace written by planlab"):
        read_trace(tmp_path / "bad.json")
