"""Failures of a multi-rank run: an exception, a hard kill or a hang on rank 1 mid-step ends
every rank (by the failure itself, not a timeout: the message tells which; no upper bound on the time,
the machine is shared), ``launch_local`` raises one ExecutionError naming rank 1 (or the
rank that timed out, with the group or peer it waited on), and no process is left behind."""

import multiprocessing.util
import os
import shutil
import tempfile
import time
import uuid
from multiprocessing import resource_tracker
from pathlib import Path

import pytest

from planlab.errors import ConfigError, ExecutionError
from planlab.executor import launch_local
from planlab.executor.failures import (
    FAULT_ENV,
    Fault,
    InjectedFault,
    Progress,
    Watchdog,
    classify,
    describe,
    diagnose,
    fault_from_env,
    progress_path,
    write_report,
)
from planlab.search_spaces import Context, get_space

from conftest import traced

MARK = "PLANLAB_TEST_RUN"


@pytest.fixture(autouse=True)
def own_tmp(monkeypatch, tmp_path_factory):
    """A temporary folder of this test's own (TMPDIR, inherited by the ranks, and this process's
    tempfile default), so that the launcher folders counted are this test's alone, not those of
    other sessions running tests in the shared /tmp at the same time."""
    multiprocessing.util.get_temp_dir()  # multiprocessing's and pytest's folders stay in the shared one
    tmp_path_factory.getbasetemp()
    path = tempfile.mkdtemp(prefix="plfail-")  # short: the folders' sockets must fit 108 characters
    monkeypatch.setenv("TMPDIR", path)
    monkeypatch.setattr(tempfile, "tempdir", path)
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


def _plan(knobs, n=2):
    spec, g = traced("gpt-tiny", 8)
    return get_space("megatron").build(Context(g, spec, 8, "cpu", n, n, 1), knobs)


TP = dict(dp=1, tp=2, pp=1, microbatch=8)
PP = dict(dp=1, tp=1, pp=2, microbatch=2)


def _leftovers(token: str) -> list[int]:
    """Processes (other than this one) whose command line or environment holds ``token``."""
    try:
        import psutil  # noqa: F401
    except ImportError:
        psutil = None
    found = []
    if psutil is not None:
        for p in psutil.process_iter(["pid", "cmdline", "environ"]):
            env = p.info["environ"] or {}
            text = " ".join(p.info["cmdline"] or []) + " ".join(f"{k}={v}" for k, v in env.items())
            if token in text and p.pid != os.getpid():
                found.append(p.pid)
        return found
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            text = (d / "cmdline").read_bytes() + (d / "environ").read_bytes()
        except OSError:
            continue
        if token.encode() in text:
            found.append(int(d.name))
    return found


def _children() -> list[int]:
    """Live child processes of this one, other than multiprocessing's resource tracker."""
    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == tracker:
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ...
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            found.append(int(d.name))
    return found


def _fail(monkeypatch, plan, fault: str, **kw) -> tuple[ExecutionError, float]:
    # multiprocessing's resource tracker is one helper of this (launching) process for all its
    # launches, not a rank: start it before marking the environment of this launch's processes
    resource_tracker.ensure_running()
    token = f"planlab-test-{uuid.uuid4().hex}"
    monkeypatch.setenv(MARK, token)
    monkeypatch.setenv(FAULT_ENV, fault)
    before = _launcher_folders()
    t0 = time.monotonic()
    with pytest.raises(ExecutionError) as info:
        launch_local(plan, 2, steps=2, lr=1e-2, check=False, run_id=token, **kw)
    elapsed = time.monotonic() - t0  # no upper bound (a shared machine): the message tells a failure from a timeout
    assert _leftovers(token) == [] and _children() == []  # no rank, launcher helper or child left
    assert _launcher_folders() - before == set()  # nor a folder of the launcher's
    return info.value, elapsed


def _launcher_folders() -> set[str]:
    """The temporary folders of a launch: torch elastic's logs and planlab's run folder."""
    tmp = Path(tempfile.gettempdir())
    return {p.name for p in tmp.iterdir() if p.name.startswith(("torchelastic_", "planlab-"))}


def test_a_run_leaves_no_folder_behind():
    before = _launcher_folders()
    launch_local(_plan(TP), 2, steps=1, check=False)
    assert _launcher_folders() - before == set()


@pytest.mark.parametrize(
    "knobs, fault, expect",
    [
        # an exception in a backward task of the second step of the TP plan
        (
            TP,
            "rank=1,task=blocks_0_mlp_fc,kind=raise,step=1,action=0B0",
            "rank 1 failed at step 1, action 0B0, task B:blocks_0_mlp_fc: InjectedFault: fault injected by PLANLAB_FAULT",
        ),
        # SIGKILL in the forward of the third micro-batch of the 1F1B pipeline
        (
            PP,
            "rank=1,task=blocks_1_attn_q,kind=kill,action=1F2",
            "rank 1 was killed by signal SIGKILL at step 0, action 1F2, task F:blocks_1_attn_q",
        ),
    ],
)
def test_a_failing_rank_ends_the_run(monkeypatch, knobs, fault, expect):
    err, _ = _fail(monkeypatch, _plan(knobs), fault)
    assert str(err) == expect
    assert err.rank == 1 and len(str(err).splitlines()) == 1


def test_a_hang_is_reported_with_the_group_it_waited_on(monkeypatch):
    """Rank 1 stops in a forward task; rank 0 times out in the next all-reduce of the TP group."""
    # the timeout also bounds the ranks' meeting to create their groups, which a loaded machine
    # delays by seconds (3 s timed out there): long enough for that, short for a test
    timeout_s = 20
    err, elapsed = _fail(monkeypatch, _plan(TP), "rank=1,task=blocks_0_attn_q,kind=hang", timeout_s=timeout_s)
    msg = str(err)
    assert msg.startswith(
        "rank 0 timed out at step 0, action 0F0, task C:all_reduce(blocks_0_attn_proj:all_reduce0)"
        "@[0, 1] waiting on group [0, 1]: "
    ), msg
    assert "meanwhile rank 1 at step 0, action 0F0, task F:blocks_0_attn_q" in msg
    assert elapsed >= timeout_s


def test_a_plan_that_does_not_fit_the_launch_is_refused_before_any_process(monkeypatch):
    import torch.distributed.launcher.api as api

    def no_launch(*a, **k):
        raise AssertionError("a process was started")

    monkeypatch.setattr(api, "elastic_launch", no_launch)
    with pytest.raises(ConfigError, match="--nproc 4 differs from the plan's 2 devices"):
        launch_local(_plan(TP), 4)
    with pytest.raises(ConfigError, match="timeout_s must be a positive"):
        launch_local(_plan(TP), 2, timeout_s=0)
    monkeypatch.setenv(FAULT_ENV, "rank=1,task=x,kind=explode")
    with pytest.raises(ConfigError, match="kind 'explode' is not 'raise', 'kill' or 'hang'"):
        launch_local(_plan(TP), 2)


@pytest.mark.parametrize(
    "text, fault",
    [
        ("rank=1,task=wte,kind=raise", Fault(1, "wte", "raise")),
        (
            " rank=0 , task=blocks_0_attn_q , kind=kill , step=2, action=0B1 ",
            Fault(0, "blocks_0_attn_q", "kill", 2, "0B1"),
        ),
    ],
)
def test_fault_parse(text, fault):
    assert Fault.parse(text) == fault
    assert fault_from_env(fault.rank, {FAULT_ENV: text}) == fault
    assert fault_from_env(fault.rank + 1, {FAULT_ENV: text}) is None
    assert fault_from_env(0, {}) is None


@pytest.mark.parametrize(
    "text, message",
    [
        ("rank=1,task=wte", "lacks 'kind'"),
        ("rank=one,task=wte,kind=raise", "rank and step must be integers"),
        ("rank=1,task=wte,kind=raise,colour=red", "'colour=red' is not one of"),
    ],
)
def test_bad_faults(text, message):
    with pytest.raises(ConfigError, match=message):
        Fault.parse(text)


def test_injected_raise_and_classification():
    with pytest.raises(InjectedFault, match="fault injected by PLANLAB_FAULT"):
        Fault(0, "x", "raise").trigger()
    assert classify(InjectedFault("x timed out")) == "error"
    assert classify(RuntimeError("Timed out waiting 5000ms for recv operation to complete")) == "timeout"
    assert classify(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:41383")) == "peer"
    assert classify(ValueError("shapes differ")) == "error"


def test_progress_survives_in_its_file_and_names_the_task(tmp_path):
    p = Progress(progress_path(tmp_path, 3))
    p.phase("step 1, action 0B2")
    p.task(Progress.encode("C:all_reduce(x)@[0, 1]"))
    assert p.armed and p.where() == "step 1, action 0B2, task C:all_reduce(x)@[0, 1]"
    assert describe(progress_path(tmp_path, 3).read_bytes()) == p.where()
    p.phase("setup", armed=False)
    assert not p.armed and p.where() == "setup"


def test_watchdog_fires_once_on_an_armed_record_that_does_not_move():
    p, calls = Progress(), []
    p.phase("step 0, action 0F0", task="F:wte")
    w = Watchdog(p, 0.3, lambda s, where: calls.append((s, where)))
    w.start()
    w.join(5)
    assert not w.is_alive() and len(calls) == 1
    assert calls[0][0] >= 0.3 and calls[0][1] == "step 0, action 0F0, task F:wte"
    p2, calls2 = Progress(), []
    p2.phase("setup", armed=False)
    w2 = Watchdog(p2, 0.2, lambda s, where: calls2.append(where))
    w2.start()
    time.sleep(0.6)
    w2.stop()
    w2.join(5)
    assert calls2 == []  # a disarmed phase (setup, reference run) is not watched


def test_diagnose_prefers_the_root_cause(tmp_path):
    for r in range(3):
        Progress(progress_path(tmp_path, r)).phase(f"step 0, action 0F{r}", task="F:x")
    write_report(
        tmp_path,
        0,
        cause="peer",
        where="step 0, action 0F0, task C:all_reduce(y)@[0, 1]",
        error="RuntimeError: Connection closed by peer",
        waited_on="group [0, 1]",
    )
    assert str(diagnose(tmp_path, {1: -9}, 3)) == "rank 1 was killed by signal SIGKILL at step 0, action 0F1, task F:x"
    assert str(diagnose(tmp_path, {}, 3)) == (
        "rank 0 failed at step 0, action 0F0, task C:all_reduce(y)@[0, 1]: "
        "RuntimeError: Connection closed by peer (waiting on group [0, 1])"
    )
    write_report(
        tmp_path,
        2,
        cause="timeout",
        where="step 0, action 0F2, task R:y<-1",
        error="RuntimeError: Timed out",
        waited_on="peer 1",
    )
    err = diagnose(tmp_path, {0: 1}, 3)
    assert err.rank == 2 and str(err) == (
        "rank 2 timed out at step 0, action 0F2, task R:y<-1 waiting on peer 1: "
        "RuntimeError: Timed out (meanwhile rank 1 at step 0, action 0F1, task F:x)"
    )


def test_cli_prints_the_failure_on_one_line(monkeypatch, tmp_path, capsys):
    from planlab.cli import main
    from planlab.plan import save_plan

    plan_file = tmp_path / "dp.json"
    save_plan(_plan(dict(dp=2, tp=1, pp=1, microbatch=2)), plan_file)
    assert main(["run", str(plan_file), "--nproc", "2", "--timeout", "-1"]) == 2
    assert "--timeout must be a positive number of seconds, got -1" in capsys.readouterr().err
    resource_tracker.ensure_running()
    monkeypatch.setenv(FAULT_ENV, "rank=1,task=blocks_1_ln2,kind=raise,action=0B1")
    assert main(["run", str(plan_file), "--nproc", "2", "--steps", "1", "--timeout", "30"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "planlab: error: rank 1 failed at step 0, action 0B1, task B:blocks_1_ln2: "
        "InjectedFault: fault injected by PLANLAB_FAULT"
    )
