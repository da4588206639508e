"""V-shaped schedules (planlab/search_spaces/schedules_v.py): ZB-V and DualPipe's order against
golden text, every action once in a dependency-respecting, deadlock-free order, their bubbles in
the simulator against the papers' formulas (idealised costs), and ZB-V plans on gloo ranks."""

import dataclasses

import pytest

from planlab.cli import GRAD_TOL, LOSS_TOL
from planlab.costmodel import CostModel
from planlab.executor import launch_local
from planlab.plan import FP32, Block, DeviceProgram, Program, Task, TaskKind, materialize
from planlab.errors import InfeasiblePlan
from planlab.plan.plan import Action
from planlab.plan.plan_file import plan_from_json, plan_to_json
from planlab.plan.buffer import activation as A
from planlab.plan.buffer import weight_grad
from planlab.search_spaces import Context, get_space, one_f_one_b
from planlab.search_spaces.schedules import format_schedule, parse_schedule
from planlab.search_spaces.schedules_v import dualpipe, peak_in_flight, v_rank, zb_v
from planlab.search_spaces.schedule_walks import paired_actions
from planlab.search_spaces.screen import Screen
from planlab.simulator import find_deadlock, simulate

from conftest import traced
from test_simulator import IdealCost

# ZB-V for p=4, m=8: rank r holds stages r (down) and 7 - r (back up); the loss is on rank 0
GOLDEN_ZBV = [
    "0F0 0F1 0F2 0F3 0F4 0F5 0F6 7F0 7I0 7F1 7I1 0F7 7W0 7F2 7I2 7F3 7I3 7W1 7W2 7F4 7I4 7F5 0I0 0I1 7I5 7W3 7W4 0W0 0W1 7F6 0I2 0I3 7I6 0I4 7W5 0I5 0W2 7F7 7I7 0I6 0W3 7W6 0W4 0W5 7W7 0I7 0W6 0W7",
    "1F0 1F1 1F2 1F3 1F4 6F0 1F5 6F1 1F6 6I0 6I1 6F2 6F3 1F7 6I2 6W0 6I3 6F4 6W1 6F5 1I0 1I1 6I4 6W2 6I5 6W3 1W0 6F6 1I2 1I3 1W1 1I4 6I6 1I5 6W4 6F7 6W5 1I6 6I7 1W2 1W3 1W4 6W6 1I7 1W5 1W6 6W7 1W7",
    "2F0 2F1 2F2 5F0 2F3 5F1 2F4 5F2 2F5 5F3 2F6 5I0 5I1 5F4 5W0 5F5 2I0 5W1 2I1 2F7 5I2 5I3 5I4 2W0 5I5 5F6 2I2 2I3 2W1 2I4 5W2 2I5 5I6 5F7 5W3 2I6 5W4 5W5 5I7 2W2 2W3 2I7 2W4 2W5 5W6 2W6 5W7 2W7",
    "3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 3F4 4F4 3F5 4F5 3F6 4I0 3I0 4I1 3I1 4W0 3W0 4F6 4W1 3F7 4I2 3I2 4I3 3I3 4I4 3I4 4I5 3I5 3W1 4F7 4I6 3I6 4W2 3W2 4W3 3W3 4I7 3I7 4W4 3W4 4W5 3W5 4W6 3W6 4W7 3W7",
]
# DualPipe for p=4, m=8 (DualPipe's own order, deepseek-ai/DualPipe's step): rank r runs stage r for
# the halves going down and stage 3 - r for those coming up; rank 3 - r's list is rank r's (the
# placement is a mirror)
GOLDEN_DUALPIPE = [
    "0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3I1 3W1 3F2 0I0 0W0 0F4 3I2 3W2 3F3 0I1 0W1 0F5 3I3 3W3 3F4 0I2 0W2 0F6 3I4 3W4 3F5 0I3 0W3 0F7 3I5 3W5 3F6 0I4 0W4 3I6 3W6 3F7 0I5 0W5 3I7 3W7 0I6 0W6 0I7 0W7",
    "1F0 2F0 1F1 2F1 1F2 2I0 2W0 2F2 1I0 1W0 1F3 2I1 2W1 2F3 1I1 1W1 1F4 2I2 2W2 2F4 1I2 1W2 1F5 2I3 2W3 2F5 1I3 1W3 1F6 2I4 2W4 2F6 1I4 1W4 1F7 2I5 2W5 2F7 1I5 1W5 2I6 2W6 1I6 1W6 2I7 1I7 2W7 1W7",
]


@pytest.mark.parametrize("rank", range(4))
def test_zb_v_schedule_text(rank):
    text = format_schedule(zb_v(rank, 4, 8))
    assert text == GOLDEN_ZBV[rank]
    assert format_schedule(parse_schedule(text)) == text


@pytest.mark.parametrize("rank", range(4))
def test_dualpipe_schedule_text_is_mirrored(rank):
    text = format_schedule(dualpipe(rank, 4, 8))
    assert text == GOLDEN_DUALPIPE[min(rank, 3 - rank)]
    assert format_schedule(parse_schedule(text)) == text


@pytest.mark.parametrize("p, m", [(2, 1), (2, 4), (4, 8), (4, 3), (8, 16)])
def test_zb_v_runs_every_action_once_in_order(p, m):
    for r in range(p):
        acts = zb_v(r, p, m)
        stages = (r, 2 * p - 1 - r)
        assert sorted(map(str, acts)) == sorted(f"{s}{ph}{k}" for s in stages for ph in "FIW" for k in range(m))
        pos = {str(a): i for i, a in enumerate(acts)}
        for s in stages:
            assert all(pos[f"{s}F{k}"] < pos[f"{s}I{k}"] < pos[f"{s}W{k}"] for k in range(m))
        # the way down before the way back on the same rank (the V's turn on the last rank)
        assert all(pos[f"{r}F{k}"] < pos[f"{2 * p - 1 - r}F{k}"] for k in range(m)) or r < p - 1


def _v_program(p, m, schedule, f, i, w, stages_of):
    """Virtual stages on ``p`` devices (``stages_of(s)`` is stage ``s``'s device), in chains of
    ``chain`` stages: one task per block (forward f s, input gradients i s, weight gradients w s),
    free communication; a message between devices on tag 0 (activations) or 1 (gradients)."""
    devs = []
    for d in range(p):
        blocks = {}
        for s, prev, nxt in stages_of(d):
            fwd, inp = [], []
            if prev is not None and prev[1] != d:
                fwd.append(Task(f"recv_x{s}", TaskKind.RECV, (), (A(f"x{s}"),), peer=prev[1], tag=0))
            fwd.append(Task(f"f{s}", TaskKind.FORWARD, (), (A(f"y{s}"),), flops=f * 1e9))
            if nxt is not None and nxt[1] != d:
                fwd.append(Task(f"send_y{s}", TaskKind.SEND, (A(f"y{s}"),), (), peer=nxt[1], tag=0))
                inp.append(Task(f"recv_dy{s}", TaskKind.RECV, (), (A(f"dy{s}"),), peer=nxt[1], tag=1))
            inp.append(Task(f"i{s}", TaskKind.BACKWARD, (), (A(f"dx{s}"),), flops=i * 1e9))
            if prev is not None and prev[1] != d:
                inp.append(Task(f"send_dx{s}", TaskKind.SEND, (A(f"dx{s}"),), (), peer=prev[1], tag=1))
            blocks[(s, "F")] = Block(s, "F", tuple(fwd))
            blocks[(s, "I")] = Block(s, "I", tuple(inp))
            blocks[(s, "W")] = Block(
                s, "W", (Task(f"w{s}", TaskKind.BACKWARD, (), (weight_grad(f"w{s}"),), flops=w * 1e9),)
            )
        devs.append(DeviceProgram(d, blocks, tuple(schedule(d, p, m))))
    return Program(tuple(devs), m, FP32)


def _zbv_stages(p):
    def of(d):
        out = []
        for s in (d, 2 * p - 1 - d):
            prev = (s - 1, v_rank(s - 1, p)) if s > 0 else None
            nxt = (s + 1, v_rank(s + 1, p)) if s < 2 * p - 1 else None
            out.append((s, prev, nxt))
        return out

    return of


def _dualpipe_stages(p):
    """Rank ``d``'s two stages: ``d`` going down (from rank ``d - 1`` to ``d + 1``) and ``p - 1 - d``
    coming up (from rank ``d + 1`` to ``d - 1``)."""

    def of(d):
        up = p - 1 - d
        return [
            (d, (d - 1, d - 1) if d else None, (d + 1, d + 1) if d < p - 1 else None),
            (up, (up - 1, d + 1) if up else None, (up + 1, d - 1) if up < p - 1 else None),
        ]

    return of


def _bare(schedule):
    return lambda d, p, m: [a.bare() for a in schedule(d, p, m)]


def _chain_stages(p):
    return lambda d: [(d, (d - 1, d - 1) if d else None, (d + 1, d + 1) if d < p - 1 else None)]


def _one_f_one_b_split(stage, stages, m):  # 1F1B's order with B as I then W at once
    out = []
    for a in one_f_one_b(stage, stages, m):
        out += [a] if a.phase == "F" else [type(a)(a.stage, "I", a.microbatch), type(a)(a.stage, "W", a.microbatch)]
    return out


@pytest.mark.parametrize("p, m", [(2, 8), (4, 8), (4, 16), (8, 32)])
def test_zb_v_bubble_against_1f1b_with_idealised_costs(p, m):
    """A stage of F = I = W = 1 s (ZB-V's chunks half of that); the ZB-V paper's bubble with equal
    times is 0. The list schedule's bubble is
    measured and printed (docs/spaces.md), not asserted to be 0: it must beat 1F1B's."""
    cost = IdealCost(CostModel.load("dgx-a100-80g", 1))
    base = _v_program(p, m, _one_f_one_b_split, 1, 1, 1, _chain_stages(p))
    zbv = _v_program(p, m, zb_v, 0.5, 0.5, 0.5, _zbv_stages(p))
    find_deadlock(zbv)
    t_1f1b, t_zbv = simulate(base, cost).iter_time_s, simulate(zbv, cost).iter_time_s
    busy = 3 * m
    # 1F1B sending I's gradients before its W: (p - 1)(F + I) of bubble ((p - 1)(F + B) with B whole)
    assert t_1f1b == pytest.approx(busy + 2 * (p - 1), rel=1e-12)
    print(f"p={p} m={m}: 1F1B bubble {t_1f1b - busy:g} s, ZB-V {t_zbv - busy:g} s (paper: 0)")
    assert busy <= t_zbv < t_1f1b


def _plan(n, knobs, layers):
    spec, g = traced("gpt-tiny", 8, (("layers", layers),))
    return get_space("megatron").build(Context(g, spec, 8, "cpu", n, n, 1), knobs), g


def test_zb_v_plan_places_two_stages_per_device_in_a_v():
    plan, g = _plan(2, dict(dp=1, tp=1, pp=2, microbatch=1, schedule="zb-v"), 4)
    stage_dev = {p.stage: p.devices for p in plan.ops}
    assert stage_dev == {0: (0,), 1: (1,), 2: (1,), 3: (0,)}
    prog = materialize(plan, g)
    find_deadlock(prog)
    assert {d.device: sorted({s for s, _ in d.blocks}) for d in prog.devices} == {0: [0, 3], 1: [1, 2]}
    assert simulate(prog, CostModel.load("cpu", 2)).iter_time_s > 0


def test_zb_v_needs_two_stages_per_device_to_divide_the_layers():
    with pytest.raises(Exception, match=r"schedule=zb-v holds two stages per device: its 2 x pp=2 stages must divide"):
        _plan(2, dict(dp=1, tp=1, pp=2, microbatch=1, schedule="zb-v"), 2)


def test_peaks_in_flight():
    """Measured, per rank (in chunks between F and W): ZB-V's paper keeps 1F1B's 2p (here 8), the list
    scheduler up to 13 (entries below 3p = 12); DualPipe's report p + 1 (5). The list scheduler's figures are recorded here (docs/spaces.md)."""
    assert [peak_in_flight(zb_v(r, 4, 8)) for r in range(4)] == [11, 12, 12, 13]
    assert [peak_in_flight(dualpipe(r, 4, 8)) for r in range(4)] == [5, 5, 5, 5]


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (8, 16), (16, 20)])
def test_dualpipe_published_order_runs_with_receives_posted_ahead(p, m):
    """DualPipe's own order (receives posted ahead): every action once, F before I before W, at most
    p + 1 chunks in flight and exactly p + 1 somewhere; the dry run and the simulator pass it on 2 to
    16 ranks. Without its posts, the same order deadlocks from 8 ranks on (messages matched in order)."""
    for r in range(p):
        acts = dualpipe(r, p, m)
        stages = (r, p - 1 - r)
        assert sorted(map(str, acts)) == sorted(f"{s}{ph}{k}" for s in stages for ph in "FIW" for k in range(m))
        pos = {str(a): i for i, a in enumerate(acts)}
        assert all(pos[f"{s}F{k}"] < pos[f"{s}I{k}"] < pos[f"{s}W{k}"] for s in stages for k in range(m))
    assert max(peak_in_flight(dualpipe(r, p, m)) for r in range(p)) == p + 1
    prog = _v_program(p, m, dualpipe, 1, 1, 1, _dualpipe_stages(p))
    assert find_deadlock(prog) is None
    cost = IdealCost(CostModel.load("dgx-a100-80g", 2))
    assert simulate(prog, cost).iter_time_s >= 2 * 3 * m  # two stages of F = I = W = 1 s each way
    bare = find_deadlock(_v_program(p, m, _bare(dualpipe), 1, 1, 1, _dualpipe_stages(p)), raise_error=False)
    assert (bare is not None) == (p >= 8)


@pytest.mark.parametrize("collective, paired_s", [("all_to_all", 4.0), ("all_reduce", 6.0)])
def test_a_pair_overlaps_each_ones_all_to_all_with_the_others_computation(collective, paired_s):
    """Two alike devices, a forward and a backward each 1 s of computation, a 1 s all-to-all over
    both devices, 1 s of computation: one after the other 6 s (2 s of it exposed all-to-all); as a
    pair (the forward ``overlaps`` the backward) 4 s, each all-to-all beside the other's computation.
    A tensor-parallel all-reduce in its place is not overlapped by the pair: 6 s, 2 s exposed."""

    def block(stage, phase, kind):
        tasks = (
            Task(f"{phase}a", kind, (), (A(f"a{stage}"),), flops=1e9),
            Task(
                f"{phase}x",
                TaskKind.COLLECTIVE,
                (A(f"a{stage}"),),
                (A(f"b{stage}"),),
                collective=collective,
                group=(0, 1),
                nbytes=10**9,
                ident=stage,
            ),
            Task(f"{phase}b", kind, (A(f"b{stage}"),), (A(f"c{stage}"),), flops=1e9),
        )
        return Block(stage, phase, tasks)

    blocks = {(0, "F"): block(0, "F", TaskKind.FORWARD), (1, "I"): block(1, "I", TaskKind.BACKWARD)}
    cost = IdealCost(CostModel.load("dgx-a100-80g", 1))
    for overlaps, want_s, exposed_s in ((False, 6.0, 2.0), (True, paired_s, paired_s - 4.0)):
        schedule = (Action(0, "F", 0, overlaps=overlaps), Action(1, "I", 0))
        prog = Program(tuple(DeviceProgram(d, blocks, schedule) for d in range(2)), 1, FP32)
        res = simulate(prog, cost)
        assert res.iter_time_s == pytest.approx(want_s)
        assert [d.exposed_comm_s for d in res.devices] == pytest.approx([exposed_s] * len(res.devices))
    # computation twice as slow beside a collective: the backward's first second of computation runs
    # beside the forward's all-to-all, so the pair takes longer than 4 s, still less than 6 s; the
    # all-reduce runs beside no computation, so nothing is slowed
    slowed = simulate(prog, cost, overlap_slowdown=2.0).iter_time_s
    assert 4.0 < slowed < 6.0 if collective == "all_to_all" else slowed == pytest.approx(6.0)


def test_a_schedule_that_posts_a_receive_it_does_not_run_is_refused():
    plan, g = _plan(2, dict(dp=1, tp=1, pp=2, microbatch=2, schedule="dualpipe"), 2)
    first = plan.schedule[1]
    bad = (Action(first[0].stage, first[0].phase, first[0].microbatch, (Action(7, "F", 0),)),) + first[1:]
    with pytest.raises(
        Exception, match=rf"device 1's action {first[0]} posts the receives of 7F0, which is not in its"
    ):
        materialize(dataclasses.replace(plan, schedule=(plan.schedule[0], bad)), g)


def test_a_dualpipe_plan_pairs_chunks_only_where_it_dispatches_experts():
    """DualPipe's overlapped chunk hides the expert all-to-alls: a dense plan keeps the posted receives
    but runs no pairs; an expert-parallel plan pairs (and its plan file keeps both)."""
    dense, _ = _plan(2, dict(dp=1, tp=1, pp=2, microbatch=2, schedule="dualpipe"), 2)
    assert any(a.posts for s in dense.schedule for a in s)
    assert not any(a.overlaps for s in dense.schedule for a in s)
    spec, moe = traced("deepseek-tiny", 8)
    knobs = dict(dp=2, ep=2, tp=1, pp=2, microbatch=2, schedule="dualpipe")
    plan = get_space("megatron").build(Context(moe, spec, 8, "cpu", 4, 4, 1), knobs)
    assert any(a.posts for s in plan.schedule for a in s) and any(a.overlaps for s in plan.schedule for a in s)
    assert plan_from_json(plan_to_json(plan)) == plan


def test_the_screen_credits_a_dualpipe_plan_the_all_to_alls_its_pairs_hide():
    """The screen takes off a DualPipe group's time what its pairs hide: a chunk's all-to-alls per
    pair, on an expert-parallel plan (the pairs its schedule runs); nothing on a dense plan."""
    spec, moe = traced("deepseek-tiny", 8)
    cost = CostModel.load("dgx-a100-80g", 1)
    ctx = Context(moe, spec, 8, cost.cluster.node.name, 1, 4, 1)
    screen, space = Screen(moe, cost, cost.precision), get_space("megatron")
    ep = space.draft(ctx, dict(dp=2, ep=2, tp=1, pp=2, microbatch=2, schedule="dualpipe"))
    dense = space.draft(ctx, dict(dp=2, ep=1, tp=1, pp=2, microbatch=2, schedule="dualpipe"))
    for d in (ep, dense):
        prices = [
            screen._price(p, i, tuple(x for _, x in d.axes), d.microbatches, 0, False)
            for i, p in enumerate(screen.structure(d).profiles)
        ]
        hidden = screen.pairs_hidden_s(d, prices)
        if d is dense:
            assert hidden == [0.0, 0.0]
            continue
        pairs = [paired_actions("dualpipe", r, 2, d.microbatches) for r in range(2)]
        assert min(pairs) > 0 and min(hidden) > 0
        a2a = [(prices[r].a2a_s + prices[1 - r].a2a_s) / 2 for r in range(2)]
        assert hidden == pytest.approx([n * x / d.microbatches for n, x in zip(pairs, a2a)])


def test_a_pair_must_be_a_forward_and_the_backward_after_it():
    plan, g = _plan(2, dict(dp=1, tp=1, pp=2, microbatch=2, schedule="dualpipe"), 2)
    last = plan.schedule[0][-1]
    bad = plan.schedule[0][:-1] + (Action(last.stage, last.phase, last.microbatch, overlaps=True),)
    with pytest.raises(
        InfeasiblePlan, match=rf"device 0's action {last} overlaps the next, but only a forward .* is the last"
    ):
        materialize(dataclasses.replace(plan, schedule=(bad, plan.schedule[1])), g)


def test_a_posted_receive_out_of_order_is_a_deadlock_report():
    """Two sends from device 0 (x then y); device 1 posts y's receive first: the dry run names it."""
    send = lambda n, tag: Task(f"send_{n}", TaskKind.SEND, (A(n),), (), peer=1, tag=tag)  # noqa: E731
    recv = lambda n, tag: Task(f"recv_{n}", TaskKind.RECV, (), (A(n),), peer=0, tag=tag)  # noqa: E731
    d0 = DeviceProgram(0, {(0, "F"): Block(0, "F", (send("x", 0), send("y", 1)))}, (Action(0, "F", 0),))
    blocks = {(1, "F"): Block(1, "F", (recv("x", 0),)), (2, "F"): Block(2, "F", (recv("y", 1),))}
    good = (Action(1, "F", 0, (Action(1, "F", 0), Action(2, "F", 0))), Action(2, "F", 0))
    bad = (Action(1, "F", 0, (Action(2, "F", 0), Action(1, "F", 0))), Action(2, "F", 0))
    assert find_deadlock(Program((d0, DeviceProgram(1, blocks, good)), 1, FP32)) is None
    report = find_deadlock(Program((d0, DeviceProgram(1, blocks, bad)), 1, FP32), raise_error=False)
    assert (
        "device 1 expects R:recv_x<-0 (micro-batch 0) from device 0, but its message on that channel is send_y"
        in report
    )


def test_dualpipe_plan_mirrors_the_stages():
    plan, g = _plan(2, dict(dp=1, tp=1, pp=2, microbatch=2, schedule="dualpipe"), 2)
    # each operator's two halves of a micro-batch: piece 0 on rank s, piece 1 on rank p - 1 - s
    assert {p.stage: p.devices for p in plan.ops} == {0: (0, 1), 1: (1, 0)}
    prog = materialize(plan, g)
    find_deadlock(prog)
    assert all(sorted({s for s, _ in d.blocks}) == [0, 1] for d in prog.devices)  # 2x parameters per rank
    assert simulate(prog, CostModel.load("cpu", 2)).iter_time_s > 0


@pytest.mark.parametrize(
    "knobs, text",
    [
        (dict(pp=2, microbatch=1), "it needs an even pp and an even microbatch, not pp=2, microbatch=1"),
        (
            dict(pp=2, microbatch=2, schedule="nope"),
            "choose '1f1b', 'gpipe', 'zb-h1', 'interleaved', 'zb-v' or 'dualpipe'",
        ),
    ],
)
def test_dualpipe_and_schedule_errors(knobs, text):
    with pytest.raises(Exception, match=text):
        _plan(2, {**dict(dp=1, tp=1, schedule="dualpipe"), **knobs}, 2)


@pytest.mark.parametrize(
    "n, layers, schedule",
    [
        (2, 4, "zb-v"),
        (2, 2, "dualpipe"),
        pytest.param(4, 8, "zb-v", marks=pytest.mark.slow),
        pytest.param(4, 4, "dualpipe", marks=pytest.mark.slow),
    ],
)
def test_v_schedules_match_one_process(n, layers, schedule):
    plan, _ = _plan(n, dict(dp=1, tp=1, pp=n, microbatch=2, schedule=schedule), layers)
    res = launch_local(plan, n, steps=2, lr=1e-2, record=True)
    assert res.max_loss_error <= LOSS_TOL, (res.losses, res.ref_losses)
    assert res.max_grad_error <= GRAD_TOL
    assert {t["action"][1:2] for t in res.timeline} == {"F", "I", "W", "U"}


@pytest.mark.parametrize(
    "model, n, knobs",
    [
        ("llama-tiny", 2, dict(dp=1, tp=1, pp=2, microbatch=2, schedule="dualpipe")),
        pytest.param(
            "deepseek-tiny",
            4,
            dict(dp=2, ep=2, tp=1, pp=2, microbatch=2, schedule="dualpipe"),
            marks=pytest.mark.slow,
        ),
    ],
)
def test_dualpipe_plans_of_llama_and_expert_parallel_models_match_one_process(model, n, knobs):
    """DualPipe on a LLaMA model (grouped-query attention, no pairs) and on an expert-parallel DeepSeek
    model (its forward/backward chunks paired, receives posted ahead) run on gloo as one process does."""
    spec, g = traced(model, 8)
    plan = get_space("megatron").build(Context(g, spec, 8, "cpu", n, n, 1), knobs)
    assert any(a.posts for s in plan.schedule for a in s)
    assert any(a.overlaps for s in plan.schedule for a in s) == (knobs.get("ep", 1) > 1)
    res = launch_local(plan, n, steps=2, lr=1e-2, record=True)
    assert res.max_loss_error <= LOSS_TOL, (res.losses, res.ref_losses)
    assert res.max_grad_error <= GRAD_TOL
