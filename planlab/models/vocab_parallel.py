"""Megatron-LM's vocabulary-parallel embedding and cross entropy, as operators a plan may split
along the vocabulary.

Whole, they are ``F.embedding`` and ``F.cross_entropy``. Split along ``v``, each piece looks up (or
scores) its rows of the vocabulary: an embedding piece gives zeros for ids outside its rows, and
an all-reduce adds the pieces, as Megatron's VocabParallelEmbedding does; a loss piece agrees with
the others on each token's log-sum-exp inside its forward and gives its share of the mean, as
``vocab_parallel_cross_entropy`` does (:mod:`planlab.executor.vocab_parallel`). A GPT built with
``vocab_parallel=1`` uses them (:class:`planlab.models.gpt.GPT`), and so does
``planlab.validation``'s model of Megatron-LM's measured runs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from planlab.errors import PlanlabError
from planlab.graph.registry import register_op
from planlab.models.configs import VOCAB_EMBEDDINGS  # noqa: F401 (re-exported)


@register_op("a b, v+ h -> a b h", flops=lambda idx, table: 0.0)
def vocab_embedding(idx: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The embedding of ``idx`` (B, T) in ``table`` (V, H): Megatron's vocabulary-parallel embedding."""
    if idx.device.type != "meta" and idx.numel() and int(idx.max()) >= table.shape[0]:
        raise PlanlabError(f"vocab_embedding: a token id is beyond this table's {table.shape[0]} rows")
    return F.embedding(idx, table)


@register_op("n+ v+, n+ -> 1", flops=lambda logits, target: 4.0 * math.prod(logits))
def vocab_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of ``logits`` (N, V) against ``target`` (N,), as a one-element tensor:
    Megatron's vocabulary-parallel loss."""
    if target.device.type != "meta" and target.numel() and int(target.max()) >= logits.shape[-1]:
        raise PlanlabError(f"vocab_cross_entropy: a target is beyond these {logits.shape[-1]} logits")
    return F.cross_entropy(logits, target).reshape(1)
