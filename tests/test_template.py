"""Structural templates (planlab/plan/template.py): a build that maps repeated blocks from their
first (forward) or last (backward) instance makes the Program a build of every operator makes, and
the comparison catches a mapping that is wrong."""

import pytest
import torch

import planlab

from planlab.errors import InfeasiblePlan
from planlab.plan import template
from planlab.plan.buffer import Buffer, BufferKind
from planlab.plan.materialize import SHARED_MEMO_KEY, materialize
from planlab.plan.passes import draft
from planlab.search_spaces import Context, get_space

from conftest import traced

CASES = [
    # AlphaFold2's trunk, 4 blocks, 2 recycling passes (the first without a backward), on 2 stages
    ("evoformer-tiny", (("blocks", 4), ("recycles", 2)), "3f1b", dict(pp=2, dp=1, tp=1, microbatch=1), 4),
    # a GPT's 6 layers split by tensor parallelism over 2 stages
    ("gpt-tiny", (("layers", 6),), "megatron", dict(pp=2, dp=1, tp=2, microbatch=2), 8),
]


def _plan(name, args, space, knobs, batch):
    spec, g = traced(name, batch, args)
    n = knobs["pp"] * knobs["dp"] * knobs["tp"]
    ctx = Context(g, spec, batch, "cpu", n, n, 1)
    return get_space(space).build(ctx, knobs), g


def _build(plan, g):
    """materialize, without the draft the graph keeps from the last build (shared_passes)."""
    g.memo(SHARED_MEMO_KEY, lambda: [None])[0] = None
    return materialize(plan, g)


def _untemplated(monkeypatch, plan, g):
    with monkeypatch.context() as m:
        m.setattr(template, "block_runs", lambda graph: ())
        return _build(plan, g)


@pytest.mark.parametrize("name,args,space,knobs,batch", CASES)
def test_a_templated_build_is_the_untemplated_one(monkeypatch, name, args, space, knobs, batch):
    plan, g = _plan(name, args, space, knobs, batch)
    from planlab.plan.passes.layouts import Layouts

    repeats = template.block_map(g, Layouts(plan, g))
    assert repeats.groups and repeats.of_op  # the template is used
    assert _build(plan, g) == _untemplated(monkeypatch, plan, g)


def test_a_mapping_that_ignores_placement_changes_the_program(monkeypatch):
    """Blocks of one structure on two stages grouped together (the placement check left out): the
    later stage's blocks take the first stage's devices, which the build refuses (a stage's schedule
    misses actions) or the comparison sees."""
    plan, g = _plan(*CASES[0])
    runs = template.block_runs(g)

    def by_structure_only(graph, layouts):
        groups: dict[int, list[int]] = {}
        for run in runs:
            groups.setdefault(run.structure, []).append(run.start)
        kept = [tuple(starts) for starts in groups.values() if len(starts) > 1]
        of_op = {
            start + k: (gi, k)
            for gi, starts in enumerate(kept)
            for start in starts
            for k in range(next(r.length for r in runs if r.start == start))
        }
        return template.BlockMap(tuple(kept), of_op)

    right = _build(plan, g)
    with monkeypatch.context() as m:
        m.setattr(draft, "block_map", by_structure_only)
        try:
            wrong = _build(plan, g)
        except InfeasiblePlan:
            wrong = None
    assert wrong != right
    assert right == _untemplated(monkeypatch, plan, g)


def test_places_rename_place_by_place_and_refuse_a_buffer_elsewhere():
    a, b, c = (Buffer(BufferKind.ACTIVATION, t) for t in "abc")
    x, y = Buffer(BufferKind.ACTIVATION, "x"), Buffer(BufferKind.ACTIVATION, "y")
    mask = Buffer(BufferKind.INTERNAL, "op1:mask")
    places = template.Places.of((b, mask), (a, b), "op1")
    assert places.take((x, y), "op2") == (y, Buffer(BufferKind.INTERNAL, "op2:mask"))
    assert template.Places.of((c,), (a, b), "op1") is None  # another operator's buffer
    assert template.Places.of((Buffer(BufferKind.INTERNAL, "op9:mask"),), (a, b), "op1") is None
    assert template.distinct((x, y)) and not template.distinct((x, x))


def _forms_per_operator(g, shapes):
    """Each operator's form keyed operator by operator at its micro-batch shapes (what ``op_forms``
    computed before it merged the graph's traced forms), numbered in order of appearance."""
    index: dict = {}
    return {
        op.name: index.setdefault(
            (
                op.kind,
                op.signature,
                *(tuple(map(shapes.get, ts)) for ts in (op.inputs, op.outputs)),
                *op.dim_sizes.items(),
            ),
            len(index),
        )
        for op in g.operators
    }


@pytest.mark.parametrize("name,args,space,knobs,batch", CASES)
def test_forms_found_from_traced_forms_are_those_keyed_per_operator(name, args, space, knobs, batch):
    from planlab.plan.passes.layouts import microbatch_shapes, op_forms, traced_forms

    _, g = _plan(name, args, space, knobs, batch)
    traced, firsts = traced_forms(g)
    assert len(firsts) < len(g.operators)  # repeated layers share forms
    for m in (1, 2, 4):
        if batch % m == 0:
            shapes = microbatch_shapes(g, m)
            assert op_forms(g, shapes) == _forms_per_operator(g, shapes)


@pytest.mark.parametrize("name,args,space,knobs,batch", CASES)
def test_runs_are_grouped_by_the_placement_their_operators_name(name, args, space, knobs, batch):
    """block_map keys an operator's dims, sizes and devices by the placement index Layouts gives
    them: the groups are those keyed by the OpPlan's fields themselves."""
    from planlab.plan.passes.layouts import Layouts

    plan, g = _plan(name, args, space, knobs, batch)
    L = Layouts(plan, g)
    found: dict = {}
    for run in template.block_runs(g):
        ops = g.operators[run.start : run.start + run.length]
        placed = tuple(
            (p.dims, p.sizes, p.devices, p.stage, p.recompute, p.ring, p.offload, L.form(op).index)
            for op in ops
            for p in (L.op_plan[op.name],)
        )
        outside = tuple(
            (L.form(prod).index, L.mesh[prod.name], prod.outputs.index(t))
            for k, j in run.outside
            for t in (g.operators[run.start + k].inputs[j],)
            for prod in (g.producer[t],)
        )
        found.setdefault((run.structure, placed, outside), []).append(run.start)
    groups = tuple(tuple(starts) for starts in found.values() if len(starts) > 1)
    assert template.block_map(g, L).groups == groups


class _TwoExps(torch.nn.Module):
    """exp of a [4, 4] input (its axis 0 the batch) and of a [4, 4] weight: one kind, signature and
    traced shape, but under micro-batches of 2 the input's exp reads [2, 4]."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4, 4))

    def forward(self, x):
        return torch.exp(x).sum() + torch.exp(self.w).sum()


def test_a_batch_axis_separates_traced_forms_of_one_shape():
    from planlab.plan.passes.layouts import microbatch_shapes, op_forms

    g = planlab.trace(_TwoExps(), (torch.ones(4, 4),))
    shapes = microbatch_shapes(g, 2)
    forms = op_forms(g, shapes)
    assert forms == _forms_per_operator(g, shapes)
    exps = [op.name for op in g.operators if op.kind == "pointwise"]
    assert len(exps) == 2 and forms[exps[0]] != forms[exps[1]]
