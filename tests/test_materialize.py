import pytest

from planlab.errors import DeadlockError, InfeasiblePlan
from planlab.plan import FP32, Layout, Mesh, Partial, Replicate, Shard, materialize
from planlab.plan.buffer import BufferKind, activation
from planlab.plan.program import TaskKind
from planlab.plan.redistribute import plan_conversion
from planlab.search_spaces import Context, get_space
from planlab.simulator import find_deadlock

from test_plan import dp_plan

M2 = Mesh((2,), (0, 1))
M22 = Mesh((2, 2), (0, 1, 2, 3))
X, Y = activation("x"), activation("y", 0)


@pytest.mark.parametrize(
    "src, dst, kinds",
    [
        (Layout(M2, (Partial(),)), Layout(M2, (Replicate(),)), ["all_reduce"]),
        (Layout(M2, (Partial(),)), Layout(M2, (Shard(0),)), ["reduce_scatter"]),
        (Layout(M2, (Shard(1),)), Layout(M2, (Replicate(),)), ["all_gather"]),
        (Layout(M2, (Replicate(),)), Layout(M2, (Shard(0),)), ["chunk"]),
        (Layout(M2, (Shard(0),)), Layout(M2, (Shard(1),)), ["all_to_all"]),  # one shard for another
        # the batch over both axes -> the experts over the inner one (expert parallelism's dispatch)
        (Layout(M22, (Shard(0), Shard(0))), Layout(M22, (Shard(0), Shard(1))), ["all_to_all"]),
        # the inner axis does not hold neighbouring blocks of axis 0 after it: point to point
        (Layout(M22, (Shard(0), Shard(0))), Layout(M22, (Shard(1), Shard(0))), ["p2p"]),
        (Layout(M22, (Shard(0), Shard(0))), Layout(M22, (Shard(0), Replicate())), ["p2p"]),  # as before
        (Layout(M22, (Shard(0), Partial())), Layout(M22, (Shard(0), Replicate())), ["all_reduce"]),
        (Layout(M22, (Partial(), Shard(1))), Layout(M22, (Replicate(), Replicate())), ["all_reduce", "all_gather"]),
        (Layout(M2, (Shard(0),)), Layout(Mesh((2,), (2, 3)), (Shard(0),)), ["p2p"]),
        (Layout(M2, (Shard(0),)), Layout(M2, (Shard(0),)), []),
    ],
)
def test_conversion_kinds(src, dst, kinds):
    conv = plan_conversion(src, dst, (4, 6), 4, src_buf=X, dst_buf=Y)
    assert conv.kinds == kinds


@pytest.mark.parametrize(
    "layout",
    [
        Layout(Mesh((2, 3, 2), tuple(range(12))), (Shard(1), Partial(), Shard(1))),  # one axis split twice
        Layout(Mesh((3, 2), (5, 4, 3, 2, 1, 0)), (Shard(0), Shard(2))),
        Layout(M22, (Replicate(), Replicate())),
    ],
)
def test_every_position_s_box_at_once_is_each_position_s_box(layout):
    assert layout.boxes((6, 12, 4)) == [layout.box(flat, (6, 12, 4)) for flat in range(len(layout.mesh.devices))]


_CONVERSIONS = [
    (Layout(M22, (Partial(), Shard(1))), Layout(M22, (Replicate(), Replicate()))),  # two steps
    (Layout(M22, (Shard(0), Shard(0))), Layout(M22, (Shard(0), Shard(1)))),  # an all-to-all
    (Layout(M22, (Shard(0), Shard(0))), Layout(M22, (Shard(1), Shard(0)))),  # point to point
    (Layout(M2, (Partial(),)), Layout(Mesh((2,), (2, 3)), (Shard(1),))),  # partial sums, between meshes
    (Layout(M2, (Shard(0),)), Layout(M2, (Shard(0),))),  # no step: a local copy with accumulate
]


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("only", [None, frozenset({0, 3})])
@pytest.mark.parametrize("src, dst", _CONVERSIONS)
def test_a_conversion_from_the_memo_is_the_one_planned_afresh(src, dst, only, accumulate):
    """A conversion planned before (``memo``) with other buffers, name, dtype, tags, channel and
    identities gives the tasks planning it afresh with this call's gives."""
    memo: dict = {}
    first = dict(src_buf=activation("p"), dst_buf=activation("q", 1), name="dp:", dtype="float32", first_tag=3)
    first.update(channel=7, ident=2)
    plan_conversion(src, dst, (4, 6), 4, accumulate=accumulate, only=only, memo=memo, **first)
    again = dict(src_buf=X, dst_buf=Y, name="dx:", dtype="bfloat16", first_tag=40, channel=9, ident=11)
    fresh = plan_conversion(src, dst, (4, 6), 4, accumulate=accumulate, only=only, **again)
    kept = plan_conversion(src, dst, (4, 6), 4, accumulate=accumulate, only=only, memo=memo, **again)
    assert len(memo) == 1 and (fresh.src or fresh.dst or fresh.kinds == [] and not accumulate)
    assert (kept.src, kept.dst, kept.kinds, kept.tags, kept.idents) == (
        fresh.src,
        fresh.dst,
        fresh.kinds,
        fresh.tags,
        fresh.idents,
    )


def test_point_to_point_moves_each_slice_once():
    # stage boundary: (S0 over devices 0,1) -> (S0 over devices 2,3): 0 sends to 2, 1 sends to 3
    conv = plan_conversion(
        Layout(M2, (Shard(0),)), Layout(Mesh((2,), (2, 3)), (Shard(0),)), (4, 6), 4, src_buf=X, dst_buf=Y
    )
    sends = {(d, t.peer, t.nbytes) for d, ts in conv.src.items() for t in ts}
    assert sends == {(0, 2, 48), (1, 3, 48)}
    recvs = {(d, t.peer, t.region) for d, ts in conv.dst.items() for t in ts}
    assert recvs == {(2, 0, ((0, 2), (0, 6))), (3, 1, ((0, 2), (0, 6)))}


def test_partial_sums_gathered_point_to_point_accumulate():
    conv = plan_conversion(
        Layout(M2, (Partial(),)), Layout(Mesh((1,), (2,)), (Replicate(),)), (4,), 4, src_buf=X, dst_buf=Y
    )
    recvs = conv.dst[2]
    assert len(recvs) == 2 and all(t.accumulate for t in recvs)


def _ctx(g, spec, n):
    return Context(g, spec, 8, "cpu", n, n, 1)


@pytest.mark.parametrize(
    "n, knobs, collectives",
    [
        (2, dict(dp=2, tp=1, pp=1, microbatch=4), {"grad-reduce[0, 1]"}),
        (2, dict(dp=1, tp=2, pp=1, microbatch=8), {"all_reduce"}),
        (2, dict(dp=1, tp=1, pp=2, microbatch=4), set()),
    ],
)
def test_megatron_programs_have_the_expected_collectives(tiny, n, knobs, collectives):
    spec, g = tiny
    sp = get_space("megatron")
    plan = sp.build(_ctx(g, spec, n), knobs)
    prog = materialize(plan, g)
    find_deadlock(prog)
    seen = {
        t.name.split("#")[0] if t.name.startswith("grad") else t.collective
        for dp in prog.devices
        for _, t in dp.tasks_in_order()
        if t.kind is TaskKind.COLLECTIVE
    }
    assert collectives <= seen
    if knobs["pp"] == 2:
        kinds = {t.kind for _, t in prog.devices[0].tasks_in_order()}
        assert TaskKind.SEND in kinds and TaskKind.RECV in kinds
        assert [str(a) for a in prog.devices[1].schedule] == ["1F0", "1B0", "1F1", "1B1", "1U0"]
        assert [str(a) for a in prog.devices[0].schedule] == ["0F0", "0F1", "0B0", "0B1", "0U0"]


def test_memory_liveness_frees_everything_but_weights(tiny):
    spec, g = tiny
    prog = materialize(dp_plan(g, spec, micro=2), g)
    for dp in prog.devices:
        alloc = {b for blk in dp.blocks.values() for t in blk.tasks for b, _ in t.alloc}
        freed = {b for blk in dp.blocks.values() for t in blk.tasks for b in t.free}
        assert alloc == freed
        assert dp.param_bytes == sum(
            4 * (b[0][1] - b[0][0]) * (b[1][1] - b[1][0] if len(b) > 1 else 1) for _, b in dp.params
        )


def test_bad_schedule_is_refused(tiny):
    spec, g = tiny
    plan = dp_plan(g, spec, micro=2)
    import dataclasses
    from planlab.plan import Action

    bad = dataclasses.replace(plan, schedule=((Action(0, "F", 0),), (Action(0, "F", 0),)))
    with pytest.raises(InfeasiblePlan, match="misses actions"):
        materialize(bad, g)


def test_dry_run_finds_collectives_issued_in_different_orders(tiny):
    spec, g = tiny
    sp = get_space("megatron")
    prog = materialize(sp.build(_ctx(g, spec, 2), dict(dp=1, tp=2, pp=1, microbatch=8)), g)
    # device 1 runs its two collectives in swapped order
    import dataclasses

    dp1 = prog.devices[1]
    blk = dp1.blocks[(0, "F")]
    idx = [i for i, t in enumerate(blk.tasks) if t.kind is TaskKind.COLLECTIVE][:2]
    tasks = list(blk.tasks)
    tasks[idx[0]], tasks[idx[1]] = tasks[idx[1]], tasks[idx[0]]
    blocks = dict(dp1.blocks)
    blocks[(0, "F")] = dataclasses.replace(blk, tasks=tuple(tasks))
    bad = dataclasses.replace(prog, devices=(prog.devices[0], dataclasses.replace(dp1, blocks=blocks)))
    with pytest.raises(DeadlockError) as e:
        find_deadlock(bad)
    msg = str(e.value)
    assert "device 0" in msg and "device 1" in msg and "different orders" in msg
    assert ">>" in msg  # the grid marks the failing step


def test_full_recompute_trades_memory_for_time(tiny):
    from planlab.costmodel import CostModel
    from planlab.simulator import simulate

    spec, g = tiny
    ctx = _ctx(g, spec, 2)
    res = {}
    for rc in ("none", "full"):
        prog = materialize(get_space("megatron").build(ctx, dict(dp=1, tp=2, pp=1, microbatch=4, recompute=rc)), g)
        find_deadlock(prog)
        tasks = [t for _, t in prog.devices[0].tasks_in_order()]
        if rc == "full":
            redo = [t for t in tasks if t.recompute == "redo"]
            assert redo and all(t.name.startswith("re:") for t in redo)
            # the recomputed layers issue their tensor-parallel all-reduces again
            assert any(t.kind is TaskKind.COLLECTIVE and t.name.startswith("re:") for t in tasks)
        res[rc] = simulate(prog, CostModel.load("cpu", 2))
    assert res["full"].peak_mem_bytes < res["none"].peak_mem_bytes
    assert res["full"].iter_time_s > res["none"].iter_time_s
    assert res["full"].hardware_flops > res["none"].hardware_flops


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_shards_optimizer_states_and_gradients(tiny, zero):
    spec, g = tiny
    ctx = _ctx(g, spec, 2)
    base = materialize(get_space("megatron").build(ctx, dict(dp=2, tp=1, pp=1, microbatch=2)), g)
    z = materialize(get_space("megatron").build(ctx, dict(dp=2, tp=1, pp=1, microbatch=2, zero=zero)), g)
    find_deadlock(z)
    b0, z0 = base.devices[0], z.devices[0]
    assert z0.optimizer_bytes < b0.optimizer_bytes
    assert (z0.grad_bytes < b0.grad_bytes) == (zero == 2)
    kinds = [t.collective for t in z0.blocks[(0, "U")].tasks if t.kind is TaskKind.COLLECTIVE]
    assert kinds == ["reduce_scatter", "all_gather"]


def test_sequence_parallel_turns_all_reduces_into_reduce_scatter_and_all_gather(tiny):
    from collections import Counter

    spec, g = tiny
    ctx = _ctx(g, spec, 2)
    counts = {}
    for sp in (False, True):
        knobs = dict(dp=1, tp=2, pp=1, microbatch=8, sequence_parallel=sp)
        prog = materialize(get_space("megatron").build(ctx, knobs), g)
        find_deadlock(prog)
        counts[sp] = Counter(t.collective for _, t in prog.devices[0].tasks_in_order() if t.kind is TaskKind.COLLECTIVE)
    # 2 layers x (attention, MLP) x (forward, backward) all-reduces (q, k, v gradients summed locally
    # first, as Megatron's f operator does), plus the row-parallel biases' weight-gradient bucket
    assert counts[False] == Counter(all_reduce=9)
    # per layer 2 reduce-scatters and 2 all-gathers each way, an all-gather at each end of the layer
    # stack (ln_f's input forward, the embedding's gradient backward), and the weight-gradient bucket
    assert counts[True] == Counter(reduce_scatter=8, all_gather=10, all_reduce=1)


def test_a_dead_branch_gives_no_gradient_and_reads_nothing_unwritten():
    import torch
    import torch.nn as nn

    from planlab.graph import trace
    from planlab.models import ModelSpec
    from planlab.plan import PlanBuilder

    class DeadBranch(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x, y):
            h = self.a(x)
            self.b(h).sum()  # computed, never used: no gradient flows back from it
            return ((h - y) ** 2).mean()

    g = trace(DeadBranch(), (torch.randn(4, 8, device="meta"), torch.randn(4, 8, device="meta")))
    b = PlanBuilder(g, model=ModelSpec("tests:dead"), global_batch=4, cluster="cpu", nodes=1, num_devices=1)
    for op in g.operators:
        b.op_assign(op.name, (0,))
    prog = materialize(b.build(), g)
    tasks = [t for blk in prog.devices[0].blocks.values() for t in blk.tasks]
    written = {w for t in tasks for w in t.writes}
    assert (
        not {r for t in tasks for r in t.reads if r and r.kind in (BufferKind.CONTRIBUTION, BufferKind.GRAD)} - written
    )


def _products(d):
    """What a draft's passes made, copied down to the task lists (tasks are immutable)."""
    from planlab.plan.passes.draft import Draft

    out = {}
    for f in Draft.__dataclass_fields__:
        v = getattr(d, f)
        if f == "blocks":
            v = {dev: {k: list(ts) for k, ts in bl.items()} for dev, bl in v.items()}
        elif f == "sizes":
            v = {dev: dict(s) for dev, s in v.items()}
        elif isinstance(v, dict):
            v = dict(v)
        out[f] = v
    return out


@pytest.mark.parametrize(
    "space, knobs",
    [
        ("megatron", dict(dp=2, tp=1, pp=2, microbatch=1, zero=3, schedule="zb-h1", recompute="full")),
        ("megatron*coshard", dict(dp=1, tp=2, pp=2, microbatch=1, zero=0, recompute="full", coshard=2)),
        ("megatron", dict(dp=2, tp=2, pp=1, microbatch=1, zero=1)),
        ("megatron*offload", dict(dp=2, tp=2, pp=1, microbatch=1, zero=2, offload_optimizer=True)),
    ],
)
def test_each_pass_returns_a_new_draft_and_leaves_the_one_it_was_given(space, knobs):
    """materialize's passes are functions of the draft: each returns a new draft and the one it was
    given is unchanged (so a pass can be run, compared or replaced on its own)."""
    from planlab.plan.materialize import PASSES, build
    from planlab.plan.passes.draft import Draft
    from planlab.plan.passes.layouts import Layouts
    from planlab.plan.passes.liveness import assemble

    from conftest import traced

    spec, g = traced("gpt-tiny", 8)
    plan = get_space(space).build(Context(g, spec, 8, "cpu", 4, 4, 1), knobs)
    layouts = Layouts(plan, g)
    d = Draft.start(plan, g, layouts, FP32, keep=None, overlap=True)
    for apply in PASSES:
        before = _products(d)
        after = apply(d)
        assert _products(d) == before, apply.__name__
        d = after
    program = assemble(d)
    assert program == build(plan, g, layouts, FP32, None)
    assert find_deadlock(program, raise_error=False) is None


@pytest.mark.parametrize(
    "base, twins",
    [
        (dict(dp=2, tp=2, pp=1, microbatch=2, zero=1), [dict(zero=2), dict(zero=3), dict(zero=0)]),
        (
            dict(dp=2, tp=1, pp=2, microbatch=2, recompute="none"),
            [dict(recompute="selective"), dict(recompute="full", zero=1)],
        ),
    ],
)
def test_twins_share_the_first_passes_and_build_the_programs_they_build_alone(base, twins):
    """Plans that differ only by recompute and ZeRO stage share the draft of the passes before
    ``recompute`` (the first twin's draft stays in the graph's memo), and each builds the Program
    it builds after an unrelated plan."""
    from planlab.plan.materialize import SHARED_MEMO_KEY

    from conftest import traced

    spec, g = traced("gpt-tiny", 8)
    sp, ctx = get_space("megatron"), Context(g, spec, 8, "cpu", 4, 4, 1)
    other = sp.build(ctx, dict(dp=4, tp=1, pp=1, microbatch=1))
    first = materialize(sp.build(ctx, base), g)
    shared = g.memo(SHARED_MEMO_KEY, lambda: [None])[0][1]
    for twin in twins:
        plan = sp.build(ctx, {**base, **twin})
        got = materialize(plan, g)
        assert g.memo(SHARED_MEMO_KEY, lambda: [None])[0][1] is shared  # taken, not made again
        materialize(other, g)  # the memo holds another plan's draft
        alone = materialize(plan, g)
        assert got == alone and got != first
        materialize(sp.build(ctx, base), g)
        shared = g.memo(SHARED_MEMO_KEY, lambda: [None])[0][1]


@pytest.mark.parametrize(
    "model, space, knobs",
    [
        ("gpt-small", "megatron", dict(dp=1, tp=2, pp=2, microbatch=2, schedule="interleaved", virtual_stages=2)),
        (
            "gpt-tiny",
            "megatron",
            dict(dp=2, tp=2, pp=1, microbatch=2, zero=3, recompute="selective", sequence_parallel=True),
        ),
        ("gpt-tiny", "megatron*coshard", dict(dp=1, tp=2, pp=2, microbatch=1, zero=0, recompute="full", coshard=2)),
    ],
)
def test_bytes_sized_once_per_operator_are_every_pieces_bytes(model, space, knobs):
    """The passes size a piece's buffers once per operator (splits divide evenly, so every piece
    has its operator's local shapes): the sizes they record equal each device's own box, as sizing
    piece by piece gives them, and a second materialization (micro-batch shapes kept on the graph)
    gives the same Program."""
    from planlab.plan.layout import box_numel, box_shape
    from planlab.plan.passes.draft import Draft
    from planlab.plan.passes.forward import convert_inputs, forward_pieces, place_weights
    from planlab.plan.passes.layouts import Layouts, full

    from conftest import traced

    spec, g = traced(model, 8)
    plan = get_space(space).build(Context(g, spec, 8, "cpu", 4, 4, 1), knobs)
    L = Layouts(plan, g)
    d = forward_pieces(convert_inputs(place_weights(Draft.start(plan, g, L, FP32, keep=None, overlap=True))))
    checked = 0
    for op in g.operators:
        tensors = [(L.needs(op, k), t) for k, t in enumerate(op.inputs)]
        tensors += [(full(L.has(op, j)), t) for j, t in enumerate(op.outputs)]
        for lay, t in tensors + [(L.has(op, j), t) for j, t in enumerate(op.outputs)]:
            for flat in range(len(lay.mesh.devices)):
                assert box_shape(lay.box(flat, L.shapes[t])) == L.local_shape(lay, t), (op.name, t)
        for flat, dev in enumerate(L.mesh[op.name].devices):
            for j, t in enumerate(op.outputs):
                box = L.has(op, j).box(flat, L.shapes[t])
                assert d.sizes[dev][d.names.activation(t)] == box_numel(box) * d.elem_bytes(t), (op.name, dev)
                checked += 1
    assert checked >= len(g.operators)
    assert materialize(plan, g) == materialize(plan, g)


@pytest.mark.parametrize("knobs", [dict(pp=2), dict(pp=2, tp=2)])
def test_a_stage_sends_one_gradient_per_tensor_it_received(tiny, knobs):
    """A stage's input feeds both a layer norm and the residual add; autograd sums the two
    contributions on that stage and Megatron-LM's or DeepSpeed's pipeline sends the sum back: one
    gradient message per tensor the stage received (and as many bytes), not one per consumer."""
    spec, g = tiny
    n = knobs["pp"] * knobs.get("tp", 1)
    plan = get_space("megatron").build(_ctx(g, spec, n), dict(dict(dp=1, tp=1, microbatch=2), **knobs))
    prog = materialize(plan, g)
    find_deadlock(prog)
    last = prog.devices[-1]
    got = [t for t in last.blocks[(1, "F")].tasks if t.kind is TaskKind.RECV]
    sent = [t for t in last.blocks[(1, "B")].tasks if t.kind is TaskKind.SEND]
    assert got and sorted(t.nbytes for t in sent) == sorted(t.nbytes for t in got)
    assert len({t.name for t in sent}) == len(sent)
