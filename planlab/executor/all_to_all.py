"""The all-to-all of a layout conversion: one shard of a tensor for another over a group.

Each member of the group holds its piece split along some tensor axes (the source's shards) and
wants the pieces split along others: it cuts its piece into one chunk per member along the axes
the result is split on, sends each member its chunk, and joins what it receives along the axes the
source was split on, in the group's order (expert parallelism's dispatch and combine; DeepSpeed-Ulysses'
head/sequence exchange has the same shape). A group over several mesh axes (the expert-parallel
and tensor-parallel ranks of a dispatch) is cut and joined axis by axis, outermost first, as
:class:`~planlab.plan.program.ExchangeAxis` says. One ``torch.distributed.all_to_all_single`` on flat
buffers (gloo and NCCL both run it).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from planlab.errors import ExecutionError
from planlab.plan.program import ExchangeAxis


def exchange(
    x: torch.Tensor, group: tuple[int, ...], device: int, axes: tuple[ExchangeAxis, ...], out_shape, pg
) -> torch.Tensor:
    """``x`` (this device's piece) exchanged with ``group`` (mesh order, row-major over ``axes``;
    ``pg`` its process group, whose ranks are the devices in ascending order); returns the piece of
    shape ``out_shape``."""
    n = len(group)
    if math.prod(a.size for a in axes) != n or device not in group or any(x.shape[a.split] % a.size for a in axes):
        raise ExecutionError(
            f"all-to-all on device {device} over {group}: a piece of shape {tuple(x.shape)} does not "
            f"split {n} ways as {', '.join(map(str, axes))} into shape {tuple(out_shape)}"
        )
    chunks = [x]
    for a in axes:  # outermost first: member i's chunk is chunks[i] (row-major over the axes)
        chunks = [c for piece in chunks for c in piece.chunk(a.size, dim=a.split)]
    order = sorted(group)  # the process group's rank order
    send = torch.cat([chunks[group.index(d)].contiguous().reshape(-1) for d in order])
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=pg)
    pieces = recv.split(chunks[0].numel())  # one per rank, in rank order
    blocks = [pieces[order.index(d)].view(chunks[0].shape) for d in group]
    for a in reversed(axes):  # innermost first: join each run of members along the axis
        blocks = [torch.cat(blocks[i : i + a.size], dim=a.gather) for i in range(0, len(blocks), a.size)]
    (y,) = blocks
    if tuple(y.shape) != tuple(out_shape):
        raise ExecutionError(
            f"all-to-all on device {device} over {group}: got shape {tuple(y.shape)}, not {tuple(out_shape)}"
        )
    return y
