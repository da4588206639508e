"""A weight, or a tensor made from weights alone, broadcast over the batch (GPT's position embedding,
Swin's relative position bias, T5's relative attention bias) gets a gradient that is a partial sum
over the data-parallel ranks; it stays one until it reaches the weight, whose gradient joins the
once-a-step reduction, as PyTorch's autograd and DDP (and Megatron-LM) do: nothing is communicated
for it per micro-batch (planlab/plan/partial_grads.py)."""

import pytest
from conftest import traced

from planlab.cli import GRAD_TOL, LOSS_TOL
from planlab.costmodel import CostModel
from planlab.executor import launch_local
from planlab.plan.materialize import materialize
from planlab.plan.passes.layouts import Layouts
from planlab.plan.buffer import BufferKind
from planlab.plan.program import Role, TaskKind
from planlab.search_spaces import Context, get_space
from planlab.search_spaces.screen_structure import Ids, Tables, split_work

DP2 = dict(dp=2, tp=1, pp=1, microbatch=2)  # 2 ranks, 2 micro-batches each


def _plan(model: str, knobs: dict, n: int = 2, space: str = "megatron"):
    spec, g = traced(model, 8)
    return g, get_space(space).build(Context(g, spec, 8, "cpu", n, n, 1), knobs)


def _collectives(program, dev: int = 0) -> list:
    """The collectives ``dev`` runs in its backward blocks, but the weight-gradient buckets."""
    return [
        t
        for (stage, phase), block in program.devices[dev].blocks.items()
        if phase == "B"
        for t in block.tasks
        if t.kind is TaskKind.COLLECTIVE and t.role is not Role.BUCKET
    ]


SWIN_BIAS = {"blocks.0.attn.relative_position_bias_table"}


@pytest.mark.parametrize(
    "model, weights, space, knobs",
    [
        ("gpt-tiny", {"wpe.weight"}, "megatron", DP2),
        ("swin-tiny", SWIN_BIAS, "megatron", DP2),
        ("t5-tiny", {"blocks.0.self_attn.position_bias.relative_attention_bias.weight"}, "megatron", DP2),
        # co-located (co-sharded) attention: the bias gathers' chunks hand the partial sums on as they are
        ("swin-tiny", SWIN_BIAS, "megatron*coshard", dict(DP2, coshard=2, coshard_blocks="attention")),
    ],
)
def test_a_weight_broadcast_over_the_batch_is_reduced_once_a_step(model, weights, space, knobs):
    """Under data parallelism no collective runs in the backward but the gradient buckets (was: an
    all-reduce of the position embedding's gradient every micro-batch; under coshard, one per chunk),
    and the weight's gradient is in a bucket over the data-parallel ranks."""
    g, plan = _plan(model, knobs, space=space)
    program = materialize(plan, g)
    assert program.microbatches == 2
    assert _collectives(program) == []
    reduced = {
        (b.tensor, t.group)
        for _, t in program.devices[0].tasks_in_order()
        if t.kind is TaskKind.COLLECTIVE
        for b in t.reads
        if b.kind is BufferKind.WEIGHT_GRAD
    }
    assert {(w, (0, 1)) for w in weights} <= reduced
    L = Layouts(plan, g)
    owner = next(op for op in g.operators if any(w in op.inputs for w in weights))
    assert 0 in L.deferred[owner.name]


def test_tensor_parallel_reductions_stay_where_megatron_puts_them():
    """Only the data-parallel axes are deferred: under tp 2 the layer norms before a column-parallel
    product still all-reduce their input's gradient over tp in the backward (Megatron-LM's ``f``)."""
    g, plan = _plan("gpt-tiny", dict(dp=1, tp=2, pp=1, microbatch=8))
    L = Layouts(plan, g)
    assert L.deferred == {}
    assert any(t.collective == "all_reduce" for t in _collectives(materialize(plan, g)))


def test_the_screen_prices_no_conversion_for_the_deferred_gradient():
    """The explorer's screen follows: the position embedding's operator defers the data-parallel
    axis, its gradient needs no all-reduce, and its weight's gradient is reduced along that axis;
    the screen and the simulator agree on the plan."""
    spec, g = traced("gpt-tiny", 8)
    cost = CostModel.load("cpu", 2)
    t = Tables(g, cost.precision, cost.software)
    names = [op.name for op in g.operators]
    wpe, add = names.index("wpe"), names.index("add")
    ctx = Context(g, spec, 8, "cpu", 2, 2, 1)
    plan = get_space("megatron").build(ctx, DP2)
    dims = {p.op: p.dims for p in plan.ops}
    axis = [tuple(dims[n][0] if dims[n] else None for n in names)]
    assert axis[0][wpe] is None and axis[0][add] is not None
    ids = Ids()
    sp = split_work(t, (2,), axis, ids)
    assert [ids.values[k][0] for k in sp.cb_key] == []  # no gradient conversion at all
    reds = {int(i): ids.values[r] for i, r in zip(sp.p_op, sp.p_red)}
    assert reds[wpe] == ((0,), ())  # (shard axes, tensor-parallel axes)


def test_data_parallel_plans_match_one_process_with_the_gradient_left_partial():
    """GPT on 2 gloo ranks, 2 micro-batches each: loss and every gradient (the position
    embedding's among them, reduced only in the step's bucket) match one process."""
    g, plan = _plan("gpt-tiny", DP2)
    res = launch_local(plan, 2, steps=2, lr=1e-2)
    assert res.max_loss_error <= LOSS_TOL, (res.losses, res.ref_losses)
    assert res.max_grad_error <= GRAD_TOL
    assert res.losses[1] < res.losses[0]


def test_a_conversion_keeps_a_partial_sum_only_where_its_source_has_one():
    """Contributions that are partial sums over the data-parallel ranks are summed locally into a
    gradient that stays one (T5's bias, read by every layer); a conversion never makes a partial
    sum out of full values."""
    from planlab.errors import InternalError
    from planlab.plan.buffer import Buffer
    from planlab.plan.layout import Layout, Mesh, Partial, Replicate, Shard
    from planlab.plan.redistribute import plan_conversion

    mesh = Mesh((2, 2), (0, 1, 2, 3))
    kept = Layout(mesh, (Partial(), Shard(0)))
    bufs = dict(src_buf=Buffer(BufferKind.CONTRIBUTION, "x"), dst_buf=Buffer(BufferKind.GRAD, "x"))
    conv = plan_conversion(kept, kept, (4, 4), 4, accumulate=True, **bufs)
    tasks = [t for ts in conv.dst.values() for t in ts] + [t for ts in conv.src.values() for t in ts]
    assert len(tasks) == 4 and all(t.kind is TaskKind.LOCAL and t.accumulate for t in tasks)
    gathered = plan_conversion(kept, Layout(mesh, (Partial(), Replicate())), (4, 4), 4, **bufs)
    assert gathered.kinds == ["all_gather"]  # along the other axis only
    with pytest.raises(InternalError, match="partial"):
        plan_conversion(Layout(mesh, (Replicate(), Shard(0))), kept, (4, 4), 4, **bufs)
