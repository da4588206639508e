"""Bad input, everywhere: each case of the table below, given to the ``planlab`` command (run
in-process through ``planlab.cli.main``) or to the Python API, ends with one line that names the
bad value, exit status 2 (a PlanlabError from the API), no traceback and nothing half-written.
One case is a real process: Ctrl-C during ``planlab run`` ends it with one line and leaves no
process behind."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.nn as nn

import planlab
from planlab.cli import main
from planlab.errors import PlanlabError
from planlab.models import ModelSpec
from planlab.plan.layout import Mesh
from planlab.plan.plan import Action
from planlab.search_spaces.schedules import interleaved_1f1b

TINY = "--model gpt-tiny --cluster cpu --nodes 2 --global-batch 8"
GPT = "--model gpt --model-arg hidden=32 --model-arg heads=2 --model-arg seq=8 --model-arg vocab=32 --cluster cpu --nodes 2"
HF2 = "--model planlab.models.hf:gpt2 --cluster cpu --nodes 2"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A folder with a good plan, bad plan files, a plain file, a folder and a binary file."""
    d = tmp_path_factory.mktemp("bad")
    df = planlab.explore("gpt-tiny", cluster="cpu", nodes=2, space="dp", fixed={"dp": 2}, global_batch=8)
    good = json.loads(planlab.plan.plan_file.plan_to_json(df.attrs["best_plan"]))
    (d / "good.json").write_text(json.dumps(good))
    (d / "binary.json").write_bytes(bytes(range(256)) * 4)
    (d / "text.txt").write_text("not json")
    (d / "folder").mkdir()
    (d / "afile").write_text("x")
    variants = {
        "empty": {},
        "format": {**good, "format": "other"},
        "version": {**good, "version": 99},
        "nobatch": {k: v for k, v in good.items() if k != "global_batch"},
        "batch0": {**good, "global_batch": 0},
        "nodes": {**good, "nodes": -1},
        "ops": {**good, "ops": "all"},
        "device5": {**good, "meshes": [[0, 5]]},
        "schedule": {**good, "schedules": [["0F0", "0B0", "0U0"]], "device_schedule": [0]},
        "action": {**good, "schedules": [["0X0"]], "device_schedule": [0, 0]},
        "othersize": {**good, "model": {"name": "gpt-tiny", "args": {"layers": 3}}},
        "modelname": {**good, "model": {"name": 5}},
        "zero": {**good, "zero": 7},
        "list": [1, 2],
    }
    for name, v in variants.items():
        (d / f"{name}.json").write_text(json.dumps(v))
    return d


# (command, text the one-line error must contain); {d} is the fixtures' folder
CLI_CASES = [
    # explore: outputs, checked before any work
    (f"explore {TINY} --out {{d}}/afile/out", "afile"),
    (f"explore {TINY} --out {{d}}/afile", "afile"),
    # explore: model arguments
    (f"explore {TINY} --model-arg layers=abc", "layers"),
    (f"explore {TINY} --model-arg layers=0", "layers"),
    (f"explore {TINY} --model-arg layers=-1", "-1"),
    (f"explore {TINY} --model-arg layers=100000", "100,000"),
    (f"explore {TINY} --model-arg hidden=99999999996", "99,999,999,996"),
    (f"explore {TINY} --model-arg dropout=abc", "abc"),
    (f"explore {TINY} --model-arg dropout=-0.5", "-0.5"),
    (f"explore {TINY} --model-arg dropout=1.5", "1.5"),
    (f"explore {TINY} --model-arg vocab_parallel=2", "vocab_parallel"),
    (f"explore {TINY} --model-arg foo=1", "foo"),
    (f"explore {GPT} --model-arg layers=abc", "abc"),
    ("explore --model gpt --cluster cpu --nodes 2", "hidden"),
    ("explore --model nope --cluster cpu", "nope"),
    ("explore --model nomodule_xyz:build --cluster cpu", "nomodule_xyz"),
    ("explore --model planlab.models.hf:nofn --cluster cpu", "nofn"),
    (f"explore {HF2} --model-arg layers=abc", "abc"),
    (f"explore {HF2} --model-arg layers=0", "layers"),
    (f"explore {HF2} --model-arg dropout=2", "dropout"),
    (f"explore {HF2} --model-arg nope=1", "nope"),
    ("explore --model evoformer-tiny --cluster cpu --model-arg blocks=0", "blocks"),
    ("explore --model t5-tiny --cluster cpu --model-arg decoder_seq=1", "decoder_seq"),
    ("explore --model llama-tiny --cluster cpu --model-arg kv_heads=3", "kv_heads"),
    ("explore --model moe-tiny --cluster cpu --model-arg top_k=9", "top_k"),
    # explore: cluster, sizes, knobs
    ("explore --model gpt-tiny --cluster nope", "nope"),
    ("explore --model gpt-tiny --cluster {d}/missing.json", "missing.json"),
    ("explore --model gpt-tiny --cluster {d}/binary.json", "binary.json"),
    ("explore --model gpt-tiny --cluster cpu --nodes 0", "0"),
    ("explore --model gpt-tiny --cluster cpu --nodes -3", "-3"),
    ("explore --model gpt-tiny --cluster cpu --nodes 100000000", "131,072"),
    ("explore --model gpt-tiny --cluster cpu --nodes abc", "abc"),
    ("explore --model gpt-tiny --cluster cpu --global-batch 0", "0"),
    ("explore --model gpt-tiny --cluster cpu --global-batch -8", "-8"),
    ("explore --model gpt-tiny --cluster cpu --global-batch 999999999999", "999,999,999,999"),
    ("explore --model gpt-tiny --cluster cpu --global-batch 1.5", "1.5"),
    (f"explore {TINY} --jobs 0", "0"),
    (f"explore {TINY} --candidates -2", "-2"),
    (f"explore {TINY} --budget -1", "-1"),
    (f"explore {TINY} --top -1", "-1"),
    (f"explore {TINY} --top 0", "--top"),
    (f"explore {TINY} --space nope", "nope"),
    (f"explore {TINY} --space dp*nope", "nope"),
    (f"explore {TINY} --space nomodule_xyz:space", "nomodule_xyz"),
    (f"explore {TINY} --set nope=1", "nope"),
    (f"explore {TINY} --set dp=0", "dp=0"),
    (f"explore {TINY} --set dp=3", "dp=3"),
    (f"explore {TINY} --set dp=abc", "abc"),
    (f"explore {TINY} --set tp=-2", "-2"),
    (f"explore {TINY} --set recompute=7", "recompute=7"),
    # uneven pipeline stages: counts that do not add up, a stage with no layer (planlab/search_spaces/stages.py)
    (
        f"explore {TINY} --model-arg layers=3 --set pp=2 --set first_stage_layers=1 --set last_stage_layers=1",
        "add up to 2",
    ),
    (
        "explore --model gpt-tiny --model-arg layers=4 --cluster cpu --nodes 4 --set pp=4 --set first_stage_layers=2 --set last_stage_layers=2",
        "no layer",
    ),
    (f"explore {TINY} --set pp=2 --set first_stage_layers=7", "first_stage_layers"),
    (f"explore {TINY} --set cp=3", "cp=3 does not divide the 2 devices"),
    (f"explore {TINY} --model-arg seq=31 --set cp=2 --set cp_kind=ring", "cp=2 does not divide the sequence of 31"),
    (f"explore {TINY} --set cp=2 --set cp_kind=wide", "wide"),
    (f"explore {TINY} --set cp=2 --set cp_kind=ring --set cp_layout=spiral", "spiral"),
    (f"explore {TINY} --set cp=2 --set dp=2", "cp=2, dp=2"),
    (f"explore {TINY} --set dp", "dp"),
    (f"explore {TINY} --profile {{d}}/missing.json", "missing.json"),
    (f"explore {TINY} --profile {{d}}/binary.json", "binary.json"),
    (f"explore {TINY} --frobnicate", "--frobnicate"),
    ("", "cmd"),
    # run: plan files
    ("run {d}/missing.json --nproc 2", "missing.json"),
    ("run {d}/binary.json --nproc 2", "binary.json"),
    ("run {d}/folder --nproc 2", "folder"),
    ("run {d}/text.txt --nproc 2", "text.txt"),
    ("run {d}/empty.json --nproc 2", "format"),
    ("run {d}/list.json --nproc 2", "list"),
    ("run {d}/format.json --nproc 2", "'other'"),
    ("run {d}/version.json --nproc 2", "99"),
    ("run {d}/nobatch.json --nproc 2", "global_batch"),
    ("run {d}/batch0.json --nproc 2", "global_batch"),
    ("run {d}/nodes.json --nproc 2", "-1"),
    ("run {d}/ops.json --nproc 2", "'all'"),
    ("run {d}/device5.json --nproc 2", "device 5"),
    ("run {d}/schedule.json --nproc 2", "1 devices"),
    ("run {d}/action.json --nproc 2", "0X0"),
    ("run {d}/othersize.json --nproc 2", "another model or size"),
    ("run {d}/modelname.json --nproc 2", "5"),
    ("run {d}/zero.json --nproc 2", "7"),
    # run: options
    ("run {d}/good.json --nproc 0", "0"),
    ("run {d}/good.json --nproc 3", "3"),
    ("run {d}/good.json", "--nproc"),
    ("run {d}/good.json --nproc 2 --steps 0", "0"),
    ("run {d}/good.json --nproc 2 --steps 3 --warmup 5", "5"),
    ("run {d}/good.json --nproc 2 --timeout 0", "0"),
    ("run {d}/good.json --nproc 2 --clip-grad-norm -1", "-1"),
    ("run {d}/good.json --nproc 2 --save {d}/afile/ckpt", "afile"),
    ("run {d}/good.json --nproc 2 --trace {d}/folder", "folder"),
    ("run {d}/good.json --nproc 2 --predicted-trace {d}/afile/p.json", "afile"),
    ("run {d}/good.json --nproc 2 --data {d}/missing.pt", "missing.pt"),
    ("run {d}/good.json --nproc 2 --data nomodule_xyz:batches", "nomodule_xyz"),
    ("run {d}/good.json --nproc 2 --load {d}/missing_ckpt", "missing_ckpt"),
    ("run {d}/good.json --nproc 2 --steps x", "x"),
    # simulate
    ("simulate {d}/binary.json", "binary.json"),
    ("simulate {d}/othersize.json", "another model or size"),
    ("simulate {d}/good.json --straggler 9=2", "9=2"),
    ("simulate {d}/good.json --straggler 1=-2", "1=-2"),
    ("simulate {d}/good.json --straggler x=2", "x=2"),
    ("simulate {d}/good.json --trace {d}/afile/t.json", "afile"),
    ("simulate {d}/good.json --plot {d}/afile", "afile"),
    ("simulate {d}/good.json --profile {d}/text.txt", "text.txt"),
    # graph, calibrate, spaces
    ("graph --model gpt-tiny --global-batch 0", "0"),
    ("graph --model gpt-tiny --global-batch -1", "-1"),
    ("graph --model gpt-tiny --global-batch 999999999", "999,999,999"),
    ("graph --model gpt-tiny --model-arg seq=0", "seq"),
    ("calibrate --nproc 1", "1"),
    ("calibrate --out {d}/folder", "folder"),
    ("spaces nope", "nope"),
    ("spaces --model gpt-tiny", "--cluster"),
]


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse's usage errors
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("command, named", CLI_CASES, ids=[c for c, _ in CLI_CASES])
def test_bad_command_line_gets_one_line_naming_the_value(files, command, named):
    before = sorted(p.name for p in files.rglob("*"))
    rc, out, err = run_cli(command.format(d=files).split())
    lines = err.strip().splitlines()
    assert rc == 2, (rc, out[-500:], err[-2000:])
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("planlab") and "error:" in lines[0], lines
    assert named in lines[0], lines[0]
    assert sorted(p.name for p in files.rglob("*")) == before  # nothing written, not even a part


class _Vector(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x)  # not a scalar loss


API_CASES = [
    ("load_plan(None)", lambda d: planlab.load_plan(None), "None"),
    ("load_plan(123)", lambda d: planlab.load_plan(123), "123"),
    ("load_plan(binary)", lambda d: planlab.load_plan(d / "binary.json"), "binary.json"),
    ("load_plan(folder)", lambda d: planlab.load_plan(d / "folder"), "folder"),
    ("save_plan(str)", lambda d: planlab.save_plan("x", d / "x.json"), "'x'"),
    ("save_plan(None path)", lambda d: planlab.save_plan(planlab.load_plan(d / "good.json"), None), "None"),
    (
        "save_plan(under a file)",
        lambda d: planlab.save_plan(planlab.load_plan(d / "good.json"), d / "afile" / "p.json"),
        "afile",
    ),
    ("explore(batch str)", lambda d: planlab.explore("gpt-tiny", cluster="cpu", global_batch="8"), "'8'"),
    ("explore(jobs=0)", lambda d: planlab.explore("gpt-tiny", cluster="cpu", jobs=0), "0"),
    ("explore(out file)", lambda d: planlab.explore("gpt-tiny", cluster="cpu", out=d / "afile"), "afile"),
    ("explore(space=5)", lambda d: planlab.explore("gpt-tiny", cluster="cpu", space=5), "int"),
    ("explore(nodes=0)", lambda d: planlab.explore("gpt-tiny", cluster="cpu", nodes=0), "0"),
    ("ModelSpec(layers=abc)", lambda d: ModelSpec("gpt-tiny", (("layers", "abc"),)).config(), "abc"),
    ("trace(non-scalar)", lambda d: planlab.trace(_Vector(), (torch.randn(2, 4),)), "shape [2, 3]"),
    ("Action.parse('0X0')", lambda d: Action.parse("0X0"), "'0X0'"),
    ("Action.parse(5)", lambda d: Action.parse(5), "5"),
    ("Mesh(shape, devices)", lambda d: Mesh((2, 2), (0, 1, 2)), "(2, 2)"),
    ("interleaved_1f1b(3 of 2)", lambda d: interleaved_1f1b(0, 2, 3, 2), "(3)"),
]


@pytest.mark.parametrize("case, call, named", API_CASES, ids=[c for c, _, _ in API_CASES])
def test_bad_api_input_raises_a_planlab_error_naming_the_value(files, case, call, named):
    before = sorted(p.name for p in files.rglob("*"))
    with pytest.raises(PlanlabError) as e:
        call(files)
    assert named in str(e.value).splitlines()[0], str(e.value)
    assert sorted(p.name for p in files.rglob("*")) == before


def test_the_table_holds_every_listed_case():
    assert len(CLI_CASES) + len(API_CASES) >= 80


def _descendants(pid: int) -> list[int]:
    """Processes whose parent chain reaches ``pid`` (from /proc)."""
    parent = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    parent[int(p)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    out, todo = [], [pid]
    while todo:
        cur = todo.pop()
        kids = [c for c, pp in parent.items() if pp == cur]
        out += kids
        todo += kids
    return out


@pytest.mark.slow
def test_ctrl_c_ends_a_run_with_one_line_and_no_process_left(files):
    """SIGINT to the whole process group (what Ctrl-C in a terminal sends) during the steps."""
    cmd = [sys.executable, "-m", "planlab", "run", str(files / "good.json"), "--nproc", "2", "--steps", "100000"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        first = p.stdout.readline()  # rank 0's first step: the workers are running
        assert first.startswith("step 0"), first
        workers = _descendants(p.pid)
        assert workers
        os.killpg(p.pid, signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 130
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "SIGINT" in lines[0] and "Traceback" not in err, err
    time.sleep(1)
    left = [w for w in workers if os.path.exists(f"/proc/{w}") and "zombie" not in open(f"/proc/{w}/status").read()]
    assert not left, left
