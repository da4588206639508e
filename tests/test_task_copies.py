"""Tasks made as copies: the shortcuts materialize takes at cluster scale give the tasks the long way gives.

- A piece's task copied from what the pieces at its position share (``piece_base``) equals the one
  made whole (``piece_task`` with a kind), field for field.
- One operator's own fields (``piece_fields``), made once and copied onto the bases of several positions
  (``Task.with_changes``), give each position the piece made whole; a change to that dict afterwards (a
  random operator's box at the next position) reaches no task made before.
- ``assemble`` finds the lifetimes of devices that name the same buffers in the same tasks once:
  every device's memory effects are those liveness finds for that device alone.
- ``Task.with_memory`` is ``but`` of ``alloc`` and ``free``.
"""

import pytest

from planlab.plan import FP32
from planlab.plan.buffer import activation
from planlab.plan.materialize import PASSES
from planlab.plan.passes.draft import Draft, piece_base, piece_fields, piece_task
from planlab.plan.passes.layouts import Layouts
from planlab.plan.passes.liveness import assemble, liveness
from planlab.plan.passes.order import as_blocks
from planlab.plan.program import TaskKind
from planlab.search_spaces import Context, get_space

from conftest import traced


@pytest.mark.parametrize("kind", [TaskKind.FORWARD, TaskKind.BACKWARD])
def test_a_piece_copied_from_its_base_is_the_piece_made_whole(kind):
    _, g = traced("gpt-tiny", 8)
    op = next(o for o in g.operators if o.kind == "linear")
    reads, writes = tuple(activation(t) for t in op.inputs), tuple(activation(t) for t in op.outputs)
    shared = dict(shape=(4, 8), lead=False, shapes=((4, 8), (8, 8), (4, 8)), group=(3, 5))
    own = dict(saved=reads[:1], box=((0, 4), (0, 8)))
    whole = piece_task(op, kind, 3, reads, writes, op.flops, (2, 4), **shared, **own)
    copied = piece_task(op, piece_base(kind, 3, **shared), 3, reads, writes, op.flops, (2, 4), **own)
    assert copied == whole
    assert copied.__dict__ == whole.__dict__
    assert copied.coord == 3 and copied.flops == op.flops / 2 / 4


def test_an_operators_own_fields_copied_onto_each_position_give_each_piece_made_whole():
    _, g = traced("gpt-tiny", 8)
    op = next(o for o in g.operators if o.kind == "linear")
    reads, writes = tuple(activation(t) for t in op.inputs), tuple(activation(t) for t in op.outputs)
    own = piece_fields(op, reads, writes, op.flops, (2, 4), saved=reads[:1], box=None)
    made = []
    for flat in (0, 3):
        box = ((flat, flat + 1), (0, 8))
        own["box"] = box
        made.append((flat, box, piece_base(TaskKind.FORWARD, flat, lead=flat == 0).with_changes(own)))
    for flat, box, task in made:
        whole = piece_task(op, TaskKind.FORWARD, flat, reads, writes, op.flops, (2, 4), lead=flat == 0, saved=reads[:1])
        assert task == whole.but(box=box)
        assert task.box == box and task.coord == flat


@pytest.mark.parametrize(
    "knobs",
    [
        dict(dp=4, tp=1, pp=1, microbatch=2),  # four devices alike: their lifetimes found once
        dict(dp=2, tp=1, pp=2, microbatch=2, schedule="1f1b"),  # two stages: found once for each
        dict(dp=2, tp=2, pp=1, microbatch=1, zero=3),  # ZeRO-3 frees each layer's gathered weights together
    ],
)
def test_every_devices_memory_effects_are_its_own_liveness(knobs):
    spec, g = traced("gpt-tiny", 8)
    plan = get_space("megatron").build(Context(g, spec, 8, "cpu", 4, 4, 1), knobs)
    d = Draft.start(plan, g, Layouts(plan, g), FP32, keep=None, overlap=True)
    for apply in PASSES:
        d = apply(d)
    program = assemble(d)
    for dp in program.devices:
        alone = liveness(
            as_blocks(d.blocks.get(dp.device, {})), d.sizes.get(dp.device, {}), d.together.get(dp.device, ())
        )
        assert dp.blocks == alone
        assert any(t.alloc for b in dp.blocks.values() for t in b.tasks)


def test_with_memory_is_but_of_alloc_and_free():
    _, g = traced("gpt-tiny", 8)
    op = g.operators[0]
    t = piece_task(op, TaskKind.FORWARD, 0, (), (activation(op.outputs[0]),), op.flops, (1, 1))
    alloc, free = ((activation(op.outputs[0]), 64),), (activation(op.outputs[0]),)
    assert t.with_memory(alloc, free) == t.but(alloc=alloc, free=free)
    assert t.with_memory(alloc, free).__dict__ == t.but(alloc=alloc, free=free).__dict__
    assert t.alloc == () and t.free == ()
