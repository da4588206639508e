"""The built-in operators of a GPT decoder (linear, embedding, norms, activations, dropout,
arithmetic, softmax, attention, cross entropy, matmul, views, indexing, cat): the first
definitions of the registry (:mod:`planlab.graph.registry`); the other ``ops_*`` modules come
after them.
"""

from __future__ import annotations

import math
import operator as _op

import torch
import torch.nn as nn
import torch.nn.functional as F

from planlab.graph.opdefs import (
    OpContext,
    axis_names,
    define_op,
    elementwise_signature,
    getitem_signature,
    opaque_signature,
    reshape_signature,
)
from planlab.graph.signature import Signature


def _linear(c: OpContext) -> Signature:
    x = c.in_shapes[0]
    b = axis_names(len(x) - 1)
    ins = [[*[(n,) for n in b], ("k",)], [("n",), ("k",)]]
    if len(c.in_shapes) > 2:
        ins.append([("n",)])
    return Signature.of(ins, [[*[(n,) for n in b], ("n",)]], {"k"})


def _embedding(c: OpContext) -> Signature:
    i = axis_names(len(c.in_shapes[0]))
    # the vocabulary splits as Megatron's VocabParallelEmbedding does: each piece looks up the ids in
    # its rows (zeros elsewhere) and the pieces add up (planlab.executor.pieces.run_piece)
    return Signature.of([[(n,) for n in i], [("v",), ("h",)]], [[*[(n,) for n in i], ("h",)]], {"v"})


def _layer_norm(c: OpContext) -> Signature:
    x = c.in_shapes[0]
    k = len(c.in_shapes[1]) if len(c.in_shapes) > 1 else 1
    b = axis_names(len(x) - k)
    h = [f"h{i}" for i in range(k)]
    xs = [*[(n,) for n in b], *[(n,) for n in h]]
    ins = [xs] + [[(n,) for n in h] for _ in c.in_shapes[1:]]
    return Signature.of(ins, [xs], (), set(h))


def _softmax_dim(c: OpContext) -> int:
    if "dim" in c.kwargs and c.kwargs["dim"] is not None:
        return c.kwargs["dim"]
    consts = [a for a in c.args[1:] if isinstance(a, int)]
    return consts[0] if consts else -1


def _sdpa(c: OpContext) -> Signature:
    q, k, v = c.in_shapes[:3]
    b = [(n,) for n in axis_names(len(q) - 2)]
    causal = bool(c.kwargs.get("is_causal", False))
    frozen = {"d", "e", "t"} | ({"s"} if causal or len(c.in_shapes) > 3 else set())
    ins = [[*b, ("s",), ("d",)], [*b, ("t",), ("d",)], [*b, ("t",), ("e",)]]
    if len(c.in_shapes) > 3:  # attention mask, broadcast against (b.., s, t)
        m = c.in_shapes[3]
        full = [*b, ("s",), ("t",)]
        ins.append(full[len(full) - len(m) :])
    return Signature.of(ins, [[*b, ("s",), ("e",)]], (), frozen)


def _cross_entropy(c: OpContext) -> Signature:
    x = c.in_shapes[0]
    red = c.kwargs.get("reduction", "mean")
    rest = [f"r{i}" for i in range(len(x) - 2)]
    xs = [("n",), ("c",), *[(r,) for r in rest]]
    ts = [("n",), *[(r,) for r in rest]]
    ins = [xs, ts] + ([[("c",)]] if len(c.in_shapes) > 2 else [])
    if red == "none":
        return Signature.of(ins, [ts], (), {"c"})
    return Signature.of(ins, [[]], {"n", *rest}, {"c"})


def _matmul(c: OpContext) -> Signature:
    a, b = c.in_shapes[:2]
    out = c.out_shapes[0]
    if len(a) < 2 or len(b) < 2:
        return opaque_signature(c)
    bn = axis_names(len(out) - 2)

    def batch(shp):
        off = len(out) - 2 - (len(shp) - 2)
        return [(bn[j + off],) if shp[j] == out[j + off] else () for j in range(len(shp) - 2)]

    return Signature.of(
        [[*batch(a), ("m",), ("k",)], [*batch(b), ("k",), ("n",)]], [[*[(n,) for n in bn], ("m",), ("n",)]], {"k"}
    )


def _permute(c: OpContext) -> Signature:
    r = len(c.in_shapes[0])
    names = axis_names(r)
    consts = [a for a in c.args[1:] if isinstance(a, (int, tuple, list))]
    if len(consts) == 1 and isinstance(consts[0], (tuple, list)):
        consts = list(consts[0])
    if "dims" in c.kwargs:
        consts = list(c.kwargs["dims"])
    perm = [d % r for d in consts]
    if sorted(perm) != list(range(r)):
        return opaque_signature(c)
    return Signature.of([[(n,) for n in names]], [[(names[p],) for p in perm]])


def _transpose(c: OpContext) -> Signature:
    r = len(c.in_shapes[0])
    names = axis_names(r)
    consts = [a for a in c.args[1:] if isinstance(a, int)]
    d0 = c.kwargs.get("dim0", consts[0] if consts else 0)
    d1 = c.kwargs.get("dim1", consts[1] if len(consts) > 1 else 1)
    perm = list(range(r))
    perm[d0 % r], perm[d1 % r] = perm[d1 % r], perm[d0 % r]
    return Signature.of([[(n,) for n in names]], [[(names[p],) for p in perm]])


# ---- built-in operators -------------------------------------------------------


def _numel(s) -> int:
    return math.prod(s)


define_op(
    modules=(nn.Linear,),
    targets_fn=(F.linear,),
    kind="linear",
    signature=_linear,
    flops=lambda c: 2.0 * _numel(c.out_shapes[0]) * c.in_shapes[0][-1],
    saves=lambda c: ("in0",),
    functional=lambda m: (F.linear, (), {}),
    params=("weight", "bias"),
    add_once=(2,),
)
define_op(
    modules=(nn.Embedding,),
    targets_fn=(F.embedding,),
    kind="embedding",
    signature=_embedding,
    saves=lambda c: ("in0",),
    bwd_flops_ratio=1.0,
    functional=lambda m: (F.embedding, (), {}),
    params=("weight",),
)
define_op(
    modules=(nn.LayerNorm,),
    kind="layer_norm",
    signature=_layer_norm,
    flops=lambda c: 5.0 * c.out_numel,
    saves=lambda c: ("in0",),
    bwd_flops_ratio=1.5,
    functional=lambda m: (
        lambda x, *wb, _s=tuple(m.normalized_shape), _e=m.eps: F.layer_norm(x, _s, *wb, eps=_e),
        (),
        {},
    ),
    params=("weight", "bias"),
)
define_op(
    targets_fn=(F.layer_norm,),
    kind="layer_norm_fn",
    signature=_layer_norm,
    flops=lambda c: 5.0 * c.out_numel,
    saves=lambda c: ("in0",),
    bwd_flops_ratio=1.5,
)

_unary_saves = lambda c: ("in0",)
define_op(
    targets_fn=(F.gelu, torch.tanh, F.relu, F.silu, torch.sigmoid),
    methods=("tanh", "relu", "sigmoid"),
    modules=(nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh),
    kind="activation",
    signature=elementwise_signature,
    flops=lambda c: 8.0 * c.out_numel,
    saves=_unary_saves,
    bwd_flops_ratio=1.0,
    functional=lambda m: (m.forward, (), {}),
)
_dropout_p = lambda c: c.module.p if c.module is not None else c.kwargs.get("p", 0.5)  # noqa: E731
define_op(
    targets_fn=(F.dropout,),
    modules=(nn.Dropout,),
    kind="dropout",
    signature=elementwise_signature,
    flops=lambda c: float(c.out_numel) if _dropout_p(c) > 0 else 0.0,  # p = 0 returns its input: no kernel
    saves=lambda c: ("out0",) if _dropout_p(c) > 0 else (),
    bwd_flops_ratio=1.0,
    functional=lambda m: (m.forward, (), {}),
)
define_op(
    targets_fn=(_op.add, torch.add, _op.sub, torch.sub),
    methods=("add", "sub"),
    kind="add",
    signature=elementwise_signature,
    flops=lambda c: float(c.out_numel),
    bwd_flops_ratio=0.5,
)
define_op(
    targets_fn=(_op.mul, torch.mul, _op.truediv, torch.div),
    methods=("mul", "div"),
    kind="mul",
    signature=elementwise_signature,
    flops=lambda c: float(c.out_numel),
    saves=lambda c: tuple(f"in{i}" for i in range(len(c.in_shapes))),
    bwd_flops_ratio=1.0,
)
define_op(
    methods=("contiguous", "float", "to", "type_as", "clone"),
    targets_fn=(torch.clone,),
    kind="copy",
    signature=elementwise_signature,
    bwd_flops_ratio=0.5,
)
define_op(
    targets_fn=(F.softmax, torch.softmax),
    methods=("softmax",),
    kind="softmax",
    signature=lambda c: elementwise_signature(c, (_softmax_dim(c),)),
    flops=lambda c: 5.0 * c.out_numel,
    saves=lambda c: ("out0",),
    bwd_flops_ratio=1.0,
)
define_op(
    targets_fn=(F.scaled_dot_product_attention,),
    kind="attention",
    signature=_sdpa,
    flops=lambda c: (
        2.0 * _numel(c.in_shapes[0]) * c.in_shapes[1][-2] + 2.0 * _numel(c.out_shapes[0]) * c.in_shapes[1][-2]
    ),
    saves=lambda c: ("in0", "in1", "in2", "out0"),
    bwd_flops_ratio=2.5,
)
define_op(
    targets_fn=(F.cross_entropy,),
    kind="cross_entropy",
    signature=_cross_entropy,
    flops=lambda c: 4.0 * _numel(c.in_shapes[0]),
    saves=lambda c: ("in0", "in1"),
    bwd_flops_ratio=1.0,
)
define_op(
    targets_fn=(torch.matmul, _op.matmul, torch.bmm),
    methods=("matmul", "bmm"),
    kind="matmul",
    signature=_matmul,
    flops=lambda c: 2.0 * _numel(c.out_shapes[0]) * c.in_shapes[0][-1],
    saves=lambda c: ("in0", "in1"),
)
define_op(
    targets_fn=(torch.reshape, torch.flatten, torch.unflatten),
    methods=("view", "reshape", "flatten", "unflatten"),
    kind="reshape",
    signature=reshape_signature,
    bwd_flops_ratio=0.0,
    view=True,
)
define_op(targets_fn=(torch.permute,), methods=("permute",), kind="permute", signature=_permute, bwd_flops_ratio=0.0)
define_op(
    targets_fn=(torch.transpose,), methods=("transpose",), kind="transpose", signature=_transpose, bwd_flops_ratio=0.0
)


# ---- LLaMA operators: RMSNorm, slicing, negation, concatenation, GQA repeats ------


def _rms_norm(c: OpContext) -> Signature:
    """Like layer norm: the normalized trailing axes stay whole, the leading ones split."""
    ns = (
        c.module.normalized_shape
        if c.module is not None
        else c.kwargs.get("normalized_shape", c.args[1] if len(c.args) > 1 else None)
    )
    k = 1 if isinstance(ns, int) else len(ns) if isinstance(ns, (tuple, list)) else 1
    r = len(c.in_shapes[0])
    b = axis_names(r - k)
    h = [f"h{i}" for i in range(k)]
    xs = [*[(n,) for n in b], *[(n,) for n in h]]
    return Signature.of([xs] + [[(n,) for n in h] for _ in c.in_shapes[1:]], [xs], (), set(h))


def _cat(c: OpContext) -> Signature:
    """``torch.cat(tensors, dim)``: the joined axis is whole (a new dimension per tensor), the
    other axes are shared. Each distinct input tensor appears once (``cat((x, x))`` has one)."""
    dim = c.kwargs.get("dim", c.args[1] if len(c.args) > 1 and isinstance(c.args[1], int) else 0)
    r = len(c.out_shapes[0])
    if r == 0 or any(len(s) != r for s in c.in_shapes):
        return opaque_signature(c)
    d = dim % r
    names = axis_names(r)

    def axes(tag: str):
        return [(f"c{tag}",) if a == d else (names[a],) for a in range(r)]

    return Signature.of([axes(str(t)) for t in range(len(c.in_shapes))], [axes("out")])


def _repeat_interleave(c: OpContext) -> Signature:
    """``x.repeat_interleave(r, dim)`` with an int ``r``: output axis ``dim`` is the group
    ``(a r)``, so splitting ``a`` (e.g. key/value heads) splits the repeated axis (query heads)
    into matching contiguous pieces."""
    rep = c.kwargs.get("repeats", c.args[1] if len(c.args) > 1 else None)
    dim = c.kwargs.get("dim", c.args[2] if len(c.args) > 2 else None)
    if len(c.in_shapes) != 1 or not isinstance(rep, int) or not isinstance(dim, int):
        return opaque_signature(c)
    r = len(c.in_shapes[0])
    names = axis_names(r)
    d = dim % r
    outs = [(n,) for n in names]
    outs[d] = (names[d], "rep")
    return Signature.of([[(n,) for n in names]], [outs])


def _expand(c: OpContext) -> Signature:
    """``x.expand(*sizes)``: input axes aligned right; an axis that keeps its size keeps its
    name, a broadcast (size-1) or new leading axis is a new whole dimension."""
    x, out = c.in_shapes[0], c.out_shapes[0]
    off = len(out) - len(x)
    names = axis_names(len(out))
    ins = [(names[j + off],) if s == out[j + off] else () for j, s in enumerate(x)]
    outs = [(n,) if a >= off and x[a - off] == out[a] else (f"e{a}",) for a, n in enumerate(names)]
    return Signature.of([ins], [outs])


define_op(
    modules=(nn.RMSNorm,),
    kind="rms_norm",
    signature=_rms_norm,
    flops=lambda c: 4.0 * c.out_numel,
    saves=lambda c: ("in0",),
    bwd_flops_ratio=1.5,
    functional=lambda m: (lambda x, *w, _s=tuple(m.normalized_shape), _e=m.eps: F.rms_norm(x, _s, *w, eps=_e), (), {}),
    params=("weight",),
)
define_op(
    targets_fn=(F.rms_norm,),
    kind="rms_norm_fn",
    signature=_rms_norm,
    flops=lambda c: 4.0 * c.out_numel,
    saves=lambda c: ("in0",),
    bwd_flops_ratio=1.5,
)
define_op(targets_fn=(_op.getitem,), kind="getitem", signature=getitem_signature, bwd_flops_ratio=0.0)
define_op(
    targets_fn=(_op.neg, torch.neg),
    methods=("neg",),
    kind="neg",
    signature=elementwise_signature,
    flops=lambda c: float(c.out_numel),
    bwd_flops_ratio=0.5,
)
define_op(targets_fn=(torch.cat, torch.concat, torch.concatenate), kind="cat", signature=_cat, bwd_flops_ratio=0.0)
define_op(
    targets_fn=(torch.repeat_interleave,),
    methods=("repeat_interleave",),
    kind="repeat_interleave",
    signature=_repeat_interleave,
    bwd_flops_ratio=0.5,
)
define_op(
    targets_fn=(torch.unsqueeze, torch.squeeze),
    methods=("unsqueeze", "squeeze"),
    kind="reshape",
    signature=reshape_signature,
    bwd_flops_ratio=0.0,
    view=True,
)
# a piece runs as an expand to the piece's own output shape (the call's sizes are the whole tensor's)
define_op(methods=("expand",), kind="expand", signature=_expand, bwd_flops_ratio=0.5)
