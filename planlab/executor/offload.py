"""ZeRO-Offload in the executor: the host's fp32 master weights and their Adam, apart from the
device's tensors, and the copies between the two that the Program's tasks name
(:mod:`planlab.plan.passes.offload`).

Each ``HOST_WEIGHT`` buffer is a tensor of its own, made once from the device tensor it masters
(a weight piece, or a ZeRO shard) and stepped by its own Adam; a ``TO_HOST`` task copies the
gradients into ``HOST_GRAD`` tensors, the ``HOST_STEP`` steps the masters with them, and a
``TO_DEVICE`` task copies the masters back into the device tensors. On CPU-only gloo ranks host
and device are the same memory: the copies are still real copies between distinct tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from planlab.plan.buffer import Buffer, BufferKind
from planlab.plan.program import DeviceProgram, Role, Task

HOST = torch.device("cpu")


@dataclass
class HostMaster:
    """One offloaded tensor's fp32 master on the host, its Adam, and the device tensor it masters."""

    master: torch.Tensor
    optimizer: torch.optim.Optimizer
    device_tensor: torch.Tensor


def offloaded_weights(dp: DeviceProgram) -> dict[Buffer, Buffer]:
    """Per ``HOST_WEIGHT`` buffer of the device's host steps, the device buffer it masters (a
    weight ``w:p``, or a ZeRO shard gradient ``zg:...``, which keys the shard)."""
    out = {}
    for block in dp.blocks.values():
        for t in block.tasks:
            if t.role is Role.HOST_STEP:
                for b in t.writes:
                    kind = BufferKind.SHARD_GRAD if b.group else BufferKind.WEIGHT
                    out[b] = Buffer(kind, b.tensor, group=b.group)
    return out


def host_masters(device_tensors: dict[Buffer, torch.Tensor], lr: float) -> dict[Buffer, HostMaster]:
    """The host's masters of ``device_tensors`` (by ``HOST_WEIGHT`` buffer), each a copy in host
    memory with its own Adam at learning rate ``lr``."""
    out = {}
    for hw, tensor in device_tensors.items():
        master = tensor.detach().to(HOST, dtype=torch.float32, copy=True).requires_grad_(True)
        out[hw] = HostMaster(master, torch.optim.Adam([master], lr=lr), tensor)
    return out


def copy_to_host(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients copied into host memory (fp32), as a ``TO_HOST`` task does."""
    return [g.detach().to(HOST, dtype=torch.float32, copy=True) for g in grads]


def host_step(task: Task, masters: dict[Buffer, HostMaster], host: dict[Buffer, torch.Tensor]) -> None:
    """Adam on the host masters a ``HOST_STEP`` task writes, with the host gradients it reads
    (its reads: the masters, then their gradients, in the same order)."""
    n = len(task.writes)
    for hw, hg in zip(task.writes, task.reads[n:]):
        m = masters[hw]
        m.master.grad = host.pop(hg)
        m.optimizer.step()
        m.optimizer.zero_grad(set_to_none=True)


def copy_to_device(task: Task, masters: dict[Buffer, HostMaster]) -> None:
    """The updated masters a ``TO_DEVICE`` task reads copied into the device tensors they master."""
    with torch.no_grad():
        for hw in task.reads:
            m = masters[hw]
            m.device_tensor.copy_(m.master.to(m.device_tensor.device, dtype=m.device_tensor.dtype))
