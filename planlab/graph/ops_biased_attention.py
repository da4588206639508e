"""Attention with an additive bias on the scores, as one operator.

T5's self-attention adds a relative position bias (and, in the decoder, the causal mask) to the
raw scores ``q k^T`` and does not scale them (Raffel et al. 2020 fold ``1/sqrt(d)`` into the
initialization); Swin-style window attention and AlphaFold's pair bias have the same shape.
:func:`attention_with_bias` computes ``softmax(scale * q k^T + bias) v`` with PyTorch's fused
``scaled_dot_product_attention`` and is kept whole while tracing (a leaf), so the graph holds one
attention operator per layer instead of a matmul, an add, a softmax and a second matmul, and the
memory model saves what a fused kernel saves (its inputs and output, not the score matrix).

Its signature, for ``q: (*b, s, d)``, ``k: (*b, t, d)``, ``v: (*b, t, e)`` and a bias that
broadcasts against ``(*b, s, t)`` (aligned right; its size-1 axes are literal ``1``)::

    b h s d^, b h t^ d^, b h t^ e^, 1 h s t^ -> b h s e^

The batch-like axes (batch, heads) and the query sequence ``s`` split: each query row sees its
own row of the bias, so unlike ``is_causal=True`` attention (whose mask depends on absolute
positions) a causal mask carried in the bias does not stop a split of ``s``. The key sequence
``t`` (the softmax axis) and the head sizes ``d`` and ``e`` stay whole.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from planlab.graph import ops_einsum  # noqa: F401  (defined before this module: registry order)
from planlab.graph.opdefs import OpContext, axis_names, define_op, keep_whole
from planlab.graph.signature import Signature


def attention_with_bias(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float = 1.0, dropout_p: float = 0.0
) -> torch.Tensor:
    """``softmax(scale * q k^T + bias) v`` with dropout ``dropout_p`` on the attention weights.

    ``q``: (*B, S, D), ``k``: (*B, T, D), ``v``: (*B, T, E); ``bias`` broadcasts against
    (*B, S, T) and may require grad (a learned position bias). Returns (*B, S, E). ``scale``
    defaults to 1 (T5's unscaled scores), not ``1/sqrt(D)``.
    """
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p, scale=scale)


def _biased_attention(c: OpContext) -> Signature:
    """``b.. s d, b.. t d, b.. t e, bias -> b.. s e`` with the bias aligned right against
    ``(b.., s, t)``: an axis of the full size carries its name, a size-1 axis is a literal 1."""
    q, k, v, bias = c.in_shapes[:4]
    b = axis_names(len(q) - 2)
    full = [*b, "s", "t"]
    sizes = [*q[:-2], q[-2], k[-2]]
    off = len(full) - len(bias)
    bias_axes = [(full[off + j],) if n == sizes[off + j] else () for j, n in enumerate(bias)]
    bs = [(n,) for n in b]
    ins = [[*bs, ("s",), ("d",)], [*bs, ("t",), ("d",)], [*bs, ("t",), ("e",)], bias_axes]
    return Signature.of(ins, [[*bs, ("s",), ("e",)]], (), {"d", "e", "t"})


def _flops(c: OpContext) -> float:
    """Scores ``q k^T`` and the weighted sum ``p v``: 2 S T D + 2 S T E per (batch, head), plus the
    bias add and the softmax (about 6 S T)."""
    q, k = c.in_shapes[0], c.in_shapes[1]
    t = k[-2]
    scores = math.prod(q[:-1]) * t
    return 2.0 * math.prod(q) * t + 2.0 * c.out_numel * t + 6.0 * scores


define_op(
    targets_fn=(attention_with_bias,),
    kind="attention",
    signature=_biased_attention,
    flops=_flops,
    saves=lambda c: ("in0", "in1", "in2", "in3", "out0"),
    bwd_flops_ratio=2.5,
)
# Kept whole while tracing, as functions given to register_op are.
keep_whole(attention_with_bias)
