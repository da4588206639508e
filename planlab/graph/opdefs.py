"""Operator definitions: the types (:class:`OpContext`, :class:`OpDef`), the tables that map a
traced call to its definition, :func:`define_op` that fills them, :func:`register_op` for a user's
own function, and the signature builders the ``ops_*`` modules share (elementwise, reshape,
indexing, kept whole).

The definitions themselves live in the ``ops_*`` modules; :mod:`planlab.graph.registry` loads them
all, in their order, and is where :func:`lookup` is asked (this module's tables hold only what
has been loaded).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch.nn as nn

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


BY_FUNCTION: dict[Any, OpDef] = {}
BY_METHOD: dict[str, OpDef] = {}
BY_MODULE: dict[type, OpDef] = {}
_USER_FUNCTIONS: list[Callable] = []


def axis_names(n: int, start: int = 0) -> list[str]:
    return [f"a{i}" for i in range(start, start + n)]


def lookup(kind: str, target: Any, module: nn.Module | None = None) -> OpDef | None:
    """The OpDef for an fx node (``kind`` is the fx op), or None if unknown."""
    if kind == "call_module":
        for cls in type(module).__mro__:
            if cls in BY_MODULE:
                return BY_MODULE[cls]
        return None
    if kind == "call_method":
        return BY_METHOD.get(target)
    return BY_FUNCTION.get(target)


def user_functions() -> tuple[Callable, ...]:
    """Functions registered with :func:`register_op`; tracing keeps them as leaves."""
    return tuple(_USER_FUNCTIONS)


def keep_whole(fn: Callable) -> None:
    """Trace ``fn`` as a leaf (one operator), as the functions given to :func:`register_op` are."""
    if fn not in _USER_FUNCTIONS:
        _USER_FUNCTIONS.append(fn)


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

        BY_FUNCTION[fn] = OpDef(
            kind=fn.__name__,
            signature=sig_fn,
            flops=(lambda c: float(flops(*c.in_shapes))) if flops else (lambda c: float(c.out_numel)),
            saves=lambda c: saves,
        )
        keep_whole(fn)
        return fn

    return deco


def define_op(targets_fn=(), methods=(), modules=(), **kw) -> OpDef:
    d = OpDef(**kw)
    for t in targets_fn:
        BY_FUNCTION[t] = d
    for m in methods:
        BY_METHOD[m] = d
    for m in modules:
        BY_MODULE[m] = d
    return d


# ---- signature builders -------------------------------------------------------


def elementwise_signature(c: OpContext, frozen_axes: tuple[int, ...] = ()) -> Signature:
    """Broadcasting elementwise: inputs aligned right against the output."""
    out = c.out_shapes[0]
    r = len(out)
    names = axis_names(r)
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


def reshape_signature(c: OpContext) -> Signature:
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
                return opaque_signature(c)
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


def opaque_signature(c: OpContext) -> Signature:
    """Kept whole: every dimension frozen."""
    ins = [[(f"i{t}_{a}",) for a in range(len(s))] for t, s in enumerate(c.in_shapes)]
    outs = [[(f"o{t}_{a}",) for a in range(len(s))] for t, s in enumerate(c.out_shapes)]
    return Signature.of(ins, outs)


OPAQUE = OpDef(kind="opaque", signature=opaque_signature, flops=lambda c: float(c.out_numel), saves=lambda c: ())


def getitem_signature(c: OpContext) -> Signature:
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
        return opaque_signature(c)
    r = len(c.in_shapes[0])
    real = sum(1 for i in idx if i is not None and i is not Ellipsis)
    if real > r:
        return opaque_signature(c)
    fill = (slice(None),) * (r - real)
    idx = tuple(x for i in idx for x in (fill if i is Ellipsis else (i,))) + (() if Ellipsis in idx else fill)
    names = axis_names(r)
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
