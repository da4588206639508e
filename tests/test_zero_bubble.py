"""Zero-bubble ZB-H1: the schedule against golden text, the bubble a third of 1F1B's in the
simulator (exact times with idealised costs), the backward split into I and W blocks, and
numerics on gloo ranks."""

import dataclasses

import pytest

from planlab.cli import GRAD_TOL, LOSS_TOL
from planlab.costmodel import CostModel
from planlab.errors import InfeasiblePlan
from planlab.executor import launch_local
from planlab.explore import memory_lower_bound_bytes
from planlab.plan.backward_split import weight_share
from planlab.plan import FP32, Action, Block, DeviceProgram, Program, Task, TaskKind, materialize
from planlab.plan.buffer import BufferKind, weight_grad
from planlab.plan.saved import fp8_cast
from planlab.plan.buffer import activation as A
from planlab.search_spaces import Context, get_space, one_f_one_b, zb_h1
from planlab.search_spaces.schedules import format_schedule, parse_schedule
from planlab.simulator import find_deadlock, simulate

from conftest import traced
from test_simulator import IdealCost

# ZB-H1 for p=4, m=8 (the paper's Figure 3): stage s defers its W passes by s micro-batches and
# runs those it still owes in the cool-down
GOLDEN = [
    "0F0 0F1 0F2 0F3 0I0 0W0 0F4 0I1 0W1 0F5 0I2 0W2 0F6 0I3 0W3 0F7 0I4 0W4 0I5 0W5 0I6 0W6 0I7 0W7",
    "1F0 1F1 1F2 1I0 1F3 1I1 1W0 1F4 1I2 1W1 1F5 1I3 1W2 1F6 1I4 1W3 1F7 1I5 1W4 1I6 1W5 1I7 1W6 1W7",
    "2F0 2F1 2I0 2F2 2I1 2F3 2I2 2W0 2F4 2I3 2W1 2F5 2I4 2W2 2F6 2I5 2W3 2F7 2I6 2W4 2I7 2W5 2W6 2W7",
    "3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3W0 3F4 3I4 3W1 3F5 3I5 3W2 3F6 3I6 3W3 3F7 3I7 3W4 3W5 3W6 3W7",
]


@pytest.mark.parametrize("stage", range(4))
def test_zb_h1_schedule_text(stage):
    text = format_schedule(zb_h1(stage, 4, 8))
    assert text == GOLDEN[stage]
    assert format_schedule(parse_schedule(text)) == text


@pytest.mark.parametrize("p, m", [(4, 8), (2, 4), (4, 2), (3, 7), (8, 8), (1, 3)])
def test_zb_h1_keeps_1f1b_memory(p, m):
    """Every action once, I after F and W after I of its micro-batch; at most p micro-batches whose
    W has not run (1F1B's p in flight), and as many until their I as 1F1B holds until their B."""
    for s in range(p):
        acts = zb_h1(s, p, m)
        assert sorted(map(str, acts)) == sorted(f"{s}{ph}{k}" for ph in "FIW" for k in range(m))
        pos = {str(a): i for i, a in enumerate(acts)}
        assert all(pos[f"{s}F{k}"] < pos[f"{s}I{k}"] < pos[f"{s}W{k}"] for k in range(m))
        assert _peak(acts, "W") == min(p, m)
        assert _peak(acts, "I") == _peak(one_f_one_b(s, p, m), "B")


def _peak(actions, done):
    cur = peak = 0
    for a in actions:
        cur += (a.phase == "F") - (a.phase == done)
        peak = max(peak, cur)
    return peak


def _pipeline(p, m, schedule, f, i, w, split=True):
    """p stages in a chain, one task per block: forward f s, input gradients i s, weight gradients
    w s (or one backward of i + w s), free communication."""
    devs = []
    for s in range(p):
        fwd, inp = [], []
        if s > 0:
            fwd.append(Task("recv_x", TaskKind.RECV, (), (A("x"),), peer=s - 1, tag=0))
        fwd.append(Task(f"f{s}", TaskKind.FORWARD, (), (A("y"),), flops=f * 1e9))
        if s < p - 1:
            fwd.append(Task("send_y", TaskKind.SEND, (A("y"),), (), peer=s + 1, tag=0))
            inp.append(Task("recv_dy", TaskKind.RECV, (), (A("dy"),), peer=s + 1, tag=1))
        inp.append(Task(f"i{s}", TaskKind.BACKWARD, (), (A("dx"),), flops=(i if split else i + w) * 1e9))
        if s > 0:
            inp.append(Task("send_dx", TaskKind.SEND, (A("dx"),), (), peer=s - 1, tag=1))
        blocks = {(s, "F"): Block(s, "F", tuple(fwd))}
        if split:
            blocks[(s, "I")] = Block(s, "I", tuple(inp))
            blocks[(s, "W")] = Block(
                s, "W", (Task(f"w{s}", TaskKind.BACKWARD, (), (weight_grad("w"),), flops=w * 1e9),)
            )
        else:
            blocks[(s, "B")] = Block(s, "B", tuple(inp))
        devs.append(DeviceProgram(s, blocks, tuple(schedule(s, p, m))))
    return Program(tuple(devs), m, FP32)


@pytest.mark.parametrize(
    "p, m, f, i, w",
    [
        (4, 8, 1, 1, 1),
        (2, 4, 1, 1, 1),
        (4, 4, 1, 1, 1),
        (3, 7, 1, 1, 1),
        (8, 16, 1, 1, 1),
        (4, 8, 1, 1.5, 0.5),
        (4, 8, 2, 1, 1),
        (4, 8, 1, 2, 1),
    ],
)
def test_zb_h1_bubble_is_a_third_of_1f1b(p, m, f, i, w):
    """ZB-H1's iteration is m (F + I + W) + (p - 1)(F + I - W), against 1F1B's (m + p - 1)(F + B)
    with B = I + W: with F = I = W the bubble (p - 1)(F + B - 2W) is exactly a third of 1F1B's."""
    cost = IdealCost(CostModel.load("dgx-a100-80g", 1))
    zb, base = _pipeline(p, m, zb_h1, f, i, w), _pipeline(p, m, one_f_one_b, f, i, w, split=False)
    find_deadlock(zb)
    t_zb, t_1f1b = simulate(zb, cost).iter_time_s, simulate(base, cost).iter_time_s
    busy = m * (f + i + w)
    assert t_1f1b == pytest.approx(busy + (p - 1) * (f + i + w), rel=1e-12)
    assert t_zb == pytest.approx(busy + (p - 1) * (f + i - w), rel=1e-12)
    if f == i == w:
        assert (t_zb - busy) * 3 == pytest.approx(t_1f1b - busy, rel=1e-12)


def _plan(n, knobs, model="gpt-tiny"):
    spec, g = traced(model, 8)
    return get_space("megatron").build(Context(g, spec, 8, "cpu", n, n, 1), knobs), g


def test_backward_splits_into_input_and_weight_blocks():
    knobs = dict(dp=2, tp=1, pp=2, microbatch=1)
    zb_plan, g = _plan(4, dict(knobs, schedule="zb-h1"))
    base = materialize(_plan(4, knobs)[0], g)
    zb = materialize(zb_plan, g)
    find_deadlock(zb)
    for d, b in zip(zb.devices, base.devices):
        s = d.device // 2  # devices 0, 1: stage 0; 2, 3: stage 1
        assert sorted(d.blocks) == [(s, "F"), (s, "I"), (s, "U"), (s, "W")]
        inp, wgt = d.blocks[(s, "I")].tasks, d.blocks[(s, "W")].tasks
        bwd = b.blocks[(s, "B")].tasks
        # W: weight gradients only, and the data-parallel gradient bucket, reduced after the last W
        assert all(w.kind is BufferKind.WEIGHT_GRAD for t in wgt if t.kind is TaskKind.BACKWARD for w in t.writes if w)
        # I: no product's weight gradient (a layer norm computes its own there)
        kind = {op.name: op.kind for op in g.operators}
        assert all(kind[t.op] == "layer_norm" for t in inp for w in t.writes if w and w.kind is BufferKind.WEIGHT_GRAD)
        buckets = [t for t in wgt if t.kind is TaskKind.COLLECTIVE]
        assert len(buckets) == 1 and buckets[0].final and buckets[0].overlap
        assert wgt[-1] is buckets[0]
        # I: everything else, with the sends of activation gradients upstream
        assert {t.kind for t in inp} >= {TaskKind.BACKWARD} | ({TaskKind.SEND} if s == 1 else {TaskKind.RECV})
        assert [t.name for t in bwd if t.kind is not TaskKind.BACKWARD and not t.overlap] == [
            t.name for t in inp if t.kind is not TaskKind.BACKWARD
        ]
        # the work is split, not added: a linear's weight gradient is half of its backward
        total = sum(t.flops for t in bwd)
        assert sum(t.flops for t in inp) + sum(t.flops for t in wgt) == pytest.approx(total, rel=1e-12)
        lin = {t.name: t.flops for t in wgt if t.name.endswith("mlp_fc")}
        assert lin and all(v == pytest.approx(next(x.flops for x in bwd if x.name == k) / 2) for k, v in lin.items())
        # the forward's saved activations of a weight's operator live until its W
        fc = next(t for t in wgt if t.name.endswith("mlp_fc"))
        assert set(fc.saved) <= set(fc.free)


def test_w_keeps_only_each_products_input_and_output_gradient():
    """With full recomputation, what outlives a micro-batch's ``I`` until its ``W`` is, per linear
    layer, the (recomputed) input it keeps and its output's gradient: a layer norm's weight
    gradients are computed in ``I``, which frees its input and output gradient."""
    assert weight_share("linear", 2, 1) == 0.5 and weight_share("embedding", 1, 0) == 1.0
    assert weight_share("layer_norm", 2, 1) == 0.0
    plan, g = _plan(2, dict(dp=1, tp=1, pp=2, microbatch=1, schedule="zb-h1", recompute="full"))
    kind = {op.name: op.kind for op in g.operators}
    for d in materialize(plan, g).devices:
        s = d.device
        inp, wgt = d.blocks[(s, "I")].tasks, d.blocks[(s, "W")].tasks
        products = [t for t in wgt if t.kind is TaskKind.BACKWARD and kind[t.op] == "linear"]
        assert products and all(kind[t.op] in ("linear", "embedding") for t in wgt if t.kind is TaskKind.BACKWARD)
        norms = [t for t in inp if t.kind is TaskKind.BACKWARD and kind[t.op] == "layer_norm"]
        assert norms and all(any(w and w.kind is BufferKind.WEIGHT_GRAD for w in t.writes) for t in norms)
        freed = {b for t in wgt for b in t.free}
        kept = {b for t in products for b in t.saved + t.reads if b}
        assert freed <= kept | {b for t in wgt if kind.get(t.op) == "embedding" for b in t.saved + t.reads if b}
        assert {b.kind for b in freed} <= {
            BufferKind.RECOMPUTED,
            BufferKind.ACTIVATION,
            BufferKind.GRAD,
            BufferKind.CONTRIBUTION,
        }
        assert any(b.kind is BufferKind.RECOMPUTED for b in freed)  # the linears' recomputed inputs


def test_zb_h1_beats_1f1b_on_a_real_program_with_idealised_costs():
    cost = IdealCost(CostModel.load("cpu", 2))
    t = {
        sched: simulate(materialize(*_plan(2, dict(dp=1, tp=1, pp=2, microbatch=1, schedule=sched))), cost)
        for sched in ("1f1b", "zb-h1")
    }
    assert t["zb-h1"].iter_time_s < t["1f1b"].iter_time_s
    assert t["zb-h1"].hardware_flops == pytest.approx(t["1f1b"].hardware_flops, rel=1e-12)


def test_schedules_with_w_before_i_or_b_beside_i_are_refused():
    plan, g = _plan(2, dict(dp=1, tp=1, pp=2, microbatch=2, schedule="zb-h1"))
    sched = list(plan.schedule[0])
    k = sched.index(Action(0, "I", 0))
    sched[k], sched[k + 1] = sched[k + 1], sched[k]  # 0W0 before 0I0
    with pytest.raises(InfeasiblePlan, match="runs 0W0 before 0I0"):
        materialize(dataclasses.replace(plan, schedule=(tuple(sched),) + plan.schedule[1:]), g)
    mixed = tuple(Action(0, "B", 0) if a == Action(0, "I", 0) else a for a in plan.schedule[0])
    with pytest.raises(InfeasiblePlan, match="names no block"):
        materialize(dataclasses.replace(plan, schedule=(mixed,) + plan.schedule[1:]), g)


def test_memory_bound_counts_micro_batches_in_flight_until_their_i():
    for sched in ("1f1b", "zb-h1"):
        plan, g = _plan(2, dict(dp=1, tp=1, pp=2, microbatch=1, schedule=sched))
        if sched == "1f1b":
            bound = memory_lower_bound_bytes(plan, g)
        else:
            assert memory_lower_bound_bytes(plan, g) == bound
    assert "zb-h1" in dict((k.name, k) for k in get_space("pp").knobs)["schedule"].values(None)


@pytest.mark.parametrize(
    "n, knobs",
    [
        (2, dict(dp=1, tp=1, pp=2, microbatch=2, schedule="zb-h1", recompute="full")),  # 4 micro-batches
        (4, dict(dp=2, tp=1, pp=2, microbatch=1, schedule="zb-h1", zero=3)),  # with ZeRO-3's gathered layers
    ],
)
def test_zb_h1_matches_one_process(n, knobs):
    plan, _ = _plan(n, knobs)
    res = launch_local(plan, n, steps=2, lr=1e-2, record=True)
    assert res.max_loss_error <= LOSS_TOL, (res.losses, res.ref_losses)
    assert res.max_grad_error <= GRAD_TOL
    assert res.losses[1] < res.losses[0]
    ran = {(t["device"], t["action"][1:2]) for t in res.timeline}
    assert {ph for _, ph in ran} == {"F", "I", "W", "U"}


def test_fp8_w_keeps_the_output_gradients_fp8_cast_not_the_gradient():
    """Under Transformer Engine's FP8 training (``megatron``, ``fp8``) a linear layer's deferred
    weight-gradient GEMM keeps the FP8 cast of its output gradient that ``I`` made (TE's
    ``wgrad_store``): the 16-bit gradient is freed after ``I``, the one-byte cast, half its bytes,
    after ``W``. In 16 bits (and in the output layer, kept in 16 bits) ``W`` reads the gradient itself."""
    fp8 = CostModel.load("dgx-h100", 1, software="megatron", precision="fp8")
    plan, g = _plan(2, dict(dp=1, tp=1, pp=2, microbatch=1, schedule="zb-h1"))
    kind = {op.name: op.kind for op in g.operators}
    for prec, sw in ((fp8.precision, fp8.software), (None, fp8.software)):
        for d in materialize(plan, g, precision=prec, software=sw).devices:
            s = d.device
            inp = {t.name: t for t in d.blocks[(s, "I")].tasks if t.kind is TaskKind.BACKWARD}
            wgt = [t for t in d.blocks[(s, "W")].tasks if t.kind is TaskKind.BACKWARD and kind[t.op] == "linear"]
            assert wgt
            for w in wgt:
                i = inp[w.name]
                grads = [b for b in i.reads if b]
                if prec is None or w.output_layer:  # 16 bits (the output layer is no FP8 module)
                    assert w.reads == i.reads and not set(grads) & set(i.free)
                    continue
                casts = [fp8_cast(b) for b in grads]
                assert not any(w.reads) and grads and set(grads) <= set(i.free)
                assert set(casts) <= set(w.saved) & set(w.free) and set(casts) <= {b for b, _ in i.alloc}
                sizes = {b: n for blk in d.blocks.values() for t in blk.tasks for b, n in t.alloc}
                assert all(2 * sizes[c] == sizes[b] > 0 for b, c in zip(grads, casts))
