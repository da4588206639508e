"""Signatures of the operators Hugging Face ``transformers`` models use that planlab lacked.

Read with :mod:`planlab.graph.hf`, which traces HF model code on meta tensors. Covered here:

- ``Conv1D`` (GPT-2's linear layer with its weight stored ``(in, out)``): a leaf of kind
  ``linear`` with signature ``a0 a1 k+, k+ n, n -> a0 a1 n``;
- attention: ``scaled_dot_product_attention`` with grouped-query heads (``enable_gqa``: the
  query heads are the group ``(kv rep)`` of the key/value heads) and with masks that broadcast
  (their size-1 axes are literal 1s); other calls read as before;
- HF's mask and position code: constants computed while tracing (:func:`constant`), tensor
  factories (``arange``, ``zeros``, ``full``, ...) whose dimensions are whole, ``where``, ``new_zeros`` and friends, ``F.pad``, comparisons and
  logical operators, in-place writes made functional (:func:`functional_setitem`);
- elementwise math of RMSNorm, rotary embeddings, GELU variants and position buckets (``pow``,
  ``rsqrt``, ``exp``, ``log``, ``cos``, ``clamp``, ``min``/``max`` of two tensors, casts);
- ``split``/``chunk`` (fused projections), ``x[index]`` with one index tensor (an
  embedding-like gather: expert weights picked per token), ``mean``/``amax`` reductions.

Definitions another operator module has already made are left as they are (:func:`_reg_missing`).
"""

from __future__ import annotations

import dataclasses
import math
import operator as _op

import torch
import torch.nn.functional as F

from planlab.graph.ir import DETACH, TensorArg
from planlab.graph import ops_routing  # noqa: F401  (defined before this module: registry order)
from planlab.graph.opdefs import (
    BY_FUNCTION,
    BY_METHOD,
    BY_MODULE,
    OpContext,
    OpDef,
    elementwise_signature,
    getitem_signature,
    axis_names,
    opaque_signature,
    define_op,
)
from planlab.graph.signature import Signature


def _reg_missing(targets_fn=(), methods=(), modules=(), **kw) -> OpDef:
    """Like ``define_op``, for the targets, methods and modules that have no definition yet."""
    return define_op(
        targets_fn=tuple(t for t in targets_fn if t not in BY_FUNCTION),
        methods=tuple(m for m in methods if m not in BY_METHOD),
        modules=tuple(m for m in modules if m not in BY_MODULE),
        **kw,
    )


def _numel(s) -> int:
    return math.prod(s)


def _arg(c: OpContext, name: str, pos: int, default=None):
    if name in c.kwargs:
        return c.kwargs[name]
    return c.args[pos] if len(c.args) > pos else default


# ---- in-place writes, made functional ------------------------------------------------------


def functional_setitem(x: torch.Tensor, index, value) -> torch.Tensor:
    """``x[index] = value`` on a copy of ``x``: the result (``x`` is unchanged)."""
    out = x.clone()
    out[index] = value
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class Constant:
    """A tensor the traced model computed from sizes alone (positions, masks, buckets)."""

    value: torch.Tensor

    def __repr__(self) -> str:  # a valid expression: torch.fx compiles the graph's code
        return f"Constant(shape={list(self.value.shape)}, dtype={str(self.value.dtype)!r})"


def constant(c: Constant) -> torch.Tensor:
    """The constant, on the default device (meta while planlab traces)."""
    return c.value.to(torch.get_default_device())


def kept_mean(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """A mean cross-entropy as ``total / count`` (the sum over the kept targets, their number).
    A piece of it run for one of ``m`` micro-batches divides by ``count * m`` instead
    (planlab.executor.pieces.run_piece): the micro-batches' losses add up to the batch's mean
    when each keeps as many targets (HF's shifted causal-LM labels, whole-image labels)."""
    return total / count


def _setitem(c: OpContext) -> Signature:
    """``setitem(x, index, value)`` with basic indices: the axes the index takes whole are
    shared by ``x``, the value (when it is a tensor of those axes) and the result; an indexed
    axis is whole. Anything else is kept whole."""
    if not c.in_shapes:
        return opaque_signature(c)
    x = c.in_shapes[0]
    read = getitem_signature(OpContext((x,), (), (c.args[0], c.args[1]), {}))
    if any(n.startswith("i") for ax in read.inputs[0] for n in ax):  # kept whole by getitem_signature
        return opaque_signature(c)
    xs = read.inputs[0]
    view = read.outputs[0]  # the axes of x[index]
    ins = [xs]
    if len(c.in_shapes) > 1:  # a tensor value, broadcast against x[index]
        v = c.in_shapes[1]
        off = len(view) - len(v)
        if off < 0:
            return opaque_signature(c)
        ins.append([view[off + j] if view[off + j] and v[j] != 1 else () for j in range(len(v))])
    return Signature.of(ins, [xs], (), read.frozen)


# ---- signatures --------------------------------------------------------------------------


def _conv1d_linear(c: OpContext) -> Signature:
    """HF's ``Conv1D``: ``x @ W + b`` with ``W: (in, out)``."""
    b = axis_names(len(c.in_shapes[0]) - 1)
    ins = [[*[(n,) for n in b], ("k",)], [("k",), ("n",)]]
    if len(c.in_shapes) > 2:
        ins.append([("n",)])
    return Signature.of(ins, [[*[(n,) for n in b], ("n",)]], {"k"})


def _conv1d_call(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``Conv1D`` on given (possibly sliced) parameters: ``x @ weight + bias``."""
    y = torch.matmul(x, weight)  # (B, S, in) @ (in, out) -> (B, S, out)
    return y if bias is None else y + bias


def _sdpa_with_heads(previous):
    """The attention signature, extended to grouped-query heads and broadcasting masks."""

    def sig(c: OpContext) -> Signature:
        q, k, v = c.in_shapes[:3]
        gqa = bool(c.kwargs.get("enable_gqa", False)) and len(q) >= 3 and q[-3] != k[-3]
        mask = c.in_shapes[3] if len(c.in_shapes) > 3 else None
        if not gqa and (mask is None or 1 not in mask):
            return previous(c)
        b = axis_names(len(q) - 2)
        qb = [(n,) for n in b]
        kb = list(qb)
        if gqa:  # query heads: kv heads, each repeated rep times (repeat_interleave order)
            qb[-1] = (b[-1], "rep")
        causal = bool(c.kwargs.get("is_causal", False))
        frozen = {"d", "e", "t", "rep"} | ({"s"} if causal or mask is not None else set())
        ins = [[*qb, ("s",), ("d",)], [*kb, ("t",), ("d",)], [*kb, ("t",), ("e",)]]
        if mask is not None:
            full = [*qb, ("s",), ("t",)]
            sizes = [*q[:-2], q[-2], k[-2]]
            off = len(full) - len(mask)
            ins.append([full[off + j] if n == sizes[off + j] and n != 1 else () for j, n in enumerate(mask)])
        return Signature.of(ins, [[*qb, ("s",), ("e",)]], (), frozen)

    return sig


def _getitem_gather(previous):
    """``x[idx]`` with one integer index tensor on the first axis: ``v^ a1.., i.. -> i.. a1..``
    (the rows the index picks; its own axes split, as an embedding's do). Basic indexing reads
    as before."""

    def sig(c: OpContext) -> Signature:
        if (
            len(c.in_shapes) == 2
            and len(c.args) > 1
            and isinstance(c.args[1], TensorArg)
            and c.out_shapes[0] == (*c.in_shapes[1], *c.in_shapes[0][1:])
        ):
            x, idx = c.in_shapes
            i = [f"i{j}" for j in range(len(idx))]
            rest = axis_names(len(x) - 1, 1)
            return Signature.of(
                [[("v",), *[(n,) for n in rest]], [(n,) for n in i]],
                [[*[(n,) for n in i], *[(n,) for n in rest]]],
                (),
                {"v"},
            )
        return previous(c)

    return sig


def _factory(c: OpContext) -> Signature:
    """A tensor made from sizes or constants alone: its dimensions are whole."""
    return Signature.of([], [[(f"f{a}",) for a in range(len(s))] for s in c.out_shapes])


def _new_like(c: OpContext) -> Signature:
    """``x.new_zeros(size)`` and friends: a tensor of the given size, unrelated to ``x``'s axes."""
    return Signature.of(
        [[(f"x{a}",) for a in range(len(c.in_shapes[0]))]], [[(f"f{a}",) for a in range(len(c.out_shapes[0]))]]
    )


def _pad(c: OpContext) -> Signature:
    """``F.pad(x, pad)``: padded axes (the last ``len(pad) // 2``) are whole, the others shared."""
    pad = _arg(c, "pad", 1, ())
    r = len(c.in_shapes[0])
    k = len(pad) // 2
    names = axis_names(r)
    ins = [(n,) if a < r - k else (f"p{a}",) for a, n in enumerate(names)]
    outs = [(n,) if a < r - k else (f"q{a}",) for a, n in enumerate(names)]
    return Signature.of([ins], [outs])


def _split(c: OpContext) -> Signature:
    """``split(x, size, dim)`` / ``chunk(x, n, dim)``: the split axis is a new whole dimension
    per piece; the others are shared by the input and every output."""
    r = len(c.in_shapes[0])
    d = _arg(c, "dim", 2, 0) % r if r else 0
    names = axis_names(r)

    def axes(tag: str):
        return [(f"c{tag}",) if a == d else (n,) for a, n in enumerate(names)]

    return Signature.of([axes("in")], [axes(str(i)) for i in range(len(c.out_shapes))])


def _where(c: OpContext) -> Signature:
    """``torch.where(cond, x, y)``, ``torch.min(x, y)``, ...: broadcasting elementwise; a
    reduction form (one tensor, another output shape: ``torch.max(x, dim)``) is kept whole."""
    if any(len(s) > len(c.out_shapes[0]) for s in c.in_shapes) or len(c.out_shapes) > 1:
        return opaque_signature(c)
    return elementwise_signature(c)


def _reduce_kept_whole(c: OpContext) -> Signature:
    """``mean``/``amax`` over axes: the reduced axes are whole (a piece's mean or max is not a
    partial sum); the others split."""
    r = len(c.in_shapes[0])
    dims = _arg(c, "dim", 1)
    if dims is None:
        dims = tuple(range(r))
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    if not all(isinstance(d, int) for d in dims) or len(c.in_shapes) != 1:
        return opaque_signature(c)
    red = {d % r for d in dims}
    keep = bool(_arg(c, "keepdim", 2, False))
    names = axis_names(r)
    ins = [(n if a not in red else f"r{a}",) for a, n in enumerate(names)]
    outs = [(n,) if a not in red else () for a, n in enumerate(names) if keep or a not in red]
    return Signature.of([ins], [outs])


# ---- registrations ---------------------------------------------------------------------------

define_op(targets_fn=(constant,), kind="constant", signature=_factory, bwd_flops_ratio=0.0)
define_op(
    targets_fn=(functional_setitem,),
    kind="setitem",
    signature=_setitem,
    flops=lambda c: float(c.out_numel),
    bwd_flops_ratio=0.5,
)

_unary = dict(flops=lambda c: 4.0 * c.out_numel, saves=lambda c: ("in0",), bwd_flops_ratio=1.0)
_reg_missing(
    targets_fn=(
        torch.pow,
        _op.pow,
        torch.rsqrt,
        torch.sqrt,
        torch.exp,
        torch.log,
        torch.abs,
        torch.cos,
        torch.sin,
        torch.erf,
        torch.reciprocal,
        torch.clamp,
        torch.clip,
        torch.log1p,
        torch.square,
        torch.floor,
        F.gelu,
        F.silu,
        F.relu,
        F.softplus,
    ),
    methods=(
        "pow",
        "rsqrt",
        "sqrt",
        "exp",
        "log",
        "abs",
        "cos",
        "sin",
        "erf",
        "reciprocal",
        "clamp",
        "clip",
        "log1p",
        "square",
        "floor",
        "__pow__",
    ),
    kind="pointwise",
    signature=elementwise_signature,
    **_unary,
)
_reg_missing(
    targets_fn=(
        torch.minimum,
        torch.maximum,
        torch.min,
        torch.max,
        torch.where,
        torch.masked_fill,
        _op.floordiv,
        torch.floor_divide,
        _op.mod,
        torch.remainder,
        _op.and_,
        _op.or_,
        _op.invert,
        torch.logical_and,
        torch.logical_or,
        torch.logical_not,
        _op.truediv,
        torch.div,
        torch.rsub,
        _op.abs,
    ),
    methods=(
        "minimum",
        "maximum",
        "masked_fill",
        "where",
        "floor_divide",
        "remainder",
        "logical_and",
        "logical_or",
        "logical_not",
        "__and__",
        "__or__",
        "__invert__",
        "div",
        "rsub",
    ),
    kind="elementwise",
    signature=_where,
    flops=lambda c: float(c.out_numel),
    saves=lambda c: tuple(f"in{i}" for i in range(len(c.in_shapes))),
    bwd_flops_ratio=1.0,
)
_reg_missing(
    targets_fn=(torch.full_like, torch.zeros_like, torch.ones_like, torch.empty_like),
    kind="fill_like",
    signature=elementwise_signature,
    bwd_flops_ratio=0.0,
)
_reg_missing(
    methods=("bool", "long", "int", "half", "double", "bfloat16", "type", "view_as", "reshape_as", "expand_as", "to"),
    kind="copy",
    signature=elementwise_signature,
    bwd_flops_ratio=0.5,
)
# ``detach`` passes no gradient: materialize gives its input no gradient contribution (what AlphaFold2's
# recycling relies on, planlab/models/evoformer.py), so the operators feeding only a detach get no backward.
_reg_missing(
    methods=("detach",), targets_fn=(torch.detach,), kind=DETACH, signature=elementwise_signature, bwd_flops_ratio=0.0
)
_reg_missing(
    targets_fn=tuple(
        getattr(torch, n)
        for n in (
            "arange",
            "zeros",
            "ones",
            "full",
            "empty",
            "eye",
            "tensor",
            "linspace",
            "tril_indices",
            "triu_indices",
        )
    ),
    kind="factory",
    signature=_factory,
    flops=lambda c: float(c.out_numel),
    bwd_flops_ratio=0.0,
)
_reg_missing(
    methods=("new_zeros", "new_ones", "new_full", "new_empty", "new_tensor"),
    kind="factory",
    signature=_new_like,
    flops=lambda c: float(c.out_numel),
    bwd_flops_ratio=0.0,
)
# ``torch.rand`` (stochastic depth's per-sample draw): random, so its pieces draw their own elements of
# the whole draw from planlab's generator (planlab.graph.random_ops); its axes split like an elementwise output.
_reg_missing(
    targets_fn=(torch.rand, torch.rand_like),
    kind="rand",
    signature=elementwise_signature,
    flops=lambda c: float(c.out_numel),
    bwd_flops_ratio=0.0,
)
_reg_missing(targets_fn=(F.pad,), kind="pad", signature=_pad, bwd_flops_ratio=0.0)
_reg_missing(
    targets_fn=(kept_mean,),
    kind="kept_mean",
    signature=elementwise_signature,
    flops=lambda c: 1.0,
    saves=lambda c: ("in0", "in1"),
    bwd_flops_ratio=1.0,
)
_reg_missing(
    targets_fn=(torch.split, torch.chunk, torch.tensor_split),
    methods=("split", "chunk", "tensor_split"),
    kind="split",
    signature=_split,
    bwd_flops_ratio=0.0,
)
_reg_missing(
    targets_fn=(torch.mean, torch.amax, torch.amin),
    methods=("mean", "amax", "amin"),
    kind="mean",
    signature=_reduce_kept_whole,
    flops=lambda c: float(_numel(c.in_shapes[0])),
    bwd_flops_ratio=0.5,
)

# Extensions of two built-in definitions: each reads the calls it did as before.
BY_FUNCTION[F.scaled_dot_product_attention] = dataclasses.replace(
    BY_FUNCTION[F.scaled_dot_product_attention],
    signature=_sdpa_with_heads(BY_FUNCTION[F.scaled_dot_product_attention].signature),
)
BY_FUNCTION[_op.getitem] = dataclasses.replace(
    BY_FUNCTION[_op.getitem], signature=_getitem_gather(BY_FUNCTION[_op.getitem].signature)
)


def register_transformers_modules() -> None:
    """Register HF's own leaf modules (``Conv1D``); called when a transformers model is traced,
    so importing planlab does not import transformers."""
    from transformers.pytorch_utils import Conv1D

    _reg_missing(
        modules=(Conv1D,),
        kind="linear",
        signature=_conv1d_linear,
        flops=lambda c: 2.0 * _numel(c.out_shapes[0]) * c.in_shapes[0][-1],
        saves=lambda c: ("in0",),
        functional=lambda m: (_conv1d_call, (), {}),
        params=("weight", "bias"),
        add_once=(2,),
    )
