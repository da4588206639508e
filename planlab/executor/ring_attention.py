"""Ring attention on a context-parallel group (``cp_kind=ring``), as Megatron-Core and Transformer
Engine run it inside the attention: each rank holds one chunk of the sequence (queries, keys and
values); in ``cp`` steps its queries meet every chunk's keys and values, passed around the ring by
send/receive while the step's block is computed, and the blocks' results merge by the online-softmax
(log-sum-exp) rule. The backward passes the keys and values around again, with the gradients of each
block's keys and values travelling behind them until they reach the chunk's owner.

The chunks are contiguous (rank ``i`` of the ring holds chunk ``i``); under a causal mask a block is
full, diagonal or skipped (:meth:`planlab.plan.program.Ring.block`). Shapes are
``(B.., H, S, D)`` for queries and ``(B.., Hk, S, D)`` / ``(B.., Hk, S, E)`` for keys and values, with
``H`` a multiple of ``Hk`` (grouped-query attention, as ``enable_gqa``).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from planlab.plan.program import RingBlock, Ring


def _exchange(t: torch.Tensor, ranks: tuple[int, ...], pos: int, group) -> tuple[list, torch.Tensor]:
    """Start sending ``t`` to the next rank of the ring and receiving the previous rank's into a new
    tensor; returns the requests to wait on and that tensor."""
    n = len(ranks)
    got = torch.empty_like(t)
    reqs = [
        dist.isend(t, dst=ranks[(pos + 1) % n], group=group),
        dist.irecv(got, src=ranks[(pos - 1) % n], group=group),
    ]
    return reqs, got


def _wait(reqs: list) -> None:
    for r in reqs:
        r.wait()


def _pack(*ts: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def _unpack(flat: torch.Tensor, *likes: torch.Tensor) -> tuple[torch.Tensor, ...]:
    out, at = [], 0
    for t in likes:
        out.append(flat[at : at + t.numel()].view_as(t))
        at += t.numel()
    return tuple(out)


def _heads(kv: torch.Tensor, rep: int) -> torch.Tensor:
    """Keys or values with each head repeated for the ``rep`` query heads that share it."""
    return kv if rep == 1 else kv.repeat_interleave(rep, dim=-3)


def _fold(g: torch.Tensor, rep: int) -> torch.Tensor:
    """A gradient over the repeated heads summed back onto the shared key/value heads."""
    return g if rep == 1 else g.unflatten(-3, (g.shape[-3] // rep, rep)).sum(-3)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, block: RingBlock) -> torch.Tensor:
    """Scaled scores ``(B.., H, S, S)`` of one block, the diagonal one masked causally."""
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if block is RingBlock.DIAGONAL:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return s


class RingAttention(torch.autograd.Function):
    """``softmax(q kᵀ scale [+ causal mask]) v`` over the whole sequence, each rank holding one chunk."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, ranks: tuple[int, ...], group, scale: float):
        pos, rep = ranks.index(dist.get_rank()), q.shape[-3] // k.shape[-3]
        out = lse = None
        kv = _pack(k, v)
        for step in range(ring.steps):
            reqs, nxt = _exchange(kv, ranks, pos, group) if step < ring.steps - 1 else ([], kv)
            block = ring.block(pos, step)
            if block is not RingBlock.SKIPPED:
                kb, vb = _unpack(kv, k, v)
                s = _scores(q, _heads(kb, rep), scale, block)
                b_lse = torch.logsumexp(s, dim=-1)
                b_out = torch.matmul(torch.exp(s - b_lse.unsqueeze(-1)), _heads(vb, rep))
                if out is None:  # step 0 is the diagonal (or a full) block: every row has a finite lse
                    out, lse = b_out, b_lse
                else:  # the online-softmax merge of two partial results
                    new = torch.logaddexp(lse, b_lse)
                    out = out * torch.exp(lse - new).unsqueeze(-1) + b_out * torch.exp(b_lse - new).unsqueeze(-1)
                    lse = new
            _wait(reqs)
            kv = nxt
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.ranks, ctx.group, ctx.scale = ring, ranks, group, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, ranks, group, scale = ctx.ring, ctx.ranks, ctx.group, ctx.scale
        pos, rep = ranks.index(dist.get_rank()), q.shape[-3] // k.shape[-3]
        delta = (dout * out).sum(-1, keepdim=True)  # (B.., H, S, 1)
        dq = torch.zeros_like(q)
        kv, dkv = _pack(k, v), torch.zeros(k.numel() + v.numel(), dtype=q.dtype, device=q.device)
        for step in range(ring.steps):
            reqs, nxt = _exchange(kv, ranks, pos, group) if step < ring.steps - 1 else ([], kv)
            block = ring.block(pos, step)
            if block is not RingBlock.SKIPPED:
                kb, vb = _unpack(kv, k, v)
                kh, vh = _heads(kb, rep), _heads(vb, rep)
                p = torch.exp(_scores(q, kh, scale, block) - lse.unsqueeze(-1))
                dv = torch.matmul(p.transpose(-2, -1), dout)
                ds = p * (torch.matmul(dout, vh.transpose(-2, -1)) - delta)
                dq = dq + torch.matmul(ds, kh) * scale
                dk = torch.matmul(ds.transpose(-2, -1), q) * scale
                dkv = dkv + _pack(_fold(dk, rep), _fold(dv, rep))
            _wait(reqs)
            kv = nxt
            # this block's key/value gradients go on behind its keys and values; after the last step
            # each rank receives its own chunk's
            dreqs, dkv = _exchange(dkv, ranks, pos, group)
            _wait(dreqs)
        dk, dv = _unpack(dkv, k, v)
        return dq, dk.clone(), dv.clone(), None, None, None, None


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, ring: Ring, ranks: tuple[int, ...], group, scale=None
) -> torch.Tensor:
    """This rank's chunk of the attention of the whole sequence held in chunks by ``ranks`` (the ring,
    in chunk order, on process group ``group``), as ``F.scaled_dot_product_attention(q, k, v,
    is_causal=ring.causal, scale=scale)`` gives for those rows."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return RingAttention.apply(q, k, v, ring, tuple(ranks), group, float(scale))
