"""Activation offload in the executor: what an offloaded piece's backward saves goes to host memory
and back as the Program's copies say (:mod:`planlab.plan.passes.act_offload`).

The forward of an offloaded piece runs under :func:`torch.autograd.graph.saved_tensors_hooks`
(the mechanism of torch's ``save_on_cpu``): autograd's saved tensors are packed into the piece's
slots on the device and the graph keeps only a handle. A ``SAVE_TO_HOST`` task copies the slots to
host tensors and empties them; a ``SAVE_TO_DEVICE`` task copies them back; the backward unpacks the
slots, and fails in one line if the Program brought nothing back. On CPU-only gloo ranks host and
device are the same memory: the copies are still real copies between distinct tensors.
"""

from __future__ import annotations

import contextlib

import torch

from planlab.errors import ExecutionError
from planlab.plan.program import DeviceProgram, Role, Task

HOST = torch.device("cpu")
Key = tuple[str, int, int]  # (operator, chunk, micro-batch)


class SavedOnHost:
    """One rank's offloaded pieces, their device slots and their host copies."""

    def __init__(self, dp: DeviceProgram, device: torch.device) -> None:
        self.pieces = frozenset(
            (t.op, t.chunk) for b in dp.blocks.values() for t in b.tasks if t.role is Role.SAVE_TO_HOST
        )
        self.device = device
        self.slots: dict[Key, list[torch.Tensor | None]] = {}
        self.host: dict[Key, list[torch.Tensor]] = {}
        self.moved_bytes = 0  # bytes copied to the host so far (both directions count once)

    def hooks(self, op: str, chunk: int, mb: int):
        """The context a piece's forward runs in: its saved tensors packed into its slots (a plain
        context for a piece that is not offloaded)."""
        if (op, chunk) not in self.pieces:
            return contextlib.nullcontext()
        key = (op, chunk, mb)
        slots = self.slots.setdefault(key, [])

        def pack(t: torch.Tensor) -> tuple[Key, int]:
            slots.append(t)
            return key, len(slots) - 1

        return torch.autograd.graph.saved_tensors_hooks(pack, self.unpack)

    def unpack(self, handle: tuple[Key, int]) -> torch.Tensor:
        key, i = handle
        t = self.slots.get(key, [None] * (i + 1))[i]
        if t is None:
            raise ExecutionError(
                f"piece {key[0]} (chunk {key[1]}, micro-batch {key[2]}): its backward reads a saved activation that "
                "is in host memory; the Program brings it back with a save-to-device task before the backward"
            )
        return t

    def to_host(self, task: Task, mb: int) -> None:
        """Copy the piece's saved tensors to host tensors and empty its device slots."""
        key = (task.op, task.chunk, mb)
        slots = self.slots.get(key, [])
        self.host[key] = [t.detach().to(HOST, copy=True) for t in slots]
        self.moved_bytes += sum(t.numel() * t.element_size() for t in self.host[key])
        self.slots[key] = [None] * len(slots)

    def to_device(self, task: Task, mb: int) -> None:
        """Copy the piece's host tensors back into its device slots."""
        key = (task.op, task.chunk, mb)
        host = self.host.pop(key, None)
        if host is None:
            raise ExecutionError(
                f"save-to-device of piece {task.op} (micro-batch {mb}): nothing of it is in host memory; "
                "its save-to-host task must run first"
            )
        self.slots[key] = [t.to(self.device, copy=True) for t in host]

    def release(self, op: str, chunk: int, mb: int) -> None:
        """After the piece's backward: its slots are no longer needed."""
        self.slots.pop((op, chunk, mb), None)
