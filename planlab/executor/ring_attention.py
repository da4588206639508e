"""Ring attention on a context-parallel group (``cp_kind=ring``), as Megatron-Core and Transformer
Engine run it inside the attention: each rank holds one chunk of the sequence (queries, keys and
values); in ``cp`` steps its queries meet every chunk's keys and values, passed around the ring by
send/receive while the step's block is computed, and the blocks' results merge by the online-softmax
(log-sum-exp) rule. The backward passes the keys and values around again, with the gradients of each
block's keys and values travelling behind them until they reach the chunk's owner.

Each rank holds one contiguous chunk (rank ``i`` of the ring holds chunk ``i``) or, with a zigzag ring
(Megatron-Core's and Llama 3's causal load balancing), two: chunks ``i`` and ``2 cp - 1 - i`` of ``2 cp``,
the tokens permuted so at the input (:func:`zigzag_tokens`). Under a causal mask each pair of a query
chunk and a key chunk is full, diagonal or skipped (:meth:`planlab.plan.program.Ring.blocks`), and a step
computes its pairs as sub-blocks (Transformer Engine's half-blocks), merging each query chunk's by
the log-sum-exp rule. Shapes are
``(B.., H, S, D)`` for queries and ``(B.., Hk, S, D)`` / ``(B.., Hk, S, E)`` for keys and values, with
``H`` a multiple of ``Hk`` (grouped-query attention, as ``enable_gqa``).

An all-gather ring (``Ring.gather``, ``cp_kind=allgather``: Llama 3's context parallelism, section 3.3.2 of
"The Llama 3 Herd of Models") passes nothing around: each rank all-gathers every rank's keys and values
(again in the backward, as Transformer Engine's ``AttnFuncWithCPAndKVAllGather`` keeps only its own), computes
the blocks a ring's steps would give it from them, and reduce-scatters the key/value gradients, each rank's
back to it.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from planlab.plan.program import Ring, RingBlock, Zigzag


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


def _parts(t: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """The ``n`` chunks of the sequence (axis -2) a piece holds (:meth:`Ring.chunks`)."""
    return t.chunk(n, dim=-2)


def _merge(acc: list, i: int, b_out: torch.Tensor, b_lse: torch.Tensor) -> None:
    """Merge a block's partial result into part ``i`` of the queries' by the online-softmax rule."""
    if acc[i] is None:  # the first block a part of the queries meets has a finite lse in every row
        acc[i] = (b_out, b_lse)
        return
    out, lse = acc[i]
    new = torch.logaddexp(lse, b_lse)
    acc[i] = (out * torch.exp(lse - new).unsqueeze(-1) + b_out * torch.exp(b_lse - new).unsqueeze(-1), new)


def _forward_step(q, kv, k, v, ring: Ring, pos: int, step: int, scale: float, acc: list) -> None:
    """One step of the forward: this rank's queries against the key/value block ``kv`` it holds."""
    n, rep = len(ring.chunks(pos)), q.shape[-3] // k.shape[-3]
    kb, vb = _unpack(kv, k, v)
    qs, ks, vs = _parts(q, n), _parts(_heads(kb, rep), n), _parts(_heads(vb, rep), n)
    for i, j, block in ring.blocks(pos, step):
        if block is RingBlock.SKIPPED:
            continue
        s = _scores(qs[i], ks[j], scale, block)
        b_lse = torch.logsumexp(s, dim=-1)
        _merge(acc, i, torch.matmul(torch.exp(s - b_lse.unsqueeze(-1)), vs[j]), b_lse)


def _backward_step(q, kv, k, v, dout, lse, delta, ring: Ring, pos: int, step: int, scale: float):
    """One step of the backward: this block's gradients of this rank's queries and of the block's
    keys and values (a flat buffer, as the block travels)."""
    n, rep = len(ring.chunks(pos)), q.shape[-3] // k.shape[-3]
    kb, vb = _unpack(kv, k, v)
    kh, vh = _heads(kb, rep), _heads(vb, rep)
    qs, ks, vs, dos = _parts(q, n), _parts(kh, n), _parts(vh, n), _parts(dout, n)
    lses, deltas = _parts(lse.unsqueeze(-1), n), _parts(delta, n)
    dq, dk, dv = [torch.zeros_like(x) for x in qs], [torch.zeros_like(x) for x in ks], [torch.zeros_like(x) for x in vs]
    for i, j, block in ring.blocks(pos, step):
        if block is RingBlock.SKIPPED:
            continue
        p = torch.exp(_scores(qs[i], ks[j], scale, block) - lses[i])
        dv[j] = dv[j] + torch.matmul(p.transpose(-2, -1), dos[i])
        ds = p * (torch.matmul(dos[i], vs[j].transpose(-2, -1)) - deltas[i])
        dq[i] = dq[i] + torch.matmul(ds, ks[j]) * scale
        dk[j] = dk[j] + torch.matmul(ds.transpose(-2, -1), qs[i]) * scale
    return torch.cat(dq, dim=-2), _pack(_fold(torch.cat(dk, dim=-2), rep), _fold(torch.cat(dv, dim=-2), rep))


def _gathered(kv: torch.Tensor, ranks: tuple[int, ...], pos: int, group) -> list[torch.Tensor]:
    """Per ring step, the key/value block (packed) this rank meets at that step, all-gathered from
    the ring: at step ``i`` the block of position ``(pos - i) mod n``, as a ring would pass it."""
    n, members = len(ranks), dist.get_process_group_ranks(group)  # the group's ranks in its own order
    every = [torch.empty_like(kv) for _ in range(n)]
    dist.all_gather(every, kv, group=group)
    return [every[members.index(ranks[(pos - step) % n])] for step in range(n)]


def _ring_forward(q, k, v, ring: Ring, ranks: tuple[int, ...], group, scale: float, acc: list) -> None:
    """The forward of a ring: each step's block computed while the next arrives from the previous rank."""
    pos, kv = ranks.index(dist.get_rank()), _pack(k, v)
    for step in range(ring.steps):
        reqs, nxt = _exchange(kv, ranks, pos, group) if step < ring.steps - 1 else ([], kv)
        _forward_step(q, kv, k, v, ring, pos, step, scale, acc)
        _wait(reqs)
        kv = nxt


def _gather_forward(q, k, v, ring: Ring, ranks: tuple[int, ...], group, scale: float, acc: list) -> None:
    """The forward of an all-gather ring: every block met after one all-gather of the keys and values."""
    pos = ranks.index(dist.get_rank())
    for step, kv in enumerate(_gathered(_pack(k, v), ranks, pos, group)):
        _forward_step(q, kv, k, v, ring, pos, step, scale, acc)


def _gather_backward(q, k, v, dout, lse, delta, ring: Ring, ranks: tuple[int, ...], group, scale: float):
    """The backward of an all-gather ring: the keys and values all-gathered again, every block's
    gradients computed, and the key/value gradients reduce-scattered back to their positions."""
    pos, n = ranks.index(dist.get_rank()), len(ranks)
    dq, dkv = torch.zeros_like(q), [None] * n
    for step, kv in enumerate(_gathered(_pack(k, v), ranks, pos, group)):
        b_dq, dkv[(pos - step) % n] = _backward_step(q, kv, k, v, dout, lse, delta, ring, pos, step, scale)
        dq = dq + b_dq
    mine = torch.empty_like(dkv[pos])
    members = dist.get_process_group_ranks(group)
    dist.reduce_scatter_tensor(mine, torch.cat([dkv[ranks.index(r)] for r in members]), group=group)
    return dq, mine


class RingAttention(torch.autograd.Function):
    """``softmax(q kᵀ scale [+ causal mask]) v`` over the whole sequence, each rank holding one
    chunk (two, zigzag)."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, ranks: tuple[int, ...], group, scale: float):
        pos = ranks.index(dist.get_rank())
        acc: list = [None] * len(ring.chunks(pos))
        (_gather_forward if ring.gather else _ring_forward)(q, k, v, ring, ranks, group, scale, acc)
        out, lse = torch.cat([a[0] for a in acc], dim=-2), torch.cat([a[1] for a in acc], dim=-1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.ranks, ctx.group, ctx.scale = ring, ranks, group, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, ranks, group, scale = ctx.ring, ctx.ranks, ctx.group, ctx.scale
        pos = ranks.index(dist.get_rank())
        delta = (dout * out).sum(-1, keepdim=True)  # (B.., H, S, 1)
        if ring.gather:
            dq, dkv = _gather_backward(q, k, v, dout, lse, delta, ring, ranks, group, scale)
            dk, dv = _unpack(dkv, k, v)
            return dq, dk.clone(), dv.clone(), None, None, None, None
        dq = torch.zeros_like(q)
        kv, dkv = _pack(k, v), torch.zeros(k.numel() + v.numel(), dtype=q.dtype, device=q.device)
        for step in range(ring.steps):
            reqs, nxt = _exchange(kv, ranks, pos, group) if step < ring.steps - 1 else ([], kv)
            b_dq, b_dkv = _backward_step(q, kv, k, v, dout, lse, delta, ring, pos, step, scale)
            dq, dkv = dq + b_dq, dkv + b_dkv
            _wait(reqs)
            kv = nxt
            # this block's key/value gradients go on behind its keys and values; after the last step
            # each rank receives its own chunk's
            dreqs, dkv = _exchange(dkv, ranks, pos, group)
            _wait(dreqs)
        dk, dv = _unpack(dkv, k, v)
        return dq, dk.clone(), dv.clone(), None, None, None, None


def zigzag_tokens(x: torch.Tensor, order: Zigzag) -> torch.Tensor:
    """``x`` with its sequence (axis ``order.axis``) in zigzag order: its ``order.chunks`` chunks
    ``0, n - 1, 1, n - 2, ...``, so contiguous pieces of it hold a zigzag ring's chunks (the token
    permutation at the input, as Megatron-Core's ``get_batch_on_this_cp_rank``)."""
    parts = x.chunk(order.chunks, dim=order.axis)
    return torch.cat([parts[c] for c in order.order()], dim=order.axis)


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, ring: Ring, ranks: tuple[int, ...], group, scale=None
) -> torch.Tensor:
    """This rank's chunk of the attention of the whole sequence held in chunks by ``ranks`` (the ring,
    in chunk order, on process group ``group``), as ``F.scaled_dot_product_attention(q, k, v,
    is_causal=ring.causal, scale=scale)`` gives for those rows."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return RingAttention.apply(q, k, v, ring, tuple(ranks), group, float(scale))
