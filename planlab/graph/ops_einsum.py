"""Signatures for ``torch.einsum``, derived from its equation, and the sigmoid alias
``torch.nn.functional.sigmoid`` (gating).

An einsum equation already names the dimensions of its operands, so its signature is the
equation itself: a letter kept in the output is a plain dimension (its split splits every
operand that has it and the output), a letter summed away is a reduction ``+`` (its split
leaves partial sums, which add up to the whole). ``"bsic,bsjd->bijcd"`` (the outer product
of AlphaFold's outer product mean) reads ``b s+ i c, b s+ j d -> b i j c d``.

Special cases:

- An ellipsis stands for the same trailing batch dimensions in every operand and the output;
  they get names ``e0, e1, ...`` aligned right, as broadcasting aligns them.
- A letter of size 1 in one operand while another has it larger (broadcasting) is a literal
  ``1`` axis there.
- A letter repeated inside one operand (``"ii->i"``, a diagonal or trace) is kept whole:
  planlab's layouts place a dimension on one axis of a tensor, and a diagonal puts it on two,
  so one split would cut only one of them.
- The same tensor passed twice with different subscripts (``einsum("ij,jk->ik", x, x)``) or
  the sublist form (``einsum(x, [0, 1], y, [1, 2])``) cannot be written as one signature over
  distinct input tensors: the whole operator is kept whole, with a warning saying why.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F

from planlab.graph.ir import TensorArg
from planlab.graph import ops_gpt  # noqa: F401  (defined before this module: registry order)
from planlab.graph.opdefs import OpContext, elementwise_signature, opaque_signature, define_op
from planlab.graph.signature import Signature
from planlab.errors import GraphError

_ELLIPSIS = "."  # one character standing for "..." while parsing


def _kept_whole(c: OpContext, why: str) -> Signature:
    warnings.warn(f"planlab: einsum {why}; the operator is kept whole", stacklevel=2)
    return opaque_signature(c)


def _operands(c: OpContext) -> tuple[str, list] | None:
    """The equation and the operands (TensorArg slots) of an einsum call, or None if the call
    is not the ``einsum(equation, *operands)`` / ``einsum(equation, [operands])`` form."""
    args = list(c.args)
    eq = c.kwargs.get("equation", args.pop(0) if args else None)
    if not isinstance(eq, str):
        return None
    if len(args) == 1 and isinstance(args[0], (list, tuple)):
        args = list(args[0])
    return eq, args


def _parse(eq: str, ranks: list[int]) -> tuple[list[list[str]], list[str]]:
    """Per operand and for the output, the list of dimension names (letters, and ``e0..`` for
    the axes an ellipsis covers, aligned right). ``ranks`` are the operands' tensor ranks."""
    eq = eq.replace(" ", "").replace("...", _ELLIPSIS)
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        raise GraphError(f"einsum {eq!r}: {len(terms)} operand subscripts for {len(ranks)} operands")
    ell = 0
    for t, r in zip(terms, ranks):
        if _ELLIPSIS in t:
            ell = max(ell, r - (len(t) - 1))
    enames = [f"e{i}" for i in range(ell)]

    def expand(t: str, rank: int | None) -> list[str]:
        out: list[str] = []
        for ch in t:
            if ch == _ELLIPSIS:
                n = (rank - (len(t) - 1)) if rank is not None else ell
                out += enames[ell - n :]
            else:
                out.append(ch)
        return out

    ops = [expand(t, r) for t, r in zip(terms, ranks)]
    if not arrow:  # implicit output: the ellipsis, then letters seen once, in ASCII order
        letters = [ch for t in terms for ch in t if ch != _ELLIPSIS]
        rhs = (_ELLIPSIS if enames else "") + "".join(sorted(ch for ch in set(letters) if letters.count(ch) == 1))
    return ops, expand(rhs, None)


def _einsum(c: OpContext) -> Signature:
    parsed = _operands(c)
    if parsed is None:
        return _kept_whole(c, "in the sublist form (operands with lists of axis numbers) has no equation to read")
    eq, operands = parsed
    if not all(isinstance(o, TensorArg) for o in operands):
        return _kept_whole(c, f"{eq!r} has an operand that is not a tensor")
    shapes = [c.in_shapes[o.index] for o in operands]
    try:
        ops, out = _parse(eq, [len(s) for s in shapes])
    except GraphError as e:
        return _kept_whole(c, f"{eq!r} could not be read ({e})")
    size: dict[str, int] = {}
    for names, shp in zip(ops, shapes):
        for n, s in zip(names, shp):
            size[n] = max(size.get(n, 1), s)
    diagonal = {n for names in ops for n in names if names.count(n) > 1}
    per_input: dict[int, list[tuple[str, ...]]] = {}
    for o, names, shp in zip(operands, ops, shapes):
        axes = [(n,) if s == size[n] else () for n, s in zip(names, shp)]  # () = broadcast 1
        if per_input.setdefault(o.index, axes) != axes:
            return _kept_whole(c, f"{eq!r} reads one tensor twice with different subscripts")
    inputs = [per_input[i] for i in range(len(c.in_shapes))]
    outputs = [[(n,) for n in out]]
    kept = set(out)
    reduce = {n for names in ops for n in names if n not in kept}
    return Signature.of(inputs, outputs, reduce, diagonal)


def _einsum_flops(c: OpContext) -> float:
    """Multiply-adds of contracting the operands left to right (what torch does without
    opt_einsum): each step costs 2 x the product of the sizes of every letter it touches and
    keeps the letters the output or a later operand still needs. One operand: a sum, one add
    per input element (0 for a pure permutation)."""
    parsed = _operands(c)
    if parsed is None or not all(isinstance(o, TensorArg) for o in parsed[1]):
        return float(c.out_numel)
    eq, operands = parsed
    shapes = [c.in_shapes[o.index] for o in operands]
    try:
        ops, out = _parse(eq, [len(s) for s in shapes])
    except GraphError:
        return float(c.out_numel)
    size: dict[str, int] = {}
    for names, shp in zip(ops, shapes):
        for n, s in zip(names, shp):
            size[n] = max(size.get(n, 1), s)
    if len(ops) == 1:
        return float(math.prod(shapes[0])) if set(ops[0]) != set(out) else 0.0
    flops = 0.0
    cur = set(ops[0])
    for k in range(1, len(ops)):
        touched = cur | set(ops[k])
        flops += 2.0 * math.prod(size[n] for n in touched)
        later = set(out).union(*[set(o) for o in ops[k + 1 :]])
        cur = touched & later
    return flops


def _einsum_saves(c: OpContext) -> tuple[str, ...]:
    """A product's backward needs every operand; a one-operand einsum (sum, permutation) none."""
    n = len(c.in_shapes)
    parsed = _operands(c)
    if parsed is not None and len(parsed[1]) == 1:
        return ()
    return tuple(f"in{i}" for i in range(n))


define_op(targets_fn=(torch.einsum,), kind="einsum", signature=_einsum, flops=_einsum_flops, saves=_einsum_saves)

# ``torch.nn.functional.sigmoid`` is its own function (torch.sigmoid is registered with the
# activations): the gate of AlphaFold's gated attention and triangle updates, elementwise.
define_op(
    targets_fn=(F.sigmoid,),
    kind="activation",
    signature=elementwise_signature,
    flops=lambda c: 8.0 * c.out_numel,
    saves=lambda c: ("in0",),
    bwd_flops_ratio=1.0,
)
