"""AlphaFold2's recycling in pipelines, and the ``3f1b`` space (nnScaler, Lin et al., OSDI 2024).

A recycling model (``--model alphafold2 --model-arg recycles=3``, :mod:`planlab.models.evoformer`)
runs its trunk R times per example with the same weights; the outputs of each pass reach the next
through ``detach``, so passes 0..R-2 need no backward. A pipeline stages pass r's layers as stage
``r * pp + layer // (layers / pp)`` on device group ``layer // (layers / pp)``: the passes are model
chunks, as virtual stages are in interleaved 1F1B. With one stage per device group instead, 1F1B would
deadlock (the first stage's pass-1 forward waits for the last stage's pass-0 output).

Every pipelined space handles such a model: ``pp`` (and ``megatron``) run the plain schedule
(:func:`planlab.search_spaces.schedules.recycled`: the no-grad passes as whole forward sweeps, then the
last pass with the chosen schedule), so the hand-made baseline pays the recycling forwards too; ``3f1b``
interleaves them (:func:`planlab.search_spaces.schedules.three_f_one_b`).
"""

from __future__ import annotations

from planlab.graph.ir import DETACH, Graph
from planlab.plan.plan import Action
from planlab.search_spaces.builtin import DataParallel, Recompute, TensorParallel, divisors, stages_by_layer
from planlab.search_spaces.registry import register_space
from planlab.search_spaces.schedules import SCHEDULES, recycled, three_f_one_b
from planlab.search_spaces.space import Constraint, Context, Draft, Knob, Product, Space

_PASSES: dict[int, tuple[Graph, dict[str, int]]] = {}


def passes_of(g: Graph) -> dict[str, int]:
    """Per operator (cached per graph), the recycling pass it belongs to: the number of ``detach``
    operators on the longest path to it from the inputs, or, if later, the earliest pass that uses
    it (pass r's embedding of the features is in pass r; a ``detach`` stays in the pass it ends).
    All 0 for a model without recycling."""
    hit = _PASSES.get(id(g))
    if hit is not None and hit[0] is g:
        return hit[1]
    out: dict[str, int] = {}
    for op in g.operators:  # the detaches on the longest path from the inputs
        out[op.name] = max(
            (out[g.producer[t].name] + (g.producer[t].kind == DETACH) for t in op.inputs if t in g.producer), default=0
        )
    for op in reversed(g.operators):  # computed where first needed: a later pass's embedding is in that pass
        cons = [out[c.name] for t in op.outputs for c in g.consumers.get(t, [])]
        if op.kind != DETACH and cons:
            out[op.name] = max(out[op.name], min(cons))
    _PASSES.clear()
    _PASSES[id(g)] = (g, out)
    return out


_NUM: dict[int, tuple[Graph, int]] = {}


def num_passes(g: Graph) -> int:
    """The recycling passes of a traced model (1 without recycling; cached per graph)."""
    hit = _NUM.get(id(g))
    if hit is None or hit[0] is not g:
        n = max(passes_of(g).values()) + 1 if any(op.kind == DETACH for op in g.operators) else 1
        _NUM.clear()
        hit = _NUM[id(g)] = (g, n)
    return hit[1]


def recycling_stages(g: Graph, pp: int, layers: int) -> dict[str, int]:
    """Stage ``pass * pp + layer // (layers / pp)`` for the layers; other operators follow their
    computed inputs, except that a ``detach`` output counts as none (the next pass's recycling
    embedder runs where that pass starts), else their first consumer."""
    return stages_by_layer(g, pp, layers, passes_of(g))


def recycling_actions(schedule: str, rank: int, ranks: int, microbatches: int, passes: int) -> list[Action]:
    """Device group ``rank``'s actions for a recycling model: ``3f1b``, or the plain schedule
    with ``schedule`` (1f1b, gpipe, zb-h1) for the last pass."""
    if schedule == "3f1b":
        return three_f_one_b(rank, ranks, microbatches, passes)
    return recycled(rank, ranks, microbatches, passes, SCHEDULES[schedule])


def stage_recycling(draft: Draft, pp: int, schedule: str) -> None:
    """Stage a recycling model's passes over ``pp`` device groups (a chunk per pass)."""
    g = draft.ctx.graph
    r = num_passes(g)
    draft.num_stages, draft.chunks, draft.recycles, draft.schedule = r * pp, r, r, schedule
    draft.stages = recycling_stages(g, pp, draft.ctx.layers)


def _passes(c: Context) -> int:
    return num_passes(c.graph)


class ThreeF1BPipeline(Space):
    """The layers of every recycling pass in ``pp`` stages, run with nnScaler's 3F1B schedule."""

    name = "3f1b-pp"
    order = 0
    knobs = (
        Knob.int(
            "pp",
            lambda c: tuple(d for d in divisors(c.num_devices) if d > 1 and c.layers % d == 0),
            "pipeline-parallel degree (device groups)",
            default=2,
            range="divisors above 1 of the device count that divide the layers",
        ),
    )
    constraints = (
        Constraint(
            lambda a, c: _passes(c) > 1,
            lambda a, c: (
                f"3f1b pipelines recycling passes, but the model {c.model} runs its trunk once: "
                "give it recycles > 1 (--model-arg recycles=3)"
            ),
        ),
        Constraint(
            lambda a, c: a["pp"] is None or (a["pp"] > 1 and c.num_devices % a["pp"] == 0),
            lambda a, c: f"pp={a['pp']}: 3f1b needs pp > 1 dividing the {c.num_devices} devices",
        ),
        Constraint(
            lambda a, c: a["pp"] is None or c.layers % a["pp"] == 0,
            lambda a, c: f"pp={a['pp']} does not divide the model's {c.layers} layers",
        ),
        Constraint(
            lambda a, c: (
                a["pp"] is None
                or a.get("microbatch") is None
                or a.get("dp") is None
                or (c.global_batch // (a["dp"] * a["microbatch"])) % a["pp"] == 0
            ),
            lambda a, c: (
                f"3f1b runs micro-batches in groups of pp={a['pp']}: the "
                f"{c.global_batch // (a['dp'] * a['microbatch'])} micro-batches "
                f"(global batch {c.global_batch} / dp={a['dp']} / microbatch={a['microbatch']}) "
                "do not divide by it"
            ),
        ),
    )

    def apply(self, draft: Draft, values: dict) -> None:
        stage_recycling(draft, values.get("pp") or 2, "3f1b")


class ThreeF1B(Product):
    """nnScaler's 3F1B for AlphaFold2's recycling: a pipeline of every recycling pass with the
    no-grad forwards interleaved into 1F1B, x data x tensor parallelism x recomputation."""

    def __init__(self) -> None:
        super().__init__((ThreeF1BPipeline(), DataParallel(), TensorParallel(), Recompute()), name="3f1b")


register_space("3f1b", ThreeF1B)
