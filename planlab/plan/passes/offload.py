"""ZeRO-Offload (Ren et al., USENIX ATC'21): the ``materialize`` pass :func:`offload_optimizer`,
after the optimizer steps are made (whole weights or ZeRO-1/2/3 shards).

Each optimizer task of an offloading plan becomes three tasks in the update block: the gradients
it reads are copied device to host over the host link (``L``, :attr:`~planlab.plan.program.Role.TO_HOST`,
writing ``HOST_GRAD`` buffers), the host CPU steps Adam on the host's fp32 master weights
(``O``, :attr:`~planlab.plan.program.Role.HOST_STEP`, on ``HOST_WEIGHT`` buffers), and the updated
weights are copied back host to device (``L``, :attr:`~planlab.plan.program.Role.TO_DEVICE`) into
what the step wrote (the weights, or the ZeRO shard the all-gathers then read). The optimizer
states leave the device's static memory for the host's (``DeviceProgram.host_bytes``).
"""

from __future__ import annotations

from planlab.plan.buffer import Buffer, BufferKind
from planlab.plan.passes.draft import Draft, Part
from planlab.plan.program import Precision, Role, Task, TaskKind

# An fp32 master copy of a weight, on the host (mixed precision's optimizer states already hold one)
MASTER_BYTES = 4


def host_bytes_per_param(precision: Precision) -> int:
    """Host memory per offloaded parameter: the optimizer's states with an fp32 master copy (fp32
    training keeps none apart, its weights are the master: the host holds one) and the gradient's
    host copy, as reduced."""
    master = MASTER_BYTES if precision.param_bytes >= MASTER_BYTES else 0
    return precision.optimizer_bytes + master + precision.grad_bytes


def offload_optimizer(d: Draft) -> Draft:
    """With ``plan.offload_optimizer``, every optimizer task of the update blocks (``STEP`` and
    ``SHARD_STEPS``) becomes copy to host, step on the host CPU, copy to device (see the module
    docstring); with ``plan.offload_stages``, only on the devices whose first pipeline stage is listed. Records nothing else: liveness leaves static host buffers out of device memory."""
    if not d.plan.offload_optimizer:
        return d
    only = set(d.plan.offload_stages)
    parts = dict(d.parts)
    for key, tasks in d.parts.items():
        if key[3] not in (Part.STEP, Part.SHARD_STEPS) or not any(t.kind is TaskKind.OPTIMIZER for t in tasks):
            continue
        if only and key[1][0] not in only:  # per-stage: the device's update block runs in its first stage
            continue
        out: list[Task] = []
        for t in tasks:
            out.extend(_offloaded(t, d.precision) if t.kind is TaskKind.OPTIMIZER else (t,))
        parts[key] = tuple(out)
    return d.replace(parts=parts)


def _on_host(b: Buffer, kind: BufferKind) -> Buffer:
    """The host buffer of a weight or its gradient (``w:p``, ``wg:p``), or of a ZeRO shard's."""
    return Buffer(kind, b.tensor, group=b.group)


def _offloaded(step: Task, pr: Precision) -> tuple[Task, Task, Task]:
    """The three tasks of one offloaded optimizer step."""
    if step.role is Role.SHARD_STEP:  # reads the shard gradient, writes the shard
        grads, weights = step.reads, step.writes
    else:  # reads the weights and their gradients, writes the weights
        grads = tuple(b for b in step.reads if b.kind is BufferKind.WEIGHT_GRAD)
        weights = step.writes
    host_grads = tuple(_on_host(g, BufferKind.HOST_GRAD) for g in grads)
    masters = tuple(_on_host(w, BufferKind.HOST_WEIGHT) for w in weights)
    n = step.params
    to_host = _copy(f"grads-to-host:{step.name}", grads, host_grads, n * pr.grad_bytes, Role.TO_HOST)
    host_step = step.but(name=f"host-{step.name}", reads=masters + host_grads, writes=masters, role=Role.HOST_STEP)
    to_device = _copy(f"weights-to-device:{step.name}", masters, weights, n * pr.param_bytes, Role.TO_DEVICE)
    return to_host, host_step, to_device


def _copy(name: str, reads: tuple[Buffer, ...], writes: tuple[Buffer, ...], nbytes: float, role: Role) -> Task:
    """A copy between device and host memory of ``nbytes``."""
    return Task(name, TaskKind.LOCAL, reads, writes, nbytes=int(nbytes), role=role)
