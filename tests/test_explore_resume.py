"""Exploring with rows journaled as they finish: --resume after a real kill ends with the rows of an
uninterrupted run, --ray gives the rows of --jobs, and progress is named phase by phase when stderr
is not a terminal."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

import planlab
from planlab.candidates import JOURNAL, Journal, exploration_header
from planlab.cli import main
from planlab.errors import ConfigError
import planlab.progress as progress_module
from planlab.progress import Lines, progress

BIN = Path(sys.executable).with_name("planlab")
# 2 CPU processes, every plan the memory bound leaves simulated: enough rows to kill a run mid-way
KILLED = ["--model", "gpt-tiny", "--cluster", "cpu", "--nodes", "2", "--global-batch", "8", "--all"]


def _rows(path: Path) -> list[str]:
    return path.read_text().splitlines()[1:] if path.exists() else []


def test_resume_after_a_kill_ends_with_the_rows_of_an_uninterrupted_run(tmp_path):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert main(["explore", *KILLED, "--out", str(whole)]) == 0
    n = len(_rows(whole / JOURNAL))
    assert n > 20
    proc = subprocess.Popen([str(BIN), "explore", *KILLED, "--out", str(cut)], stderr=subprocess.PIPE, text=True)
    while len(_rows(cut / JOURNAL)) < 3 and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    kept = len(_rows(cut / JOURNAL))
    assert 3 <= kept < n and not (cut / "results.csv").exists(), "the run was not killed mid-way"
    assert main(["explore", *KILLED, "--out", str(cut), "--resume"]) == 0
    assert (cut / "results.csv").read_text() == (whole / "results.csv").read_text()
    assert sorted(_rows(cut / JOURNAL)) == sorted(_rows(whole / JOURNAL))
    assert (cut / "best_plan.json").read_text() == (whole / "best_plan.json").read_text()


def _header(**change) -> dict:
    args = dict(
        model={"name": "gpt-tiny", "args": {}},
        cluster="cpu",
        nodes=2,
        global_batch=8,
        space="megatron",
        fixed={},
        profile=None,
        candidates=16,
    )
    return exploration_header(**{**args, **change})


def test_a_journal_resumes_only_its_own_exploration_and_skips_a_cut_line(tmp_path):
    j = Journal(tmp_path, _header(), resume=False)
    row = dict(iter_time_s=0.1, peak_mem_gib=1.5, tflops_per_gpu=float("nan"), mfu=0.2, feasible=True, reason="")
    j.record({"tp": 2, "dp": 1}, row)
    j.close()
    with open(tmp_path / JOURNAL, "a") as f:
        f.write('{"values": {"tp": 1, "dp": 2}, "row": {"iter_')  # the line a kill cut
    again = Journal(tmp_path, _header(), resume=True)
    got = again.row_of({"dp": 1, "tp": 2})
    assert got["iter_time_s"] == 0.1 and got["tflops_per_gpu"] != got["tflops_per_gpu"]
    assert again.row_of({"dp": 2, "tp": 1}) is None
    again.close()
    assert len((tmp_path / JOURNAL).read_text().splitlines()) == 2  # the cut line is gone
    with pytest.raises(ConfigError, match=r"not a journal of this exploration \(it differs in nodes\)"):
        Journal(tmp_path, _header(nodes=4), resume=True)
    (tmp_path / JOURNAL).write_bytes(b"\x00\xff binary")
    with pytest.raises(ConfigError, match="cannot read"):
        Journal(tmp_path, _header(), resume=True)


def test_resume_needs_out(capsys):
    code = main(["explore", "--model", "gpt-tiny", "--cluster", "cpu", "--resume"])
    assert code == 2 and "--resume needs --out" in capsys.readouterr().err


def test_progress_names_each_phase_in_lines_when_stderr_is_not_a_terminal(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(progress_module, "LINE_INTERVAL_S", 0.0)  # a line at every step of these short phases
    assert main(["explore", "--model", "gpt-tiny", "--cluster", "cpu", "--nodes", "2", "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err.splitlines()
    simulated = int(pd.read_csv(tmp_path / "results.csv")["simulated"].sum())
    phases = ("trace: gpt-tiny at batch 8", "screen: 72/72 plans", f"simulate: {simulated}/{simulated} plans")
    for phase in phases + ("plot: 6/6 outputs",):
        assert any(line.startswith(phase) for line in err), (phase, err)
    assert not any("\r" in line for line in err)
    lines = (tmp_path / JOURNAL).read_text().splitlines()
    head, rows = json.loads(lines[0]), [json.loads(x) for x in lines[1:]]
    assert head["format"] == "planlab-simulations" and head["model"]["name"] == "gpt-tiny"
    assert len(rows) == simulated > 1
    out = io.StringIO()
    bar = Lines(10, "simulate", "plan", out, interval_s=0.0)
    for _ in range(3):
        bar.update(1)
    bar.close()
    assert out.getvalue().splitlines()[0].startswith("simulate: 1/10 plans, ")
    assert out.getvalue().splitlines()[-1].endswith(", done") and len(out.getvalue().splitlines()) == 4
    quiet = io.StringIO()
    progress(5, "screen", show=False, file=quiet).update(5)
    monkeypatch.setattr(progress_module, "LINE_INTERVAL_S", 60.0)
    short = Lines(5, "screen", "plan", quiet)
    short.update(5)
    short.close()
    assert quiet.getvalue() == ""  # a phase shorter than the interval prints nothing


@pytest.mark.slow
def test_ray_tasks_give_the_rows_of_jobs():
    """A local Ray instance simulates gpt-tiny's candidates on 4 CPU processes as Ray tasks: the
    same DataFrame as two forked workers, row for row."""
    pytest.importorskip("ray")
    args = dict(cluster="cpu", nodes=4, global_batch=8)
    with_jobs = planlab.explore("gpt-tiny", jobs=2, **args)
    with_ray = planlab.explore("gpt-tiny", jobs=2, ray=True, **args)
    pd.testing.assert_frame_equal(with_ray, with_jobs)
    assert with_ray.attrs["counts"] == with_jobs.attrs["counts"] and with_ray["simulated"].sum() > 10
    assert with_ray.attrs["best_plan"] == with_jobs.attrs["best_plan"]


def test_ray_address_that_does_not_answer_is_a_config_error(capsys, monkeypatch):
    pytest.importorskip("ray")
    monkeypatch.setenv("RAY_ADDRESS", "")
    code = main(["explore", "--model", "gpt-tiny", "--cluster", "cpu", "--nodes", "2", "--ray", "127.0.0.1:1"])
    err = capsys.readouterr().err
    assert code == 2 and "--ray 127.0.0.1:1: cannot start or reach Ray" in err and "Traceback" not in err
