"""``planlab run`` started by the real torchrun command (``python -m torch.distributed.run
--standalone --nproc-per-node N -m planlab.cli run PLAN``) and by Slurm's environment: every
process runs as one rank, rank 0 prints the report once, the numeric check passes (clipping
and user data included), and the measured trace holds the simulated tasks in the same order
per device. A rank that raises ends the run with its error printed once and no process left."""

import json
import os
import random
import re
import socket
import subprocess
import sys
import uuid
from collections import defaultdict

import pytest
import torch

from planlab.plan import materialize, save_plan, trace_plan_model
from planlab.search_spaces import Context, get_space

from conftest import traced
from test_executor_failures import _leftovers

LAUNCH_TIMEOUT_S = 600


def _plan(n, knobs):
    spec, g = traced("gpt-tiny", 8)
    return get_space("megatron").build(Context(g, spec, 8, "cpu", n, n, 1), knobs)


def _trace_task_lists(path, by_stream=False):
    """Per (device, action) (and stream: the trace's thread) the task names of a Chrome trace
    file, in start order."""
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    out = defaultdict(list)
    for e in sorted(events, key=lambda e: (e["pid"], e["ts"])):
        out[(e["pid"], e["cat"]) + ((e["tid"],) if by_stream else ())].append(e["name"])
    return dict(out)


def _program_task_lists(plan):
    out = defaultdict(list)
    for dp in materialize(plan, trace_plan_model(plan)).devices:
        for a, t in dp.tasks_in_order():
            out[(dp.device, str(a))].append(t.name)
    return dict(out)


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PLANLAB_FAULT"))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return dict(env, **extra)


def _torchrun(n, *args, env=None):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(n),
        "-m",
        "planlab.cli",
        "run",
        *map(str, args),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, env=env or _env())


def _check_report(out: str, n: int, steps: int, launcher: str):
    assert out.count("numeric check against one process") == 1 and "PASSED" in out, out
    assert f"on {n} gloo processes started by {launcher}" in out
    for s in range(steps):
        assert out.count(f"\nstep {s}: loss ") + out.startswith(f"step {s}: loss ") == 1, out
    assert all(f"\n  rank {r}: " in out for r in range(n)) and "peak memory per rank (RSS" in out
    assert "predicted against measured" in out and "largest misses" in out


@pytest.mark.parametrize(
    "n, knobs, extra",
    [
        # 1F1B pipeline on 2 ranks, on the user's batches, clipped: the norm across stages
        (2, dict(dp=1, tp=1, pp=2, microbatch=2), ("--clip-grad-norm", "0.5", "--data", "DATA")),
        # data x tensor parallel on 4 ranks, clipped: replicas and split pieces counted once
        (4, dict(dp=2, tp=2, pp=1, microbatch=2), ("--clip-grad-norm", "0.5")),
        # tensor x pipeline parallel on 4 ranks
        (4, dict(dp=1, tp=2, pp=2, microbatch=4), ()),
    ],
)
def test_torchrun_runs_each_process_as_a_rank(tmp_path, n, knobs, extra):
    plan = _plan(n, knobs)
    save_plan(plan, tmp_path / "plan.json")
    if "DATA" in extra:
        gen = torch.Generator().manual_seed(7)
        batches = []
        for _ in range(2):  # two batches for three steps: the first comes again
            toks = torch.randint(0, 128, (8, 33), generator=gen)
            batches.append((toks[:, :-1].contiguous(), toks[:, 1:].contiguous()))
        torch.save(batches, tmp_path / "data.pt")
        extra = tuple(str(tmp_path / "data.pt") if a == "DATA" else a for a in extra)
    measured, predicted = tmp_path / "measured.json", tmp_path / "predicted.json"
    r = _torchrun(
        n,
        tmp_path / "plan.json",
        "--steps",
        3,
        "--warmup",
        1,
        "--trace",
        measured,
        "--predicted-trace",
        predicted,
        *extra,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    _check_report(r.stdout, n, 3, "torchrun")
    if "--clip-grad-norm" in extra:  # every step's global norm, against one process's clip_grad_norm_
        norms = re.findall(r"gradient norm ([\d.e+-]+) \(one process ([\d.e+-]+)\)", r.stdout)
        assert len(norms) == 3 and all(float(a) == pytest.approx(float(b), rel=1e-5) for a, b in norms)
        assert all(float(b) > 0.5 for _, b in norms)  # above the limit: every step was clipped
    m, p = _trace_task_lists(measured), _trace_task_lists(predicted)
    assert m == _program_task_lists(plan)  # the Program's tasks, in the order it lists them
    assert {d for d, _ in m} == set(range(n))
    # the simulated trace: the same tasks per device and action, in the same order on each stream
    # (an overlapped gradient reduction may start on the simulated comm stream before the
    # compute tasks the Program lists ahead of it)
    assert {k: sorted(v) for k, v in m.items()} == {k: sorted(v) for k, v in p.items()}
    assert _trace_task_lists(measured, by_stream=True) == _trace_task_lists(predicted, by_stream=True)


def _free_port_between(lo: int, hi: int) -> int:
    for port in random.Random(os.getpid()).sample(range(lo, hi), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{lo}, {hi})")


def test_slurm_tasks_run_as_ranks(tmp_path):
    """Two tasks as srun starts them: SLURM_* variables only; the rendezvous address is the first
    host of the node list and the port comes from the job id."""
    save_plan(_plan(2, dict(dp=2, tp=1, pp=1, microbatch=2)), tmp_path / "dp.json")
    port = _free_port_between(20000, 40000)
    job = 7 * 20000 + port - 20000  # the port planlab derives: 20000 + job % 20000
    common = dict(
        SLURM_NTASKS="2",
        SLURM_NODEID="0",
        SLURM_STEP_ID="0",
        SLURM_JOB_ID=str(job),
        SLURM_TASKS_PER_NODE="2",
        SLURM_JOB_NODELIST="localhost,node[2-3]",
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "planlab.cli", "run", str(tmp_path / "dp.json"), "--steps", "2"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(**common, SLURM_PROCID=str(r), SLURM_LOCALID=str(r)),
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=LAUNCH_TIMEOUT_S) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    _check_report(outs[0][0], 2, 2, "slurm")
    assert outs[1][0] == ""  # rank 1 prints nothing


def test_a_failing_rank_under_torchrun_is_reported_once(tmp_path):
    save_plan(_plan(2, dict(dp=1, tp=2, pp=1, microbatch=8)), tmp_path / "tp.json")
    token = f"planlab-test-{uuid.uuid4().hex}"
    env = _env(PLANLAB_TEST_RUN=token, PLANLAB_FAULT="rank=1,task=blocks_0_mlp_fc,kind=raise,step=1,action=0B0")
    r = _torchrun(2, tmp_path / "tp.json", "--steps", 2, "--no-check", "--timeout", 30, env=env)
    assert r.returncode != 0
    cause = (
        "planlab: error: rank 1 failed at step 1, action 0B0, task B:blocks_0_mlp_fc: InjectedFault: fault "
        "injected by PLANLAB_FAULT"
    )
    assert r.stderr.count("InjectedFault") == 1 and cause in r.stderr.splitlines(), r.stderr
    assert _leftovers(token) == []
