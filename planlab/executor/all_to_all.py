"""The all-to-all of a layout conversion: one shard of a tensor for another on a mesh axis.

Each member of the group holds its piece split along one tensor axis (the source's shard) and
wants the pieces split along another: it cuts its piece into ``n`` equal chunks along the axis
the result is split on, sends chunk ``i`` to the group's ``i``-th member, and concatenates what
it receives along the axis the source was split on, in the group's order (expert parallelism's
dispatch and combine; DeepSpeed-Ulysses' head/sequence exchange has the same shape). One
``torch.distributed.all_to_all_single`` on flat buffers (gloo and NCCL both run it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from planlab.errors import ExecutionError


def exchange(x: torch.Tensor, group: tuple[int, ...], device: int, gather_axis: int, out_shape, pg) -> torch.Tensor:
    """``x`` (this device's piece) exchanged with ``group`` (mesh order; ``pg`` its process group,
    whose ranks are the devices in ascending order): split along the axis where ``out_shape`` is
    smaller than ``x``, gathered along ``gather_axis``; returns the piece of shape ``out_shape``."""
    n = len(group)
    smaller = [d for d, (a, b) in enumerate(zip(x.shape, out_shape)) if a > b]
    if len(smaller) != 1 or x.shape[smaller[0]] != n * out_shape[smaller[0]] or device not in group:
        raise ExecutionError(
            f"all-to-all on device {device} over {group}: a piece of shape {tuple(x.shape)} does not "
            f"split {n} ways into shape {tuple(out_shape)} along one axis"
        )
    order = sorted(group)  # the process group's rank order
    chunks = x.chunk(n, dim=smaller[0])
    send = torch.cat([chunks[group.index(d)].contiguous().reshape(-1) for d in order])
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=pg)
    pieces = recv.split(chunks[0].numel())  # one per rank, in rank order
    return torch.cat([pieces[order.index(d)].view(chunks[0].shape) for d in group], dim=gather_axis)
