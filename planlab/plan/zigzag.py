"""The zigzag layout of a plan's sequence (``Plan.zigzag``: Megatron-Core's and Llama 3's causal load
balancing for ring attention): which label the sequence carries, into how many chunks the inputs'
sequences are cut, and the order each load permutes its source into (:class:`Zigzag`).

The permutation is exact for every operator but a ring attention when each treats the positions of
the sequence alike: computes each position alone (a dimension it can split) or sums over them (a
reduction: the loss's mean, a contraction). An operator that keeps the sequence whole for any other
reason (a convolution, a causal attention not run as a ring, a cumulative sum) would see the tokens
out of order, so such a plan is refused, naming the operator.
"""

from __future__ import annotations

from dataclasses import dataclass

from planlab.errors import InfeasiblePlan
from planlab.graph.ir import Graph
from planlab.plan.plan import RING_DIM, RING_KV_DIM, Plan
from planlab.plan.program import Zigzag


# where the sequence is along a tensor's axis: the index of the sequence among the axis' components
# and the components' sizes ((size,) for an axis that is the sequence alone; (batch, seq) flattened)
Mark = tuple[int, tuple[int, ...]]


@dataclass(frozen=True)
class SequenceZigzag:
    """Each source's axis along the sequence and the number of chunks (twice the rings' size) the
    tokens are cut into."""

    axes: tuple[tuple[str, int], ...]
    chunks: int

    def order(self, tensor: str) -> Zigzag | None:
        """The permutation a load of source ``tensor`` applies (None: it carries no sequence)."""
        axis = dict(self.axes).get(tensor)
        return None if axis is None else Zigzag(axis, self.chunks)


def sequence_marks(graph: Graph, label: str) -> dict[tuple[str, int], Mark]:
    """Every tensor axis that carries the sequence (whose axes carry graph label ``label``), followed
    through the operators to a fixed point: an operator's dimension that is the sequence on one tensor
    is on its others, and a flattened axis (the loss's ``batch x seq`` tokens) carries it as the
    same component on every tensor that axis meets, back to the labels' tensor (the targets)."""
    marks: dict[tuple[str, int], Mark] = {}
    for t, spec in graph.tensors.items():
        for a, n in enumerate(spec.shape):
            if graph.labels.get((t, a)) == label:
                marks[(t, a)] = (0, (n,))
    changed = True
    while changed:
        changed = False
        for op in graph.operators:
            seq, carried = _op_sequence(op, marks)
            for t in op.inputs + op.outputs:
                for a, ax in enumerate(op.axes_of(t)):
                    if not ax or (t, a) in marks:
                        continue
                    mark = carried.get(ax[0]) if len(ax) == 1 else None
                    at = next((k for k, d in enumerate(ax) if d in seq), None)
                    if mark is None and at is not None:
                        mark = (at, tuple(op.dim_sizes[d] for d in ax))
                    if mark is not None:
                        marks[(t, a)], changed = mark, True
    return marks


def _op_sequence(op, marks: dict) -> tuple[set[str], dict[str, Mark]]:
    """The dimensions of ``op`` that are the sequence, and those that carry it flattened (with its mark)."""
    seq: set[str] = set()
    carried: dict[str, Mark] = {}
    for t in op.inputs + op.outputs:
        for a, ax in enumerate(op.axes_of(t)):
            mark = marks.get((t, a))
            if mark is None or not ax:
                continue
            if len(ax) == len(mark[1]):
                seq.add(ax[mark[0]])
            elif len(ax) == 1:
                carried[ax[0]] = mark
    return seq, carried


def sequence_zigzag(plan: Plan, graph: Graph, ring_sizes: dict[str, int]) -> SequenceZigzag | None:
    """The zigzag layout of ``plan`` (None without ``plan.zigzag``), given the size of each ring
    attention's ring (the pieces its queries' sequence is split into); InfeasiblePlan, naming what
    does not fit, for a plan without a ring, rings of different sizes, or an operator the token
    permutation would change."""
    if not plan.zigzag:
        return None
    if not ring_sizes:
        raise InfeasiblePlan("zigzag: the plan runs no attention as a ring; the zigzag layout is for ring attention")
    if len(set(ring_sizes.values())) > 1:
        raise InfeasiblePlan(f"zigzag: the ring attentions have rings of different sizes {sorted(ring_sizes.items())}")
    first = graph.op(next(iter(ring_sizes)))
    q = first.inputs[0]
    axis = next(a for a, ax in enumerate(first.axes_of(q)) if ax and ax[0] == RING_DIM)
    label, chunks = graph.labels.get((q, axis)), 2 * next(iter(ring_sizes.values()))
    if label is None:
        raise InfeasiblePlan(
            f"zigzag: the sequence of {first.name!r}'s queries has no label to follow through the graph"
        )
    why = order_dependent(graph, label, frozenset(ring_sizes))
    if why:
        raise InfeasiblePlan(f"zigzag: {why}; choose cp_layout=contiguous")
    marks = graph.memo(("zigzag-sequence", label), lambda: sequence_marks(graph, label))
    axes = []
    for (t, a), (k, parts) in sorted(marks.items()):
        spec = graph.tensors[t]
        if spec.role not in ("input", "buffer"):
            continue
        if len(parts) > 1 or spec.shape[a] % chunks:
            raise InfeasiblePlan(
                f"zigzag: axis {a} of {spec.role} {t!r} ({spec.shape[a]} positions) does not cut into {chunks} "
                "chunks (2 cp) of the sequence; choose cp so that 2 cp divides the sequence, or cp_layout=contiguous"
            )
        axes.append((t, a))
    return SequenceZigzag(tuple(axes), chunks)


def order_dependent(graph: Graph, label: str, rings: frozenset[str]) -> str | None:
    """Why the zigzag order would change what the graph computes: the first operator other than the
    ``rings`` that keeps a dimension along the sequence (graph label ``label``) whole, named with that
    dimension (None: every other operator treats the positions alike)."""
    return graph.memo(("zigzag-order-dependent", label, rings), lambda: _order_dependent(graph, label, rings))


def _order_dependent(graph: Graph, label: str, rings: frozenset[str]) -> str | None:
    marks = graph.memo(("zigzag-sequence", label), lambda: sequence_marks(graph, label))
    for op in graph.operators:
        seq, carried = _op_sequence(op, marks)
        ring = {RING_DIM, RING_KV_DIM} if op.name in rings else set()
        whole = sorted((seq | set(carried)) & op.signature.frozen - ring)
        if whole:
            return (
                f"operator {op.name!r} ({op.kind}) keeps the sequence whole ({whole[0]!r} of {op.signature}), "
                "so it would see the tokens out of order"
            )
    return None
