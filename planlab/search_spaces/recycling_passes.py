"""The passes of a recycling model (AlphaFold2's, :mod:`planlab.search_spaces.recycling`): which pass
each operator belongs to, how many there are, and a device group's pipeline actions over them.
Neither a space nor a builtin: the spaces (``builtin``, ``space``, ``screen``, ``recycling``) read it.
"""

from __future__ import annotations

from planlab.graph.ir import DETACH, Graph
from planlab.plan.plan import Action
from planlab.search_spaces.schedules import SCHEDULES, recycled, three_f_one_b


def passes_of(g: Graph) -> dict[str, int]:
    """Per operator (cached per graph), the recycling pass it belongs to: the number of ``detach``
    operators on the longest path to it from the inputs, or, if later, the earliest pass that uses
    it (pass r's embedding of the features is in pass r; a ``detach`` stays in the pass it ends).
    All 0 for a model without recycling."""
    return g.memo(("passes_of",), lambda: _passes(g))


def _passes(g: Graph) -> dict[str, int]:
    out: dict[str, int] = {}
    for op in g.operators:  # the detaches on the longest path from the inputs
        out[op.name] = max(
            (out[g.producer[t].name] + (g.producer[t].kind == DETACH) for t in op.inputs if t in g.producer), default=0
        )
    for op in reversed(g.operators):  # computed where first needed: a later pass's embedding is in that pass
        cons = [out[c.name] for t in op.outputs for c in g.consumers.get(t, [])]
        if op.kind != DETACH and cons:
            out[op.name] = max(out[op.name], min(cons))
    return out


def num_passes(g: Graph) -> int:
    """The recycling passes of a traced model (1 without recycling; cached per graph)."""
    return g.memo(
        ("num_passes",),
        lambda: max(passes_of(g).values()) + 1 if any(op.kind == DETACH for op in g.operators) else 1,
    )


def recycling_actions(schedule: str, rank: int, ranks: int, microbatches: int, passes: int) -> list[Action]:
    """Device group ``rank``'s actions for a recycling model: ``3f1b``, or the plain schedule
    with ``schedule`` (1f1b, gpipe, zb-h1) for the last pass."""
    if schedule == "3f1b":
        return three_f_one_b(rank, ranks, microbatches, passes)
    return recycled(rank, ranks, microbatches, passes, SCHEDULES[schedule])
