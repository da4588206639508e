"""Operator dimension signatures, einsum-like: ``"b s k+, n k+, n -> b s n"``.

Each tensor is a list of axes; an axis is a dimension name, a group ``(n d)``
(one tensor axis that holds several dimensions, outermost first, as after a
reshape) or the literal ``1`` (a broadcast axis of size one). A name followed by
``+`` is a reduction dimension: splitting it leaves partial sums. A name
followed by ``^`` must not be split. Only the outermost name of a group can be
split, since only that split cuts the axis into contiguous pieces.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from planlab.errors import GraphError

Axis = tuple[str, ...]  # dimension names of one tensor axis, outermost first; () is a literal 1

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class Signature:
    """The dimension names of an operator's inputs and outputs.

    ``inputs``/``outputs`` hold one tuple of axes per tensor; ``reduce`` the
    reduction dimensions and ``frozen`` the dimensions that must stay whole.
    """

    inputs: tuple[tuple[Axis, ...], ...]
    outputs: tuple[tuple[Axis, ...], ...]
    reduce: frozenset[str] = frozenset()
    frozen: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, text: str) -> "Signature":
        """Parse ``"m k+, k+ n -> m n"``; raises GraphError naming the fault."""
        if text.count("->") != 1:
            raise GraphError(f"signature {text!r} must contain exactly one '->'")
        lhs, rhs = text.split("->")
        reduce: set[str] = set()
        frozen: set[str] = set()

        def name(tok: str) -> str:
            base = tok.rstrip("+^")
            if not _NAME.match(base):
                raise GraphError(f"signature {text!r}: {tok!r} is not a dimension name")
            if "+" in tok[len(base) :]:
                reduce.add(base)
            if "^" in tok[len(base) :]:
                frozen.add(base)
            return base

        def tensors(side: str) -> tuple[tuple[Axis, ...], ...]:
            side = side.strip()
            if not side:
                return ()
            out = []
            for part in side.split(","):
                axes: list[Axis] = []
                for tok in re.findall(r"\([^)]*\)|\S+", part.strip()):
                    if tok.startswith("("):
                        inner = tok[1:-1].split()
                        if not inner:
                            raise GraphError(f"signature {text!r}: empty group")
                        axes.append(tuple(name(t) for t in inner))
                    elif tok == "1":
                        axes.append(())
                    else:
                        axes.append((name(tok),))
                out.append(tuple(axes))
            return tuple(out)

        return cls.of(tensors(lhs), tensors(rhs), reduce, frozen)

    @classmethod
    def of(cls, inputs, outputs, reduce=(), frozen=()) -> "Signature":
        """Build a normalized signature: a dimension only in the outputs, or one
        that vanishes without being a reduction, is kept whole."""
        inputs = tuple(tuple(tuple(ax) for ax in t) for t in inputs)
        outputs = tuple(tuple(tuple(ax) for ax in t) for t in outputs)
        ins = {n for t in inputs for ax in t for n in ax}
        outs = {n for t in outputs for ax in t for n in ax}
        reduce = frozenset(reduce) & ins
        frozen = frozenset(frozen) | (ins - outs - reduce) | (outs - ins)
        return cls(inputs, outputs, reduce, frozen)

    def input_dims(self) -> set[str]:
        return {n for t in self.inputs for ax in t for n in ax}

    def output_dims(self) -> set[str]:
        return {n for t in self.outputs for ax in t for n in ax}

    def dims(self) -> list[str]:
        """All dimension names, in order of first appearance."""
        return list(self._dims)

    @functools.cached_property
    def _dims(self) -> tuple[str, ...]:
        seen: dict[str, None] = {}
        for t in self.inputs + self.outputs:
            for ax in t:
                for n in ax:
                    seen.setdefault(n, None)
        return tuple(seen)

    def splittable(self, dim: str) -> bool:
        """True if ``dim`` may be split: not frozen and outermost in every group."""
        return dim in self._splittable

    @functools.cached_property
    def _splittable(self) -> frozenset[str]:
        inner = {n for t in self.inputs + self.outputs for ax in t for n in ax[1:]}
        return frozenset(d for d in self._dims if d not in self.frozen and d not in inner)

    def __str__(self) -> str:
        def fmt_name(n: str) -> str:
            return n + ("+" if n in self.reduce else "") + ("^" if n in self.frozen else "")

        def fmt_axis(ax: Axis) -> str:
            if not ax:
                return "1"
            if len(ax) == 1:
                return fmt_name(ax[0])
            return "(" + " ".join(fmt_name(n) for n in ax) + ")"

        def side(ts):
            return ", ".join(" ".join(fmt_axis(a) for a in t) for t in ts)

        return f"{side(self.inputs)} -> {side(self.outputs)}"
