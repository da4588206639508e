"""The signature registry: what planlab knows about each operator kind.

An :class:`OpDef` derives an operator's dimension signature, FLOPs and saved
tensors from the shapes seen while tracing. Built-in definitions cover the
operators of a GPT decoder; :func:`register_op` adds a user's own function as a
single operator (a leaf while tracing) with a fixed signature.
"""

from __future__ import annotations

import math
import operator as _op
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from planlab.errors import GraphError
from planlab.graph.signature import Signature


@dataclass(frozen=True)
class OpContext:
    """What tracing saw of one call: tensor input/output shapes and the call's constants."""

    in_shapes: tuple[tuple[int, ...], ...]
    out_shapes: tuple[tuple[int, ...], ...]
    args: tuple  # the call's arguments, tensors replaced by TensorArg
    kwargs: dict
    module: nn.Module | None = None

    @property
    def out_numel(self) -> int:
        return sum(math.prod(s) for s in self.out_shapes)


@dataclass(frozen=True)
class OpDef:
    """How to read one kind of operator.

    ``signature`` builds the Signature from an OpContext; ``flops`` its forward
    FLOPs; ``saves`` which inputs ("in0") and outputs ("out0") its backward
    needs; ``functional`` turns a module call into ``(function, extra args)``
    so a piece can run on sliced parameters; ``view`` marks reshape-like
    operators whose piece is a reshape to the piece's own output shape;
    ``mean_dims`` names reduction dimensions averaged rather than summed.
    """

    kind: str
    signature: Callable[[OpContext], Signature]
    flops: Callable[[OpContext], float] = lambda c: 0.0
    saves: Callable[[OpContext], tuple[str, ...]] = lambda c: ()
    bwd_flops_ratio: float = 2.0
    functional: Callable[[nn.Module], tuple[Callable, tuple, dict]] | None = None
    params: tuple[str, ...] = ()
    view: bool = False
    add_once: tuple[int, ...] = ()


_BY_FUNCTION: dict[Any, OpDef] = {}
_BY_METHOD: dict[str, OpDef] = {}
_BY_MODULE: dict[type, OpDef] = {}
_USER_FUNCTIONS: list[Callable] = []


def _letters(n: int, start: int = 0) -> list[str]:
    return [f"a{i}" for i in range(start, start + n)]


def lookup(kind: str, target: Any, module: nn.Module | None = None) -> OpDef | None:
    """The OpDef for an fx node (``kind`` is the fx op), or None if unknown."""
    if kind == "call_module":
        for cls in type(module).__mro__:
            if cls in _BY_MODULE:
                return _BY_MODULE[cls]
        return None
    if kind == "call_method":
        return _BY_METHOD.get(target)
    return _BY_FUNCTION.get(target)


def user_functions() -> tuple[Callable, ...]:
    """Functions registered with :func:`register_op`; tracing keeps them as leaves."""
    return tuple(_USER_FUNCTIONS)


def register_op(
    signature: str, *, flops: Callable[..., float] | None = None, saves: tuple[str, ...] = ("in0",)
) -> Callable[[Callable], Callable]:
    """Register a user's function as one operator with a fixed signature.

    Used as a decorator::

        @planlab.register_op("b s h^, h^ -> b s h")
        def my_norm(x, w): ...

    Tracing keeps the function whole (a leaf), and search spaces may split it
    along the dimensions its signature allows. ``flops`` receives the input
    shapes and returns the forward FLOPs.
    """
    sig = Signature.parse(signature)

    def deco(fn: Callable) -> Callable:
        def sig_fn(c: OpContext) -> Signature:
            if len(c.in_shapes) != len(sig.inputs):
                raise GraphError(
                    f"{fn.__name__} was called with {len(c.in_shapes)} tensors; "
                    f"its signature {signature!r} expects {len(sig.inputs)}"
                )
            return sig

        _BY_FUNCTION[fn] = OpDef(
            kind=fn.__name__,
            signature=sig_fn,
            flops=(lambda c: float(flops(*c.in_shapes))) if flops else (lambda c: float(c.out_numel)),
            saves=lambda c: saves,
        )
        if fn not in _USER_FUNCTIONS:
            _USER_FUNCTIONS.append(fn)
        return fn

    return deco


def _reg(targets_fn=(), methods=(), modules=(), **kw) -> OpDef:
    d = OpDef(**kw)
    for t in targets_fn:
        _BY_FUNCTION[t] = d
    for m in methods:
        _BY_METHOD[m] = d
    for m in modules:
        _BY_MODULE[m] = d
    return d


# ---- signature builders -------------------------------------------------------


def _elementwise(c: OpContext, frozen_axes: tuple[int, ...] = ()) -> Signature:
    """Broadcasting elementwise: inputs aligned right against the output."""
    out = c.out_shapes[0]
    r = len(out)
    names = _letters(r)
    frozen = {names[a % r] for a in frozen_axes} if r else set()
    ins = []
    for shp in c.in_shapes:
        off = r - len(shp)
        axes = []
        for j, s in enumerate(shp):
            i = j + off
            axes.append((names[i],) if s == out[i] else ())
        ins.append(tuple(axes))
    outs = tuple(tuple((n,) for n in names) for _ in c.out_shapes)
    return Signature.of(ins, outs, (), frozen)


def _linear(c: OpContext) -> Signature:
    x = c.in_shapes[0]
    b = _letters(len(x) - 1)
    ins = [[*[(n,) for n in b], ("k",)], [("n",), ("k",)]]
    if len(c.in_shapes) > 2:
        ins.append([("n",)])
    return Signature.of(ins, [[*[(n,) for n in b], ("n",)]], {"k"})


def _embedding(c: OpContext) -> Signature:
    i = _letters(len(c.in_shapes[0]))
    # the vocabulary splits as Megatron's VocabParallelEmbedding does: each piece looks up the ids in
    # its rows (zeros elsewhere) and the pieces add up (planlab.executor.interpreter.run_piece)
    return Signature.of([[(n,) for n in i], [("v",), ("h",)]], [[*[(n,) for n in i], ("h",)]], {"v"})


def _layer_norm(c: OpContext) -> Signature:
    x = c.in_shapes[0]
    k = len(c.in_shapes[1]) if len(c.in_shapes) > 1 else 1
    b = _letters(len(x) - k)
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
    b = [(n,) for n in _letters(len(q) - 2)]
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
        return _opaque(c)
    bn = _letters(len(out) - 2)

    def batch(shp):
        off = len(out) - 2 - (len(shp) - 2)
        return [(bn[j + off],) if shp[j] == out[j + off] else () for j in range(len(shp) - 2)]

    return Signature.of(
        [[*batch(a), ("m",), ("k",)], [*batch(b), ("k",), ("n",)]], [[*[(n,) for n in bn], ("m",), ("n",)]], {"k"}
    )


def _reshape(c: OpContext) -> Signature:
    """Match input and output axes into groups of equal product."""
    src, dst = c.in_shapes[0], c.out_shapes[0]
    ins: list[tuple[str, ...]] = []
    outs: list[tuple[str, ...]] = []
    frozen: set[str] = set()
    i = j = g = 0
    while i < len(src) or j < len(dst):
        i0, j0 = i, j
        p = src[i] if i < len(src) else 1
        q = dst[j] if j < len(dst) else 1
        i += i < len(src)
        j += j < len(dst)
        while p != q:
            if p < q and i < len(src):
                p *= src[i]
                i += 1
            elif j < len(dst):
                q *= dst[j]
                j += 1
            else:
                return _opaque(c)
        # absorb trailing size-1 axes into this group
        while i < len(src) and src[i] == 1 and not (j < len(dst) and dst[j] == 1):
            i += 1
        while j < len(dst) and dst[j] == 1 and not (i < len(src) and src[i] == 1):
            j += 1
        si = [k for k in range(i0, i) if src[k] != 1]
        dj = [k for k in range(j0, j) if dst[k] != 1]
        if len(si) > 1 and len(dj) > 1:
            names_i = [f"g{g}_{k}" for k in range(len(si))]
            names_o = [f"o{g}_{k}" for k in range(len(dj))]
            frozen |= set(names_i) | set(names_o)
            it, ot = iter(names_i), iter(names_o)
            ins += [(next(it),) if src[k] != 1 else () for k in range(i0, i)]
            outs += [(next(ot),) if dst[k] != 1 else () for k in range(j0, j)]
        else:
            many = dj if len(dj) > 1 else si
            names = [f"g{g}_{k}" for k in range(len(many))] or []
            grp = tuple(names)
            if len(dj) > 1:  # one input axis split into several output axes
                ins += [grp if src[k] != 1 else () for k in range(i0, i)]
                it = iter(names)
                outs += [(next(it),) if dst[k] != 1 else () for k in range(j0, j)]
            else:  # several input axes merged into one output axis
                it = iter(names)
                ins += [(next(it),) if src[k] != 1 else () for k in range(i0, i)]
                outs += [grp if dst[k] != 1 else () for k in range(j0, j)]
        g += 1
    return Signature.of([ins], [outs], (), frozen)


def _permute(c: OpContext) -> Signature:
    r = len(c.in_shapes[0])
    names = _letters(r)
    consts = [a for a in c.args[1:] if isinstance(a, (int, tuple, list))]
    if len(consts) == 1 and isinstance(consts[0], (tuple, list)):
        consts = list(consts[0])
    if "dims" in c.kwargs:
        consts = list(c.kwargs["dims"])
    perm = [d % r for d in consts]
    if sorted(perm) != list(range(r)):
        return _opaque(c)
    return Signature.of([[(n,) for n in names]], [[(names[p],) for p in perm]])


def _transpose(c: OpContext) -> Signature:
    r = len(c.in_shapes[0])
    names = _letters(r)
    consts = [a for a in c.args[1:] if isinstance(a, int)]
    d0 = c.kwargs.get("dim0", consts[0] if consts else 0)
    d1 = c.kwargs.get("dim1", consts[1] if len(consts) > 1 else 1)
    perm = list(range(r))
    perm[d0 % r], perm[d1 % r] = perm[d1 % r], perm[d0 % r]
    return Signature.of([[(n,) for n in names]], [[(names[p],) for p in perm]])


def _opaque(c: OpContext) -> Signature:
    """Kept whole: every dimension frozen."""
    ins = [[(f"i{t}_{a}",) for a in range(len(s))] for t, s in enumerate(c.in_shapes)]
    outs = [[(f"o{t}_{a}",) for a in range(len(s))] for t, s in enumerate(c.out_shapes)]
    return Signature.of(ins, outs)


OPAQUE = OpDef(kind="opaque", signature=_opaque, flops=lambda c: float(c.out_numel), saves=lambda c: ())


# ---- built-in operators -------------------------------------------------------


def _numel(s) -> int:
    return math.prod(s)


_reg(
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
_reg(
    modules=(nn.Embedding,),
    targets_fn=(F.embedding,),
    kind="embedding",
    signature=_embedding,
    saves=lambda c: ("in0",),
    bwd_flops_ratio=1.0,
    functional=lambda m: (F.embedding, (), {}),
    params=("weight",),
)
_reg(
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
_reg(
    targets_fn=(F.layer_norm,),
    kind="layer_norm_fn",
    signature=_layer_norm,
    flops=lambda c: 5.0 * c.out_numel,
    saves=lambda c: ("in0",),
    bwd_flops_ratio=1.5,
)

_unary_saves = lambda c: ("in0",)
_reg(
    targets_fn=(F.gelu, torch.tanh, F.relu, F.silu, torch.sigmoid),
    methods=("tanh", "relu", "sigmoid"),
    modules=(nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh),
    kind="activation",
    signature=_elementwise,
    flops=lambda c: 8.0 * c.out_numel,
    saves=_unary_saves,
    bwd_flops_ratio=1.0,
    functional=lambda m: (m.forward, (), {}),
)
_dropout_p = lambda c: c.module.p if c.module is not None else c.kwargs.get("p", 0.5)  # noqa: E731
_reg(
    targets_fn=(F.dropout,),
    modules=(nn.Dropout,),
    kind="dropout",
    signature=_elementwise,
    flops=lambda c: float(c.out_numel) if _dropout_p(c) > 0 else 0.0,  # p = 0 returns its input: no kernel
    saves=lambda c: ("out0",) if _dropout_p(c) > 0 else (),
    bwd_flops_ratio=1.0,
    functional=lambda m: (m.forward, (), {}),
)
_reg(
    targets_fn=(_op.add, torch.add, _op.sub, torch.sub),
    methods=("add", "sub"),
    kind="add",
    signature=_elementwise,
    flops=lambda c: float(c.out_numel),
    bwd_flops_ratio=0.5,
)
_reg(
    targets_fn=(_op.mul, torch.mul, _op.truediv, torch.div),
    methods=("mul", "div"),
    kind="mul",
    signature=_elementwise,
    flops=lambda c: float(c.out_numel),
    saves=lambda c: tuple(f"in{i}" for i in range(len(c.in_shapes))),
    bwd_flops_ratio=1.0,
)
_reg(
    methods=("contiguous", "float", "to", "type_as", "clone"),
    targets_fn=(torch.clone,),
    kind="copy",
    signature=_elementwise,
    bwd_flops_ratio=0.5,
)
_reg(
    targets_fn=(F.softmax, torch.softmax),
    methods=("softmax",),
    kind="softmax",
    signature=lambda c: _elementwise(c, (_softmax_dim(c),)),
    flops=lambda c: 5.0 * c.out_numel,
    saves=lambda c: ("out0",),
    bwd_flops_ratio=1.0,
)
_reg(
    targets_fn=(F.scaled_dot_product_attention,),
    kind="attention",
    signature=_sdpa,
    flops=lambda c: (
        2.0 * _numel(c.in_shapes[0]) * c.in_shapes[1][-2] + 2.0 * _numel(c.out_shapes[0]) * c.in_shapes[1][-2]
    ),
    saves=lambda c: ("in0", "in1", "in2", "out0"),
    bwd_flops_ratio=2.5,
)
_reg(
    targets_fn=(F.cross_entropy,),
    kind="cross_entropy",
    signature=_cross_entropy,
    flops=lambda c: 4.0 * _numel(c.in_shapes[0]),
    saves=lambda c: ("in0", "in1"),
    bwd_flops_ratio=1.0,
)
_reg(
    targets_fn=(torch.matmul, _op.matmul, torch.bmm),
    methods=("matmul", "bmm"),
    kind="matmul",
    signature=_matmul,
    flops=lambda c: 2.0 * _numel(c.out_shapes[0]) * c.in_shapes[0][-1],
    saves=lambda c: ("in0", "in1"),
)
_reg(
    targets_fn=(torch.reshape, torch.flatten, torch.unflatten),
    methods=("view", "reshape", "flatten", "unflatten"),
    kind="reshape",
    signature=_reshape,
    bwd_flops_ratio=0.0,
    view=True,
)
_reg(targets_fn=(torch.permute,), methods=("permute",), kind="permute", signature=_permute, bwd_flops_ratio=0.0)
_reg(targets_fn=(torch.transpose,), methods=("transpose",), kind="transpose", signature=_transpose, bwd_flops_ratio=0.0)


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
    b = _letters(r - k)
    h = [f"h{i}" for i in range(k)]
    xs = [*[(n,) for n in b], *[(n,) for n in h]]
    return Signature.of([xs] + [[(n,) for n in h] for _ in c.in_shapes[1:]], [xs], (), set(h))


def _getitem(c: OpContext) -> Signature:
    """Basic indexing ``x[...]`` by ints, slices, None and one Ellipsis. A full slice keeps its
    axis's name; any other slice makes the axis a new whole dimension; an int removes the axis
    (kept whole); None adds a size-1 axis. Anything else (tensor indices) is kept whole."""
    idx = c.args[1] if len(c.args) > 1 else None
    idx = idx if isinstance(idx, tuple) else (idx,)
    basic = all(
        i is None or i is Ellipsis or isinstance(i, slice) or (isinstance(i, int) and not isinstance(i, bool))
        for i in idx
    )
    if len(c.in_shapes) != 1 or not basic or sum(i is Ellipsis for i in idx) > 1:
        return _opaque(c)
    r = len(c.in_shapes[0])
    real = sum(1 for i in idx if i is not None and i is not Ellipsis)
    if real > r:
        return _opaque(c)
    fill = (slice(None),) * (r - real)
    idx = tuple(x for i in idx for x in (fill if i is Ellipsis else (i,))) + (() if Ellipsis in idx else fill)
    names = _letters(r)
    ins: list[tuple[str, ...]] = [(n,) for n in names]
    outs: list[tuple[str, ...]] = []
    a = 0
    for i in idx:
        if i is None:
            outs.append(())
            continue
        if isinstance(i, int):
            ins[a] = (f"x{a}",)  # vanishes from the output: kept whole
        elif i == slice(None):
            outs.append((names[a],))
        else:
            ins[a] = (f"x{a}",)
            outs.append((f"y{a}",))  # a new dimension: kept whole on both sides
        a += 1
    return Signature.of([ins], [outs])


def _cat(c: OpContext) -> Signature:
    """``torch.cat(tensors, dim)``: the joined axis is whole (a new dimension per tensor), the
    other axes are shared. Each distinct input tensor appears once (``cat((x, x))`` has one)."""
    dim = c.kwargs.get("dim", c.args[1] if len(c.args) > 1 and isinstance(c.args[1], int) else 0)
    r = len(c.out_shapes[0])
    if r == 0 or any(len(s) != r for s in c.in_shapes):
        return _opaque(c)
    d = dim % r
    names = _letters(r)

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
        return _opaque(c)
    r = len(c.in_shapes[0])
    names = _letters(r)
    d = dim % r
    outs = [(n,) for n in names]
    outs[d] = (names[d], "rep")
    return Signature.of([[(n,) for n in names]], [outs])


def _expand(c: OpContext) -> Signature:
    """``x.expand(*sizes)``: input axes aligned right; an axis that keeps its size keeps its
    name, a broadcast (size-1) or new leading axis is a new whole dimension."""
    x, out = c.in_shapes[0], c.out_shapes[0]
    off = len(out) - len(x)
    names = _letters(len(out))
    ins = [(names[j + off],) if s == out[j + off] else () for j, s in enumerate(x)]
    outs = [(n,) if a >= off and x[a - off] == out[a] else (f"e{a}",) for a, n in enumerate(names)]
    return Signature.of([ins], [outs])


_reg(
    modules=(nn.RMSNorm,),
    kind="rms_norm",
    signature=_rms_norm,
    flops=lambda c: 4.0 * c.out_numel,
    saves=lambda c: ("in0",),
    bwd_flops_ratio=1.5,
    functional=lambda m: (lambda x, *w, _s=tuple(m.normalized_shape), _e=m.eps: F.rms_norm(x, _s, *w, eps=_e), (), {}),
    params=("weight",),
)
_reg(
    targets_fn=(F.rms_norm,),
    kind="rms_norm_fn",
    signature=_rms_norm,
    flops=lambda c: 4.0 * c.out_numel,
    saves=lambda c: ("in0",),
    bwd_flops_ratio=1.5,
)
_reg(targets_fn=(_op.getitem,), kind="getitem", signature=_getitem, bwd_flops_ratio=0.0)
_reg(
    targets_fn=(_op.neg, torch.neg),
    methods=("neg",),
    kind="neg",
    signature=_elementwise,
    flops=lambda c: float(c.out_numel),
    bwd_flops_ratio=0.5,
)
_reg(targets_fn=(torch.cat, torch.concat, torch.concatenate), kind="cat", signature=_cat, bwd_flops_ratio=0.0)
_reg(
    targets_fn=(torch.repeat_interleave,),
    methods=("repeat_interleave",),
    kind="repeat_interleave",
    signature=_repeat_interleave,
    bwd_flops_ratio=0.5,
)
_reg(
    targets_fn=(torch.unsqueeze, torch.squeeze),
    methods=("unsqueeze", "squeeze"),
    kind="reshape",
    signature=_reshape,
    bwd_flops_ratio=0.0,
    view=True,
)
# a piece runs as an expand to the piece's own output shape (the call's sizes are the whole tensor's)
_reg(methods=("expand",), kind="expand", signature=_expand, bwd_flops_ratio=0.5)

from planlab.graph import ops_einsum  # noqa: E402,F401  (einsum, F.sigmoid)
from planlab.graph import ops_biased_attention  # noqa: E402,F401  (attention with an additive bias: T5)
from planlab.graph import ops_vision  # noqa: E402,F401  (convolution, roll, sum/mean, adaptive pooling: Swin)
from planlab.graph import ops_routing  # noqa: E402,F401  (top-k, one-hot, gather/scatter: mixture of experts)
from planlab.graph import ops_hf  # noqa: E402,F401  (Hugging Face models: GQA attention, masks, factories, Conv1D)
