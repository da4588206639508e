"""Who launched this process: torchrun, Slurm's ``srun``, or the user (then ``--nproc`` local
processes are started); and the checks a launch must pass before any model is built.

Under ``torchrun`` (``torch.distributed.run``) every process has ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``.
Under ``srun`` every task has ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``,
``SLURM_NODEID`` and ``SLURM_STEP_ID`` (set for job steps only, so a batch script that runs
``planlab run`` itself is not mistaken for rank 0); ``MASTER_ADDR`` is taken from the
environment or else is the first host of ``SLURM_JOB_NODELIST``, and ``MASTER_PORT`` from the
environment or else ``20000 + SLURM_JOB_ID % 20000`` (the same in every task of the job).
torchrun's variables win when both are set (``srun torchrun ...``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping

from planlab.errors import ConfigError


@dataclass(frozen=True)
class RankEnv:
    """This process's place in a launch made by ``source`` (``torchrun`` or ``slurm``)."""

    source: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int

    def __str__(self) -> str:
        return (
            f"rank {self.rank} of {self.world_size} ({self.source}, node {self.node_rank}, local rank "
            f"{self.local_rank} of {self.local_world_size}, rendezvous {self.master_addr}:{self.master_port})"
        )

    def local_ranks(self) -> range:
        """The ranks on this node, numbered node by node as torchrun and srun's block distribution do."""
        first = self.rank - self.local_rank
        return range(first, first + self.local_world_size)

    def export(self, environ: dict | None = None) -> None:
        """Set the variables ``init_process_group("env://")`` reads (and LOCAL_RANK)."""
        env = os.environ if environ is None else environ
        env.update(
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(self.local_rank),
            LOCAL_WORLD_SIZE=str(self.local_world_size),
            GROUP_RANK=str(self.node_rank),
            MASTER_ADDR=self.master_addr,
            MASTER_PORT=str(self.master_port),
        )


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    text = environ.get(name)
    if text is None:
        if default is None:
            raise ConfigError(f"{name} is not set; a launcher sets it for every process")
        return default
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not an integer") from None


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: ``node[07-09,12],gpu3`` -> ``node07``,
    ``rack[1-2]-n[5,6]`` -> ``rack1-n5``."""
    text = nodelist.strip()
    depth, end = 0, len(text)
    for i, ch in enumerate(text):  # the first item: up to a comma outside brackets
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            end = i
            break
    item = text[:end]
    host = re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[-,]", m.group(1))[0], item)
    if not host or "[" in host or "]" in host:
        raise ConfigError(f"SLURM_JOB_NODELIST={nodelist!r} is not a Slurm host list like node[01-04],gpu7")
    return host


def _tasks_on_node(spec: str, node: int) -> int | None:
    """Tasks on node ``node`` from ``SLURM_TASKS_PER_NODE`` (``2(x3),1``), or None."""
    counts: list[int] = []
    for part in filter(None, spec.split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            return None
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[node] if node < len(counts) else None


def detect(environ: Mapping[str, str] | None = None) -> RankEnv | None:
    """This process's launch, or None when no launcher started it."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        world = _int(env, "WORLD_SIZE")
        return RankEnv(
            "torchrun",
            _int(env, "RANK"),
            world,
            _int(env, "LOCAL_RANK", 0),
            _int(env, "LOCAL_WORLD_SIZE", world),
            _int(env, "GROUP_RANK", 0),
            env.get("MASTER_ADDR", "127.0.0.1"),
            _int(env, "MASTER_PORT", 29500),
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env):
        world, node = _int(env, "SLURM_NTASKS"), _int(env, "SLURM_NODEID", 0)
        local_world = _tasks_on_node(env.get("SLURM_TASKS_PER_NODE", ""), node) or _int(
            env, "SLURM_NTASKS_PER_NODE", max(1, world // max(1, _int(env, "SLURM_NNODES", 1)))
        )
        addr = env.get("MASTER_ADDR")
        if not addr:
            nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
            if not nodelist:
                raise ConfigError(
                    "under srun, set MASTER_ADDR or SLURM_JOB_NODELIST (the first host holds the rendezvous)"
                )
            addr = first_host(nodelist)
        port = _int(env, "MASTER_PORT") if env.get("MASTER_PORT") else 20000 + _int(env, "SLURM_JOB_ID", 0) % 20000
        return RankEnv(
            "slurm", _int(env, "SLURM_PROCID"), world, _int(env, "SLURM_LOCALID", 0), local_world, node, addr, port
        )
    return None


def device_kind(cluster_device: str) -> str:
    """``cpu`` for a cluster spec whose device is named ``cpu...``, else ``gpu``."""
    return "cpu" if cluster_device.lower().startswith("cpu") else "gpu"


def plan_device(plan) -> str:
    """The name of the device of ``plan``'s cluster (its spec file must be readable here)."""
    from planlab.costmodel import load_cluster

    return load_cluster(plan.cluster).node.device.name


def check_launch(
    plan, world_size: int, *, cuda_devices: int, allow_device_mismatch: bool = False, what: str = "processes"
) -> str:
    """Refuse (ConfigError) a launch of ``world_size`` processes that does not fit ``plan``; return
    the torch device type the ranks use (``cuda`` or ``cpu``).

    The plan must be for ``world_size`` devices. A plan for a GPU cluster runs on CUDA with
    NCCL; on a machine with fewer than ``cuda_devices`` GPUs per node it is refused unless
    ``allow_device_mismatch`` (then its ranks run on CPU processes with gloo: numerics only, the
    times do not compare). A plan for the ``cpu`` cluster runs on CPU processes, GPUs or not.
    """
    if world_size != plan.num_devices:
        raise ConfigError(
            f"the plan is for {plan.num_devices} devices; this launch has {world_size} {what}. "
            f"Launch {plan.num_devices} (e.g. torchrun --nproc-per-node ... with "
            f"nnodes x nproc-per-node = {plan.num_devices}, or --nproc {plan.num_devices})"
        )
    device = plan_device(plan)
    if device_kind(device) == "cpu":
        return "cpu"
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have >= cuda_devices:
        return "cuda"
    if allow_device_mismatch:
        return "cpu"
    raise ConfigError(
        f"the plan is for {device} GPUs ({plan.cluster}); this machine has {have} CUDA devices for "
        f"{cuda_devices} processes per node. Run it on GPUs, or pass --allow-device-mismatch to check "
        "its numerics on CPU processes (gloo; measured times then do not compare)"
    )
