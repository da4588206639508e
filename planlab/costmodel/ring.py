"""The price of ring attention (context parallelism, ``cp_kind=ring``): a piece's forward or backward
runs ``steps`` block steps in lock-step around the ring, each overlapping the step's block computation
with the transfer of the next key/value block to the neighbour (Megatron-Core / Transformer Engine's
``AttnFuncWithCPAndKVP2P``, which issues the step's send/receive on its own stream before the block's
kernel).

A step lasts ``max(the slowest rank's block, the transfer)``: every rank waits for its neighbour's
block before its next step, so the ring runs at the pace of the rank with the most work in each step.
With contiguous chunks under a causal mask, rank ``i`` computes chunk ``i - step`` in full, the
diagonal at step 0, and skips the chunks after its own (:meth:`planlab.plan.program.Ring.block`), so
every step after the first is paced by a full block: ``steps - 1/2`` blocks. A zigzag ring (rank ``i``
holding chunks ``i`` and ``2 steps - 1 - i``, :class:`planlab.plan.program.Ring`) balances it as
Megatron-Core and Transformer Engine do: at step 0 each rank computes its two diagonal sub-blocks and one
full one, and at every later step two full sub-blocks (its queries against the first half of an earlier
rank's keys, or the second half of its queries against a later rank's), half a block on every rank, so
``steps / 2`` blocks in all. The transfers are the same whole key/value blocks either way.

A diagonal block costs half a full one: a flash-attention kernel skips the tiles above the diagonal
(Dao, "FlashAttention-2", 2023, section 3.1.1, causal masking: about half of the blocks). The
backward moves the key/value block ahead and the block's key/value gradients behind it, both
overlapped with the step's computation, and one more gradient transfer brings each chunk's gradients
home after the last step.

An all-gather ring (``Ring.gather``: context parallelism as Llama 3 runs it, section 3.3.2 of "The Llama 3
Herd of Models", 2024) passes nothing during its computation: the forward all-gathers the keys and values
first, then computes its queries' blocks, as many as the ring's steps give it, with no step waiting for a
neighbour; the backward all-gathers them again (Transformer Engine's ``AttnFuncWithCPAndKVAllGather``
keeps only the local keys and values), computes, and reduce-scatters the key/value gradients. The
collectives are exposed: :func:`gather_time_s`.
"""

from __future__ import annotations

from planlab.plan.program import Ring, RingBlock

# the share of a full block's kernel work a ring step's block does (FlashAttention-2, section 3.1.1)
BLOCK_SHARE = {RingBlock.FULL: 1.0, RingBlock.DIAGONAL: 0.5, RingBlock.SKIPPED: 0.0}


def rank_share(ring: Ring, rank: int, step: int) -> float:
    """The share of a full block ring position ``rank`` computes at ``step``: its pairs of a query
    chunk and a key chunk (:meth:`Ring.blocks`), each a ``1 / parts²`` sub-block of the step's block."""
    pairs = ring.blocks(rank, step)
    return sum(BLOCK_SHARE[b] for _, _, b in pairs) / len(pairs)


def step_shares(ring: Ring) -> tuple[float, ...]:
    """Per step, the largest share of a full block any rank of the ring computes (the step's pace)."""
    return tuple(max(rank_share(ring, r, step) for r in range(ring.steps)) for step in range(ring.steps))


def ring_time_s(ring: Ring, backward: bool, block_s: float, transfer_s: float) -> float:
    """Seconds of a ring attention piece's forward (or ``backward``): per step the slowest rank's
    block (``block_s`` for a full block) or the transfers it overlaps, whichever is longer.
    ``transfer_s`` is one key/value block's transfer to the ring's slowest neighbour; the forward
    sends ``steps - 1`` blocks, the backward those and ``steps`` blocks of their gradients."""
    total = 0.0
    last = ring.steps - 1
    for step, share in enumerate(step_shares(ring)):
        moves = (step < last) + (1 if backward else 0)
        total += max(share * block_s, moves * transfer_s)
    return total


def gather_time_s(ring: Ring, backward: bool, block_s: float, gather_s: float, scatter_s: float) -> float:
    """Seconds of an all-gather ring's piece (``ring.gather``) forward (or ``backward``): the all-gather
    of the keys and values (``gather_s``), then the most work any rank of the ring computes, its
    shares of a full block (``block_s``) over all the steps, then, backward, the reduce-scatter of
    the key/value gradients (``scatter_s``)."""
    work = max(sum(rank_share(ring, r, step) for step in range(ring.steps)) for r in range(ring.steps))
    return gather_s + work * block_s + (scatter_s if backward else 0.0)
