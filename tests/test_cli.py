import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from planlab.cli import main

BIN = Path(sys.executable).with_name("planlab")


def _err(capsys, argv):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.err.strip()


EXPLORE = ["explore", "--model", "gpt-tiny", "--cluster", "cpu", "--nodes", "2", "--global-batch", "8"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["explore", "--model", "gpt-huge", "--cluster", "cpu"], "unknown model 'gpt-huge'; choose 'gpt-tiny'"),
        (["explore", "--model", "gpt-tiny", "--cluster", "tpu-pod"], "unknown cluster 'tpu-pod'"),
        (EXPLORE + ["--space", "zero9"], "unknown space 'zero9'"),
        (EXPLORE + ["--set", "zz=1"], "space 'megatron' has no knob 'zz'"),
        (EXPLORE + ["--set", "tp=3"], "tp=3 is not valid here: tp=3 does not divide the 2 devices"),
        (EXPLORE + ["--set", "zero=4"], "space 'megatron': zero=4 is not valid here: knob 'zero' takes 0, 1, 2 or 3"),
        (EXPLORE + ["--set", "sequence_parallel=maybe"], "knob 'sequence_parallel' takes true or false, got 'maybe'"),
        (EXPLORE + ["--set", "tp=2", "--set", "pp=2"], "space 'megatron' has no plan with tp=2, pp=2 fixed"),
        (EXPLORE + ["--space", "dp||tp"], "an empty name around '|'"),
        (EXPLORE + ["--budget", "-3"], "--budget must be a number of seconds >= 0, got -3.0"),
        (
            ["explore", "--model", "gpt-tiny", "--cluster", "cpu", "--nodes", "4", "--set", "pp=4"],
            "pp=4 is not valid here: knob 'pp' takes 1 or 2",
        ),
        (
            EXPLORE + ["--set", "dp=2", "--set", "microbatch=8"],
            "dp=2 x microbatch=8 does not divide the global batch 8",
        ),
        (["explore", "--model", "gpt", "--model-arg", "layers=2", "--cluster", "cpu"], "needs --model-arg for hidden"),
        (
            ["explore", "--model", "gpt-tiny", "--model-arg", "colour=3", "--cluster", "cpu"],
            "unknown model argument 'colour'",
        ),
        (["explore", "--model", "gpt-tiny", "--cluster", "cpu", "--nodes", "0"], "nodes"),
    ],
)
def test_bad_input_gets_one_clear_line(capsys, argv, message):
    code, err = _err(capsys, argv)
    assert code == 2
    # progress lines may come first on a slow machine (a line every few seconds off a terminal)
    lines = err.strip().splitlines()
    assert lines[-1].startswith("planlab: error: ") and message in lines[-1]
    assert all(not line.startswith("planlab: error") for line in lines[:-1])
    assert "Traceback" not in err


@pytest.fixture(scope="module")
def explored(tmp_path_factory):
    out = tmp_path_factory.mktemp("explore")
    assert main(EXPLORE + ["--space", "megatron", "--out", str(out)]) == 0
    return out


def test_explore_writes_the_results_plots_and_best_plan(explored):
    import pandas as pd

    df = pd.read_csv(explored / "results.csv")
    for col in [
        "space",
        "dp",
        "tp",
        "pp",
        "microbatch",
        "zero",
        "sequence_parallel",
        "recompute",
        "screen_time_s",
        "screen_mem_gib",
        "iter_time_s",
        "peak_mem_gib",
        "tflops_per_gpu",
        "mfu",
        "feasible",
        "simulated",
        "reason",
    ]:
        assert col in df.columns
    assert df[df["simulated"]]["feasible"].all() and df["pareto"].any()
    assert df[~df["simulated"]]["reason"].str.startswith("not simulated").all()
    for name in ("pareto.png", "timeline.png", "memory.png"):
        assert (explored / name).stat().st_size > 1000
    plan = json.loads((explored / "best_plan.json").read_text())
    assert plan["format"] == "planlab-plan" and plan["num_devices"] == 2


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(version=4), "plan format version 4; this planlab reads versions 1, 2, 3"),
        (lambda d: d.pop("model"), "field 'model' is missing"),
        (lambda d: d["ops"].pop(), "does not place operator"),
    ],
)
def test_bad_plan_files(capsys, explored, tmp_path, edit, message):
    d = json.loads((explored / "best_plan.json").read_text())
    edit(d)
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(d))
    for cmd in (["simulate", str(p)], ["run", str(p), "--nproc", "2"]):
        code, err = _err(capsys, cmd)
        assert code == 2 and message in err and "Traceback" not in err


def test_nproc_must_match_the_plan(capsys, explored):
    code, err = _err(capsys, ["run", str(explored / "best_plan.json"), "--nproc", "3"])
    assert code == 2 and "--nproc 3 differs from the plan's device count 2" in err


def test_simulate_json_trace_and_plots(capsys, explored, tmp_path):
    assert (
        main(
            [
                "simulate",
                str(explored / "best_plan.json"),
                "--json",
                "--trace",
                str(tmp_path / "t.json"),
                "--plot",
                str(tmp_path / "plots"),
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["feasible"] and out["iter_time_s"] > 0
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    for name in ("timeline.png", "memory.png"):
        assert (tmp_path / "plots" / name).stat().st_size > 1000


def test_explore_budget_union_and_candidates_from_the_command_line(capsys):
    assert main(EXPLORE + ["--space", "dp|tp", "--budget", "0"]) == 0
    out = capsys.readouterr().out
    assert "14 plans: 14 screened, 0 pruned by the memory bound, 0 of 14 candidates simulated" in out
    assert "No plan was simulated" in out
    assert main(EXPLORE + ["--candidates", "1", "--set", "recompute=none", "--set", "sequence_parallel=false"]) == 0
    out = capsys.readouterr().out
    assert "screened" in out and "candidates simulated" in out and "Every plan has" in out


def test_spaces_lists_knobs_with_types_and_ranges(capsys):
    assert main(["spaces"]) == 0
    out = capsys.readouterr().out
    assert "megatron: The Megatron-LM and DeepSpeed grid" in out
    assert "sequence_parallel  bool" in out and "divisors of the device count" in out
    assert main(["spaces", "megatron", "--model", "gpt-tiny", "--cluster", "cpu", "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "    tp                 int    1, 2  default 1" in out and "pp                 int    1, 2" in out
    code, err = _err(capsys, ["spaces", "megatron", "--model", "gpt-tiny"])
    assert code == 2 and "needs --cluster" in err


def test_listings(capsys):
    for cmd, word in (["models"], "gpt3-175b"), (["clusters"], "dgx-a100-80g"), (["spaces"], "megatron"):
        assert main(cmd) == 0
        assert word in capsys.readouterr().out
    assert main(["graph", "--model", "gpt-tiny"]) == 0
    assert "operators" in capsys.readouterr().out


def test_console_script_explore_then_run(tmp_path):
    """The README's loop through the installed command: explore, then run the best plan."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    r = subprocess.run([str(BIN)] + EXPLORE + ["--out", str(tmp_path)], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(
        [str(BIN), "run", str(tmp_path / "best_plan.json"), "--nproc", "2", "--steps", "2"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    assert "PASSED" in r.stdout and "measured iteration" in r.stdout
    r = subprocess.run([str(BIN), "explore", "--model", "nope", "--cluster", "cpu"], capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "unknown model 'nope'" in r.stderr


@pytest.mark.slow
def test_gpt3_175b_exploration_completes(tmp_path):
    """GPT-3 175B on 16 DGX A100 nodes: every plan of the Megatron grid, on this machine."""
    import pandas as pd

    assert (
        main(
            [
                "explore",
                "--model",
                "gpt3-175b",
                "--cluster",
                "dgx-a100-80g",
                "--nodes",
                "16",
                "--space",
                "megatron",
                "--global-batch",
                "1536",
                "--jobs",
                "2",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    df = pd.read_csv(tmp_path / "results.csv")
    assert len(df) > 100 and df["feasible"].any()
    assert df["reason"].fillna("").str.contains("GiB per device").any()  # pruned before simulation
    assert (tmp_path / "pareto.png").exists() and (tmp_path / "best_plan.json").exists()
    assert df["simulated"].sum() < len(df) and df["screen_time_s"].notna().all()


def test_run_refuses_a_model_this_machine_cannot_build(capsys, tmp_path):
    """Data parallelism holds the whole model on each rank: GPT-3 1.3B's pieces on 2 ranks (16 bytes
    a parameter while training) and the check's reference need about 64 GiB."""
    from planlab.explore import Setup, make_context
    from planlab.models import ModelSpec
    from planlab.plan import save_plan
    from planlab.search_spaces import get_space

    ctx, _, _ = make_context(Setup(ModelSpec("gpt3-1.3b"), "cpu", 2, 2))
    save_plan(get_space("dp").build(ctx, dict(dp=2, microbatch=1)), tmp_path / "p.json")
    code, err = _err(capsys, ["run", str(tmp_path / "p.json"), "--nproc", "2"])
    assert code == 2 and "needs about 63.59 GiB of host memory: 42.40 GiB for the pieces of 2 ranks" in err
    assert "for the numeric check's single-process reference" in err and "GiB is available" in err
