"""ZeRO-3 in the interpreter: the tasks :mod:`planlab.plan.zero` adds, run on a unit's flat shard.

Each unit is a :class:`~planlab.executor.interpreter._ZeroBucket` (the weights of one layer
flattened, padded, and this device's ``chunk`` of them with its own Adam). Per micro-batch:

- the forward all-gather makes one flat tensor of the unit's full weights; the forward tasks read
  views of it (as leaves of their own autograd graphs, which save them for the backward);
- freeing a gathered weight gives the flat tensor's memory back (its storage resized to nothing,
  as FSDP frees unsharded parameters), the autograd graphs keeping only empty views;
- the backward all-gather fills the same storage again (the weights have not changed within the
  iteration), so the saved views hold the full weights when the backward tasks need them;
- the full gradients are reduce-scattered (gloo has no reduce-scatter: an all-reduce, keeping
  this device's chunk) on the side, and added to the unit's shard gradient when they complete.

The optimizer steps the shard; nothing is all-gathered after it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from planlab.errors import ExecutionError
from planlab.plan.buffer import Buffer, BufferKind
from planlab.plan.program import Task


def gather(interp, task: Task, mb: int) -> None:
    """All-gather a unit's shards into its full weights for micro-batch ``mb`` (for its forward or
    its backward: ``GATHERED_FORWARD`` or ``GATHERED_BACKWARD`` buffers)."""
    z = interp.zero[task.reads[0].with_kind(BufferKind.SHARD_GRAD)]
    parts = [torch.empty_like(z.shard) for _ in range(z.n)]
    dist.all_gather(parts, z.shard.detach(), group=interp.groups[z.group])
    if task.writes[0].kind is BufferKind.GATHERED_FORWARD:  # a new tensor, whose views the forward tasks read
        flat = interp.gathered[(z.key, mb)] = torch.cat(parts)
    else:  # the forward's storage again, filled without touching autograd's view of it
        flat = interp.gathered.get((z.key, mb))
        if flat is None:
            raise ExecutionError(f"device {interp.device}: {task.name} for micro-batch {mb} before its forward")
        flat.untyped_storage().resize_(flat.numel() * flat.element_size())
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(flat):
            torch.cat(parts, out=flat)
    off = 0
    for p, shape, buf in zip(z.params, z.shapes, task.writes):
        n = _numel(shape)
        interp.bufs[(buf, mb)] = flat[off : off + n].view(shape)
        off += n


def release(interp, buf: Buffer, mb: int) -> None:
    """``buf`` (a gathered weight) is freed: give its unit's memory back; the backward's
    release ends the unit's micro-batch."""
    key = interp.unit_of.get(buf)
    flat = interp.gathered.get((key, mb)) if key is not None else None
    if flat is not None:
        flat.untyped_storage().resize_(0)
        if buf.kind is BufferKind.GATHERED_BACKWARD:
            del interp.gathered[(key, mb)]


def reduce_scatter(interp, task: Task, mb: int) -> None:
    """Start reducing a unit's full gradients over its group; :func:`take` adds this device's
    chunk of the sum to the unit's shard gradient once it completes."""
    z = interp.zero[task.writes[0]]
    pg = interp.groups[z.group]
    zeros = {}
    grads = []
    for p, shape, b in zip(z.params, z.shapes, task.reads):
        g = interp.bufs.get((b, mb))
        if g is None:  # an operator whose output reaches no loss gives no gradient
            g = zeros.setdefault(shape, torch.zeros(shape, dtype=z.shard.dtype, device=z.shard.device))
        grads.append(g.reshape(-1))
    flat = torch.cat(grads)
    flat = torch.nn.functional.pad(flat, (0, z.chunk * z.n - flat.numel()))
    if interp._backend == "nccl":
        out = torch.empty(z.chunk, dtype=flat.dtype, device=flat.device)
        work = dist.reduce_scatter_tensor(out, flat, group=pg, async_op=True)
    else:  # gloo has no reduce-scatter: all-reduce, keep our chunk
        out = flat
        work = dist.all_reduce(flat, group=pg, async_op=True)
    interp.overlapped.append((work, task, out))


def take(interp, task: Task, reduced: torch.Tensor) -> None:
    """Add this device's chunk of a completed gradient reduction to the unit's shard gradient."""
    z = interp.zero[task.writes[0]]
    chunk = reduced if reduced.numel() == z.chunk else reduced[z.me * z.chunk : (z.me + 1) * z.chunk]
    cur = interp.static.get(task.writes[0])
    interp.static[task.writes[0]] = chunk.clone() if cur is None else cur + chunk


def own_outputs(outs: tuple, ins: list) -> tuple:
    """Outputs that are views of a gathered weight (a slice of a parameter, say) copied out of it,
    so that freeing the weight leaves them whole."""
    ptrs = {x.untyped_storage().data_ptr() for x in ins if isinstance(x, torch.Tensor)}
    return tuple(
        o.clone() if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() in ptrs else o for o in outs
    )


def full_gradients(z, shard_grad: torch.Tensor, pg) -> dict[str, torch.Tensor]:
    """The unit's whole gradients, gathered from every device's shard (for the numeric check)."""
    parts = [torch.empty_like(shard_grad) for _ in range(z.n)]
    dist.all_gather(parts, shard_grad.contiguous(), group=pg)
    flat = torch.cat(parts)
    out, off = {}, 0
    for p, shape in zip(z.params, z.shapes):
        n = _numel(shape)
        out[p] = flat[off : off + n].view(shape).clone()
        off += n
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
