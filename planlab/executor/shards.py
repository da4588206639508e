"""Each rank's own pieces of the model, and the memory they take.

A rank builds the module with its parameters on the meta device (buffers and example
inputs are real) and draws only the regions of parameters its DeviceProgram holds
(``program.devices[rank].params``: parameter, box) with :func:`planlab.models.init.init_region`;
the full model never exists on a rank. Starting from a checkpoint, it reads the overlapping
regions of the saved pieces instead (:mod:`planlab.executor.checkpoint`).

Memory: a rank's pieces take 16 bytes per element while training (fp32 weight and
gradient, Adam's two moments); the single-process reference of the numeric check (rank 0)
holds the whole model with its gradients and Adam states (16 bytes per parameter) plus its
own activations. :func:`check_host_memory` refuses a launch whose local ranks need more than
the machine has available.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn

from planlab.errors import ConfigError
from planlab.models.init import init_region, init_rules
from planlab.plan.program import Program

TRAIN_BYTES_PER_ELEMENT = 16  # fp32 weight + gradient + Adam's exp_avg and exp_avg_sq
REFERENCE_BYTES_PER_PARAM = 16


def held_elements(program: Program, rank: int) -> int:
    """Parameter elements ``rank`` holds (each piece counted whole)."""
    n = 0
    for _, box in program.devices[rank].params:
        size = 1
        for lo, hi in box:
            size *= hi - lo
        n += size
    return n


def rank_bytes(program: Program, rank: int) -> int:
    """What ``rank``'s pieces take while training (weights, gradients, Adam states)."""
    return TRAIN_BYTES_PER_ELEMENT * held_elements(program, rank)


def build_shards(
    program: Program, rank: int, skeleton: nn.Module, *, seed: int, empty: bool = False
) -> dict[str, torch.Tensor]:
    """The pieces ``rank`` holds, drawn from ``seed`` (``empty``: uninitialised, for a
    checkpoint to fill) by parameter name; ``skeleton`` gives shapes and dtypes (its
    parameters may be meta)."""
    params = dict(skeleton.named_parameters())
    rules = init_rules(skeleton) if not empty else {}
    out: dict[str, torch.Tensor] = {}
    for p, box in program.devices[rank].params:
        w = params[p]
        box = tuple(tuple(b) for b in box)
        if empty:
            out[p] = torch.empty(tuple(hi - lo for lo, hi in box), dtype=w.dtype)
        else:
            out[p] = init_region(rules[p], p, tuple(w.shape), box, seed=seed, dtype=w.dtype)
    return out


def available_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo``, or None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_memory(
    plan,
    program: Program,
    ranks: Iterable[int],
    *,
    device: str = "cpu",
    num_params: int,
    reference: bool,
    available: int | None = None,
) -> int:
    """Refuse (ConfigError) running ``ranks`` on this machine when they do not fit; returns the
    host bytes needed. On ``cpu`` the ranks' pieces and, with ``reference``, the numeric check's
    single-process reference of ``num_params`` parameters share the host's ``available`` bytes
    (default: MemAvailable); on ``cuda`` each rank's pieces must fit its GPU, the reference the host."""
    ranks = list(ranks)
    if device == "cuda":
        for r, local in zip(ranks, range(len(ranks))):
            total = torch.cuda.get_device_properties(local).total_memory
            if rank_bytes(program, r) > total:
                raise ConfigError(
                    f"rank {r}'s pieces of {plan.model} need {rank_bytes(program, r) / 2**30:.2f} GiB "
                    f"(weights, gradients, Adam states); GPU {local} has {total / 2**30:.2f} GiB"
                )
    shards = sum(rank_bytes(program, r) for r in ranks) if device == "cpu" else 0
    ref_bytes = REFERENCE_BYTES_PER_PARAM * num_params if reference else 0
    need = shards + ref_bytes
    have = available_bytes() if available is None else available
    if have is not None and need > have:
        parts = (
            [f"{shards / 2**30:.2f} GiB for the pieces of {len(ranks)} ranks (weights, gradients, Adam states)"]
            if shards
            else []
        ) + (
            [f"{ref_bytes / 2**30:.2f} GiB for the numeric check's single-process reference (--no-check skips it)"]
            if ref_bytes
            else []
        )
        raise ConfigError(
            f"running {plan.model} here needs about {need / 2**30:.2f} GiB of host memory: "
            f"{' and '.join(parts)}; {have / 2**30:.2f} GiB is available. Use more machines, a plan "
            "that splits the model further, or a smaller model"
        )
    return need
