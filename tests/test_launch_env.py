"""Which rank a process is under torchrun or srun, the checks made before any model is built
(world size, device kind), and the user's data; none of these tests starts a process."""

import dataclasses

import pytest
import torch

from planlab.cli import main
from planlab.errors import ConfigError
from planlab.executor.data import load_batches
from planlab.executor.launch_env import RankEnv, check_launch, detect, first_host
from planlab.plan import save_plan
from planlab.search_spaces import Context, get_space

from conftest import traced

TORCHRUN = dict(
    RANK="3",
    WORLD_SIZE="4",
    LOCAL_RANK="1",
    LOCAL_WORLD_SIZE="2",
    GROUP_RANK="1",
    MASTER_ADDR="10.0.0.1",
    MASTER_PORT="29400",
    TORCHELASTIC_RUN_ID="x",
)
SLURM = dict(
    SLURM_PROCID="5",
    SLURM_NTASKS="8",
    SLURM_LOCALID="1",
    SLURM_NODEID="2",
    SLURM_STEP_ID="0",
    SLURM_JOB_ID="123456",
    SLURM_TASKS_PER_NODE="2(x4)",
    SLURM_JOB_NODELIST="gpu[07-10],login1",
)


@pytest.mark.parametrize(
    "environ, expect",
    [
        (TORCHRUN, RankEnv("torchrun", 3, 4, 1, 2, 1, "10.0.0.1", 29400)),
        (SLURM, RankEnv("slurm", 5, 8, 1, 2, 2, "gpu07", 20000 + 123456 % 20000)),
        (dict(SLURM, MASTER_ADDR="head", MASTER_PORT="1234"), RankEnv("slurm", 5, 8, 1, 2, 2, "head", 1234)),
        (
            dict(SLURM, SLURM_TASKS_PER_NODE="3,3,1(x2)", SLURM_NODEID="3"),
            RankEnv("slurm", 5, 8, 1, 1, 3, "gpu07", 23456),
        ),
        ({**SLURM, **TORCHRUN}, RankEnv("torchrun", 3, 4, 1, 2, 1, "10.0.0.1", 29400)),  # srun torchrun ...
        ({k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}, None),  # a batch script, not a task of srun
        ({}, None),
    ],
)
def test_detect(environ, expect):
    assert detect(environ) == expect


def test_rank_env_exports_what_init_process_group_reads():
    env = detect(SLURM)
    out: dict = {}
    env.export(out)
    assert out == dict(
        RANK="5",
        WORLD_SIZE="8",
        LOCAL_RANK="1",
        LOCAL_WORLD_SIZE="2",
        GROUP_RANK="2",
        MASTER_ADDR="gpu07",
        MASTER_PORT=str(23456),
    )
    assert list(env.local_ranks()) == [4, 5]
    assert str(env).startswith("rank 5 of 8 (slurm, node 2, local rank 1 of 2")


@pytest.mark.parametrize(
    "nodelist, host",
    [
        ("node[07-09,12],gpu3", "node07"),
        ("gpu3,node1", "gpu3"),
        ("rack[1-2]-n[5,6]", "rack1-n5"),
        ("localhost", "localhost"),
        ("a[003]", "a003"),
    ],
)
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


@pytest.mark.parametrize(
    "environ, message",
    [
        ({k: v for k, v in SLURM.items() if k != "SLURM_JOB_NODELIST"}, "set MASTER_ADDR or SLURM_JOB_NODELIST"),
        (dict(SLURM, SLURM_JOB_NODELIST="[oops"), "is not a Slurm host list"),
        (dict(TORCHRUN, RANK="three"), "RANK='three' is not an integer"),
    ],
)
def test_bad_launch_environments(environ, message):
    with pytest.raises(ConfigError, match=message):
        detect(environ)


def _plan(n=2, knobs=None, cluster="cpu"):
    spec, g = traced("gpt-tiny", 8)
    plan = get_space("megatron").build(
        Context(g, spec, 8, "cpu", n, n, 1), knobs or dict(dp=n, tp=1, pp=1, microbatch=8 // n)
    )
    return dataclasses.replace(plan, cluster=cluster)


def test_check_launch():
    assert check_launch(_plan(), 2, cuda_devices=2) == "cpu"
    with pytest.raises(ConfigError, match="the plan is for 2 devices; this launch has 4 processes"):
        check_launch(_plan(), 4, cuda_devices=4)
    gpu = _plan(cluster="dgx-a100-80g")
    if not torch.cuda.is_available():
        with pytest.raises(
            ConfigError,
            match=r"the plan is for a100-80g GPUs \(dgx-a100-80g\); this machine has 0 "
            r"CUDA devices .* --allow-device-mismatch",
        ):
            check_launch(gpu, 2, cuda_devices=2)
        assert check_launch(gpu, 2, cuda_devices=2, allow_device_mismatch=True) == "cpu"


def test_cli_refuses_a_launch_that_does_not_fit_before_building(monkeypatch, tmp_path, capsys):
    plan_file = tmp_path / "dp.json"
    save_plan(_plan(), plan_file)
    for k in list(TORCHRUN) + list(SLURM):
        monkeypatch.delenv(k, raising=False)
    assert main(["run", str(plan_file)]) == 2
    assert (
        "give --nproc N to run the plan on N local processes, or start `planlab run` under torchrun or srun"
        in capsys.readouterr().err
    )
    for k, v in dict(TORCHRUN, LOCAL_RANK="0", RANK="0").items():
        monkeypatch.setenv(k, v)
    assert main(["run", str(plan_file)]) == 2  # WORLD_SIZE 4, a plan for 2: refused before joining any group
    assert capsys.readouterr().err == (
        "planlab: error: the plan is for 2 devices; this launch has 4 processes "
        "(torchrun). Launch 2 (e.g. torchrun --nproc-per-node ... with nnodes x "
        "nproc-per-node = 2, or --nproc 2)\n"
    )
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert main(["run", str(plan_file)]) == 2
    assert capsys.readouterr().err == ""  # said once per node
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert main(["run", str(plan_file), "--warmup", "3", "--steps", "3"]) == 2
    assert "--warmup must be at least 0 and less than --steps 3, got 3" in capsys.readouterr().err
    save_plan(_plan(cluster="dgx-a100-80g"), plan_file)
    if not torch.cuda.is_available():
        assert main(["run", str(plan_file)]) == 2
        assert "--allow-device-mismatch" in capsys.readouterr().err


def test_user_data(tmp_path):
    example = (torch.zeros(4, 8, dtype=torch.long), torch.zeros(4, 8, dtype=torch.long))
    batches = [(torch.randint(0, 9, (4, 8)), torch.randint(0, 9, (4, 8))) for _ in range(3)]
    torch.save(batches, tmp_path / "data.pt")
    got = load_batches(str(tmp_path / "data.pt"), example=example, global_batch=4, steps=5)
    assert len(got) == 3 and all(torch.equal(a[0], b[0]) for a, b in zip(got, batches))
    fn = load_batches("test_launch_env:_batches", example=example, global_batch=4, steps=2)
    assert len(fn) == 2 and fn[1][0].shape == (4, 8)
    torch.save([(torch.zeros(2, 8, dtype=torch.long),) * 2], tmp_path / "small.pt")
    with pytest.raises(
        ConfigError,
        match=r"batch 0 is \(\(2, 8\) int64, \(2, 8\) int64\); the model takes "
        r"\(\(4, 8\) int64, \(4, 8\) int64\) at global batch 4",
    ):
        load_batches(str(tmp_path / "small.pt"), example=example, global_batch=4, steps=1)
    torch.save([], tmp_path / "empty.pt")
    with pytest.raises(ConfigError, match="holds no batch"):
        load_batches(str(tmp_path / "empty.pt"), example=example, global_batch=4, steps=1)
    with pytest.raises(ConfigError, match="cannot load it"):
        load_batches("test_launch_env:nothing", example=example, global_batch=4, steps=1)


def _batches(global_batch, steps):
    for s in range(steps + 10):  # more than asked: the first ``steps`` are taken
        yield torch.full((global_batch, 8), s), torch.full((global_batch, 8), s + 1)
