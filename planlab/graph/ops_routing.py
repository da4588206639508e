"""Signatures of the routing operators of mixture-of-experts layers.

Top-k selection, one-hot masks, running counts (``cumsum``), sums, comparisons, zero buffers
and the index operators that move tokens to experts and back (``gather``, ``scatter_add``,
``scatter``, ``index_select``, ``index_add``). The per-expert batched matmul
``e t h, e h f -> e t f`` needs nothing new: ``torch.matmul`` of two 3-D tensors already reads as
``a0 m k+, a0 k+ n -> a0 m n``, whose batch dimension ``a0`` is the expert (splitting it is
expert parallelism).

Indices depend on data, so a piece of an index operator is only correct when its indices stay
valid in the piece. Each signature below keeps whole ("^") the axis its indices point into;
every other axis is shared by the data, the index and the output tensors, so a piece along it
slices all of them alike and its indices, which address the kept-whole axis only, stay valid.
Index positions themselves (the rows of ``gather``'s index, of ``index_select``'s index) split
freely: each piece looks up its own rows in the whole source. Scatters keep their source rows
whole: splitting them would leave partial sums whose ``input`` term must be added once, which a
piece of ``scatter_add(input, ...)`` cannot leave out.

Generic operators other model families may also define (``sum``, comparisons, ``zeros_like``)
are registered here only where no definition exists yet (:func:`_reg_missing`), so the import
order of the operator modules cannot change a signature another module relies on.
"""

from __future__ import annotations

import math
import operator as _op

import torch
import torch.nn.functional as F

from planlab.graph import ops_vision  # noqa: F401  (defined before this module: registry order)
from planlab.graph.opdefs import (
    BY_FUNCTION,
    BY_METHOD,
    OpContext,
    OpDef,
    elementwise_signature,
    axis_names,
    opaque_signature,
    define_op,
)
from planlab.graph.signature import Signature


def _reg_missing(targets_fn=(), methods=(), **kw) -> OpDef:
    """Like ``define_op``, for the targets and methods that have no definition yet."""
    return define_op(
        targets_fn=tuple(t for t in targets_fn if t not in BY_FUNCTION),
        methods=tuple(m for m in methods if m not in BY_METHOD),
        **kw,
    )


def _arg(c: OpContext, name: str, pos: int, default=None):
    """A call's constant argument by keyword, else by position (``args[0]`` is the tensor,
    also for method calls), else ``default``."""
    if name in c.kwargs:
        return c.kwargs[name]
    return c.args[pos] if len(c.args) > pos else default


def _axis(d, rank: int) -> int | None:
    """Axis ``d`` of a tensor of ``rank`` axes as ``0 <= d < rank``; None if it is not one."""
    if not isinstance(d, int) or isinstance(d, bool) or not -rank <= d < rank:
        return None
    return d % rank


def _dim(c: OpContext, pos: int = 1, default=None) -> int | None:
    """The call's ``dim`` argument (keyword, or position ``pos``) as an axis of input 0."""
    return _axis(_arg(c, "dim", pos, default), len(c.in_shapes[0]))


def _numel(s) -> int:
    return math.prod(s)


# ---- top-k, one-hot, running counts -------------------------------------------------


def _topk(c: OpContext) -> Signature:
    """``topk(x, k, dim)``: ``a0 a1 t^ -> a0 a1 k^, a0 a1 k^`` (values, indices); the searched
    axis is whole, every other axis splits (rows are chosen independently)."""
    d = _dim(c, 2, -1)
    if d is None or len(c.in_shapes) != 1:
        return opaque_signature(c)
    names = axis_names(len(c.in_shapes[0]))
    ins = [(n,) if a != d else ("t",) for a, n in enumerate(names)]
    outs = [(n,) if a != d else ("k",) for a, n in enumerate(names)]
    return Signature.of([ins], [outs, outs])


def _one_hot(c: OpContext) -> Signature:
    """``one_hot(i, num_classes)``: ``a0 a1 -> a0 a1 c^``; a new whole class axis."""
    names = axis_names(len(c.in_shapes[0]))
    return Signature.of([[(n,) for n in names]], [[*[(n,) for n in names], ("c",)]])


def _cumsum(c: OpContext) -> Signature:
    """``cumsum(x, dim)``: elementwise with the running axis whole."""
    d = _dim(c, 1)
    return opaque_signature(c) if d is None else elementwise_signature(c, (d,))


def _sum(c: OpContext) -> Signature:
    """``sum(x, dim=None, keepdim=False)``: summed axes are reductions (a piece's sum is a
    partial sum); with ``keepdim`` they stay as literal 1 axes."""
    r = len(c.in_shapes[0])
    dims = _arg(c, "dim", 1)
    if dims is None or isinstance(dims, torch.dtype):  # sum(x) or sum(x, dtype)
        dims = tuple(range(r))
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    red = {_axis(d, r) for d in dims}
    if None in red:
        return opaque_signature(c)
    keep = bool(_arg(c, "keepdim", 2, False))
    names = axis_names(r)
    outs = [() if a in red else (n,) for a, n in enumerate(names) if keep or a not in red]
    return Signature.of([[(n,) for n in names]], [outs], {names[a] for a in red})


# ---- index operators ------------------------------------------------------------------


def _gather(c: OpContext) -> Signature:
    """``gather(x, dim, index)``: ``a0 t^ a2, a0 s a2 -> a0 s a2``. The index rows ``s`` split
    (each piece gathers its rows from the whole axis ``t``), and so do the shared axes."""
    d = _dim(c, 1)
    if d is None or len(c.in_shapes) != 2 or len(c.in_shapes[1]) != len(c.in_shapes[0]):
        return opaque_signature(c)
    x, idx = c.in_shapes
    names = axis_names(len(x))
    # an axis where the index is shorter than the data reads a prefix of it: kept whole
    ax = [("s",) if a == d else (names[a],) if idx[a] == x[a] else (f"i{a}",) for a in range(len(x))]
    xs = [("t",) if a == d else (names[a],) if idx[a] == x[a] else (f"x{a}",) for a in range(len(x))]
    short = {f"i{a}" for a in range(len(x)) if a != d and idx[a] != x[a]}
    return Signature.of([xs, ax], [ax], (), short)


def _scatter(c: OpContext) -> Signature:
    """``scatter_add(x, dim, index, src)`` (also ``scatter`` and ``scatter_reduce``, and
    ``scatter(x, dim, index, value)``): ``a0 t^ a2, a0 s^ a2, a0 s^ a2 -> a0 t^ a2``. The
    target axis and the source rows are whole; the shared axes split. The index must have the
    source's shape and the data's other axes (else kept whole)."""
    d = _dim(c, 1)
    n = len(c.in_shapes)
    if d is None or n not in (2, 3):
        return opaque_signature(c)
    x, idx = c.in_shapes[0], c.in_shapes[1]
    if len(idx) != len(x) or any(idx[a] != x[a] for a in range(len(x)) if a != d) or (n == 3 and c.in_shapes[2] != idx):
        return opaque_signature(c)
    names = axis_names(len(x))
    xs = [("t",) if a == d else (names[a],) for a in range(len(x))]
    ix = [("s",) if a == d else (names[a],) for a in range(len(x))]
    return Signature.of([xs] + [ix] * (n - 1), [xs], (), {"t", "s"})


def _index_select(c: OpContext) -> Signature:
    """``index_select(x, dim, index)`` with a 1-D index: ``a0 t^ a2, s -> a0 s a2``."""
    d = _dim(c, 1)
    if d is None or len(c.in_shapes) != 2 or len(c.in_shapes[1]) != 1:
        return opaque_signature(c)
    names = axis_names(len(c.in_shapes[0]))
    xs = [("t",) if a == d else (n,) for a, n in enumerate(names)]
    out = [("s",) if a == d else (n,) for a, n in enumerate(names)]
    return Signature.of([xs, [("s",)]], [out])


def _index_add(c: OpContext) -> Signature:
    """``index_add(x, dim, index, source)`` with a 1-D index: ``a0 t^ a2, s^, a0 s^ a2 ->
    a0 t^ a2``; the shared axes split."""
    d = _dim(c, 1)
    if d is None or len(c.in_shapes) != 3 or len(c.in_shapes[1]) != 1:
        return opaque_signature(c)
    x, src = c.in_shapes[0], c.in_shapes[2]
    if len(src) != len(x) or any(src[a] != x[a] for a in range(len(x)) if a != d):
        return opaque_signature(c)
    names = axis_names(len(x))
    xs = [("t",) if a == d else (n,) for a, n in enumerate(names)]
    ss = [("s",) if a == d else (n,) for a, n in enumerate(names)]
    return Signature.of([xs, [("s",)], ss], [xs], (), {"t", "s"})


# ---- registrations --------------------------------------------------------------------

define_op(
    targets_fn=(torch.topk,),
    methods=("topk",),
    kind="topk",
    signature=_topk,
    flops=lambda c: float(_numel(c.in_shapes[0])) * max(1, math.ceil(math.log2(max(2, c.out_shapes[0][-1])))),
    saves=lambda c: ("out1",),
    bwd_flops_ratio=0.5,
)
define_op(
    targets_fn=(F.one_hot,), kind="one_hot", signature=_one_hot, flops=lambda c: float(c.out_numel), bwd_flops_ratio=0.0
)
define_op(
    targets_fn=(torch.cumsum,),
    methods=("cumsum",),
    kind="cumsum",
    signature=_cumsum,
    flops=lambda c: float(c.out_numel),
    bwd_flops_ratio=1.0,
)


def _define_indexing(fns: tuple, methods: tuple[str, ...], kind: str, signature, counted: int | None) -> None:
    """An indexing operator: it saves its index tensor (input 1) for a backward that costs as much as
    the forward; its FLOPs are the elements of input ``counted`` (None: it moves data, no FLOPs)."""
    define_op(
        targets_fn=fns,
        methods=methods,
        kind=kind,
        signature=signature,
        flops=(lambda c: 0.0) if counted is None else (lambda c: float(_numel(c.in_shapes[counted]))),
        saves=lambda c: ("in1",),
        bwd_flops_ratio=1.0,
    )


_define_indexing((torch.gather,), ("gather",), "gather", _gather, None)
_define_indexing(
    (torch.scatter_add, torch.scatter, torch.scatter_reduce),
    ("scatter_add", "scatter", "scatter_reduce"),
    "scatter",
    _scatter,
    1,
)
_define_indexing((torch.index_select,), ("index_select",), "index_select", _index_select, None)
_define_indexing((torch.index_add,), ("index_add",), "index_add", _index_add, 2)

# generic operators, defined here unless another module has already defined them
_reg_missing(
    targets_fn=(torch.sum,),
    methods=("sum",),
    kind="sum",
    signature=_sum,
    flops=lambda c: float(_numel(c.in_shapes[0])),
    bwd_flops_ratio=0.5,
)
_reg_missing(
    targets_fn=(
        _op.lt,
        _op.le,
        _op.gt,
        _op.ge,
        _op.eq,
        _op.ne,
        torch.lt,
        torch.le,
        torch.gt,
        torch.ge,
        torch.eq,
        torch.ne,
    ),
    methods=("lt", "le", "gt", "ge", "eq", "ne"),
    kind="compare",
    signature=elementwise_signature,
    flops=lambda c: float(c.out_numel),
    bwd_flops_ratio=0.0,
)
_reg_missing(
    targets_fn=(torch.zeros_like, torch.ones_like),
    kind="fill_like",
    signature=elementwise_signature,
    bwd_flops_ratio=0.0,
)
