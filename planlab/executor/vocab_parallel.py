"""Megatron-LM's vocabulary-parallel cross entropy, for a piece of a loss split along the vocabulary.

A loss operator whose vocabulary dimension a plan splits (``planlab.models.vocab_parallel``'s
``vocab_cross_entropy``: signature ``n+ v+, n+ -> 1``) runs on each device over its slice of the
logits. The pieces agree on each token's log-sum-exp through two all-reduces over the devices that
hold the slices (the largest logit, then the sums of exponentials and the target's logit), as
``vocab_parallel_cross_entropy`` does in Megatron-LM; each piece returns ``1/P`` of the
micro-batch's summed loss divided by ``count`` (the tokens of the whole loss), so that the
pieces add up to the loss as the pieces of any split reduction do. The backward needs no
communication: each piece's logits get ``softmax - onehot``, scaled by the loss's gradient over
``count`` (every piece of a summed tensor gets the same gradient).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, offset: int, count: int, group) -> torch.Tensor:
        pieces = 1 if group is None else dist.get_world_size(group)
        x = logits.float()
        top = x.max(dim=-1).values
        if group is not None:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = x - top.unsqueeze(-1)
        local = target - offset
        inside = (local >= 0) & (local < x.shape[-1])
        local = local.masked_fill(~inside, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * inside
        exp = shifted.exp()
        stats = torch.stack([exp.sum(dim=-1), picked])
        if group is not None:
            dist.all_reduce(stats, group=group)
        per_token = stats[0].log() - stats[1]
        ctx.save_for_backward(exp / stats[0].unsqueeze(-1), local, inside)
        ctx.count, ctx.dtype = count, logits.dtype
        return (per_token.sum() / (count * pieces)).to(logits.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, local, inside = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, local.unsqueeze(-1), -inside.to(g.dtype).unsqueeze(-1))
        return (g * (grad / ctx.count)).to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, *, offset: int, count: int, group
) -> torch.Tensor:
    """This piece's share of the mean cross entropy of ``logits`` (N, V/P: vocabulary entries
    ``offset ..``) against ``target`` (N,), over ``count`` tokens in all, the other slices held by
    the devices of ``group`` (None: this piece holds the whole vocabulary): a zero-dimensional
    tensor; the shares of the group add up to the loss."""
    return _VocabParallelCrossEntropy.apply(logits, target, offset, count, group)
