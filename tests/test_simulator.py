import dataclasses

import pytest

from planlab.costmodel import CostModel
from planlab.costmodel.software import load_software
from planlab.errors import ConfigError, DeadlockError
from planlab.plan import Block, DeviceProgram, FP32, Program, Task, TaskKind, materialize
from planlab.plan.buffer import activation as A
from planlab.search_spaces import Context, get_space, gpipe, interleaved_1f1b, one_f_one_b, zb_h1
from planlab.simulator import device_classes, find_deadlock, simulate
from planlab.simulator.engine import in_deepspeed_order
from planlab.simulator.units import Recv, Segment, receives_first

from conftest import traced


@dataclasses.dataclass(frozen=True)
class IdealCost:
    """Exact prices: 1 GFLOP/s compute, 1 GB/s links, no latency, on a real cluster's layout."""

    base: CostModel
    memory_bytes: float = 1e12

    @property
    def cluster(self):
        return self.base.cluster

    @property
    def device_memory_bytes(self):
        return self.memory_bytes

    @property
    def overlap_slowdown(self):
        return 1.0

    @property
    def dispatch_slowdown(self):
        return 1.0

    def compute_time_s(self, *, flops, bytes_moved, dtype):
        return flops / 1e9

    def collective_time_s(self, kind, nbytes, group):
        return nbytes / 1e9

    def p2p_time_s(self, nbytes, src, dst):
        return nbytes / 1e9


def _pipeline_program(p: int, m: int, schedule, f_flops=1e9, b_flops=2e9, nbytes=0) -> Program:
    """p stages in a chain; each F/B block is one compute task with send/recv to neighbours."""
    devs = []
    for s in range(p):
        fwd, bwd = [], []
        if s > 0:
            fwd.append(
                Task("recv_x", TaskKind.RECV, (), (A("x"),), peer=s - 1, tag=0, nbytes=nbytes, alloc=((A("x"), 100),))
            )
        fwd.append(
            Task(f"f{s}", TaskKind.FORWARD, (A("x"),) if s else (), (A("y"),), flops=f_flops, alloc=((A("y"), 100),))
        )
        if s < p - 1:
            fwd.append(Task("send_y", TaskKind.SEND, (A("y"),), (), peer=s + 1, tag=0, nbytes=nbytes))
            bwd.append(Task("recv_dy", TaskKind.RECV, (), (A("dy"),), peer=s + 1, tag=1, nbytes=nbytes))
        bwd.append(
            Task(
                f"b{s}",
                TaskKind.BACKWARD,
                (A("dy"),) if s < p - 1 else (),
                (A("dx"),),
                flops=b_flops,
                free=(A("y"),) + ((A("x"),) if s else ()),
            )
        )
        if s > 0:
            bwd.append(Task("send_dx", TaskKind.SEND, (A("dx"),), (), peer=s - 1, tag=1, nbytes=nbytes))
        blocks = {(s, "F"): Block(s, "F", tuple(fwd)), (s, "B"): Block(s, "B", tuple(bwd))}
        devs.append(DeviceProgram(s, blocks, tuple(schedule(s, p, m))))
    return Program(tuple(devs), m, FP32)


@pytest.mark.parametrize("schedule", [one_f_one_b, gpipe])
@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 4), (3, 7)])
def test_pipeline_matches_the_bubble_formula(schedule, p, m):
    # idealised: equal compute per micro-batch and stage, free communication
    cost = IdealCost(CostModel.load("dgx-a100-80g", 1))
    prog = _pipeline_program(p, m, schedule)
    find_deadlock(prog)
    res = simulate(prog, cost)
    f, b = 1.0, 2.0
    assert res.iter_time_s == pytest.approx((m + p - 1) * (f + b), rel=1e-12)
    busy = m * (f + b)
    assert (res.iter_time_s - busy) / res.iter_time_s == pytest.approx((p - 1) / (m + p - 1))


def _event_log(res) -> list[tuple]:
    """The recorded events as (device, stream, action, name, start, end), times to 1e-9 s."""
    return [(e.device, e.stream, e.action, e.name, round(e.start_s, 9), round(e.end_s, 9)) for e in res.events]


def test_exact_event_log_of_a_two_stage_pipeline():
    cost = IdealCost(CostModel.load("dgx-a100-80g", 1))
    prog = _pipeline_program(2, 2, one_f_one_b, f_flops=1e9, b_flops=2e9, nbytes=int(0.5e9))
    res = simulate(prog, cost, timeline=True)
    assert _event_log(res) == [
        (0, "compute", "0F0", "f0", 0.0, 1.0),
        (0, "comm", "0F0", "send_y", 1.0, 1.5),
        (0, "compute", "0F1", "f0", 1.0, 2.0),
        (0, "comm", "0F1", "send_y", 2.0, 2.5),
        (0, "wait", "0B0", "recv_dy", 2.0, 5.0),
        (0, "compute", "0B0", "b0", 5.0, 7.0),
        (0, "wait", "0B1", "recv_dy", 7.0, 8.0),
        (0, "compute", "0B1", "b0", 8.0, 10.0),
        (1, "wait", "1F0", "recv_x", 0.0, 1.5),
        (1, "compute", "1F0", "f1", 1.5, 2.5),
        (1, "compute", "1B0", "b1", 2.5, 4.5),
        (1, "comm", "1B0", "send_dx", 4.5, 5.0),
        (1, "wait", "1F1", "recv_x", 4.5, 4.5),
        (1, "compute", "1F1", "f1", 4.5, 5.5),
        (1, "compute", "1B1", "b1", 5.5, 7.5),
        (1, "comm", "1B1", "send_dx", 7.5, 8.0),
    ]
    assert res.iter_time_s == pytest.approx(10.0)
    # memory: 1F1B keeps at most 2 micro-batches' activation on stage 0
    assert res.devices[0].peak_mem_bytes == 200


def test_deterministic_and_symmetry_gives_the_same_result():
    spec, g = traced("gpt-tiny", 8)
    ctx = Context(g, spec, 8, "cpu", 4, 4, 1)
    prog = materialize(get_space("megatron").build(ctx, dict(dp=2, tp=1, pp=2, microbatch=2)), g)
    cost = CostModel.load("cpu", 4)
    assert sorted(set(device_classes(prog, cost.cluster))) == [0, 2]
    a = simulate(prog, cost)
    b = simulate(prog, cost)
    c = simulate(prog, cost, symmetry=False)
    assert a == b
    # the same up to the order of floating-point additions
    assert a.iter_time_s == pytest.approx(c.iter_time_s, rel=1e-12) and a.peak_mem_bytes == c.peak_mem_bytes


def test_out_of_memory_is_a_result_with_the_device_and_task():
    spec, g = traced("gpt-tiny", 8)
    ctx = Context(g, spec, 8, "cpu", 2, 2, 1)
    prog = materialize(get_space("megatron").build(ctx, dict(dp=2, tp=1, pp=1, microbatch=4)), g)
    res = simulate(prog, IdealCost(CostModel.load("cpu", 2), memory_bytes=1.5e6))
    assert not res.feasible
    assert "out of memory: device 0" in res.reason and "in task" in res.reason


def test_trace_and_dataframe(tmp_path):
    import json

    cost = IdealCost(CostModel.load("dgx-a100-80g", 1))
    res = simulate(_pipeline_program(2, 2, one_f_one_b), cost, timeline=True)
    res.write_trace(tmp_path / "t.json")
    data = json.loads((tmp_path / "t.json").read_text())
    assert {e["ph"] for e in data["traceEvents"]} >= {"X", "M", "C"}
    df = res.to_dataframe()
    assert list(df.columns) == ["device", "stream", "action", "name", "start_s", "end_s"]
    assert len(df) == len(res.events)


def test_a_straggler_slows_the_pipeline_and_gets_its_own_class():
    cost = IdealCost(CostModel.load("dgx-a100-80g", 1))
    prog = _pipeline_program(4, 8, one_f_one_b)
    base = simulate(prog, cost)
    slow = simulate(prog, cost, stragglers={2: 2.0})
    # the slowed stage sets the pace: (m + p - 1) steps of its own doubled time at most
    assert base.iter_time_s < slow.iter_time_s <= (8 + 4 - 1) * 2 * 3.0
    assert slow.devices[2].compute_s == pytest.approx(2 * base.devices[2].compute_s)
    with pytest.raises(Exception, match="stragglers"):
        simulate(prog, cost, stragglers={9: 2.0})


def _interleaved_program(p: int, v: int, m: int, f_flops=1e9, b_flops=2e9, group: int = 0) -> Program:
    """p devices, v chunks each; chunk c of the model lives on device c % p; one task per block;
    micro-batches through the chunks in groups of ``group`` (0: p)."""
    devs = []
    n = p * v
    for r in range(p):
        blocks = {}
        for c in range(v):
            s = c * p + r
            fwd, bwd = [], []
            if s > 0:
                fwd.append(Task(f"recv_x{s}", TaskKind.RECV, (), (A(f"x{s}"),), peer=(s - 1) % p, tag=2 * s))
            fwd.append(Task(f"f{s}", TaskKind.FORWARD, (), (A(f"y{s}"),), flops=f_flops / v))
            if s < n - 1:
                fwd.append(Task(f"send_y{s}", TaskKind.SEND, (A(f"y{s}"),), (), peer=(s + 1) % p, tag=2 * (s + 1)))
                bwd.append(Task(f"recv_dy{s}", TaskKind.RECV, (), (A(f"dy{s}"),), peer=(s + 1) % p, tag=2 * s + 1))
            bwd.append(Task(f"b{s}", TaskKind.BACKWARD, (), (A(f"dx{s}"),), flops=b_flops / v))
            if s > 0:
                bwd.append(
                    Task(f"send_dx{s}", TaskKind.SEND, (A(f"dx{s}"),), (), peer=(s - 1) % p, tag=2 * (s - 1) + 1)
                )
            blocks[(s, "F")] = Block(s, "F", tuple(fwd))
            blocks[(s, "B")] = Block(s, "B", tuple(bwd))
        devs.append(DeviceProgram(r, blocks, tuple(interleaved_1f1b(r, p, m, v, group))))
    return Program(tuple(devs), m, FP32)


@pytest.mark.parametrize("p, v, m", [(2, 2, 4), (4, 2, 8), (4, 4, 8), (3, 2, 6)])
def test_interleaved_1f1b_matches_its_formula(p, v, m):
    # idealised: each chunk takes f/v forward and b/v backward; bubble (p - 1) / (v m)
    cost = IdealCost(CostModel.load("dgx-a100-80g", 1))
    prog = _interleaved_program(p, v, m)
    find_deadlock(prog)
    res = simulate(prog, cost)
    f, b = 1.0, 2.0
    assert res.iter_time_s == pytest.approx((m + (p - 1) / v) * (f + b), rel=1e-12)


@pytest.mark.parametrize("p, v, m, group", [(4, 2, 10, 5), (4, 2, 8, 8), (4, 4, 12, 6), (4, 2, 3, 3), (3, 3, 2, 2)])
def test_interleaved_1f1b_with_a_group_of_micro_batches(p, v, m, group):
    # Llama 3's N (Dubey et al. 2024, Figure 6: PP 4, V 2, M 10, N 5): chunks run N micro-batches in a row;
    # every order runs without deadlock, device r keeps (v - 1) N + 2 (p - r - 1) + 1 chunks at its peak, and
    # with N >= p the bubble is still (p - 1) / (v m) of the ideal pipeline; N = m < p (one group, fewer
    # micro-batches than stages) waits for each chunk's input to come round the ring
    prog = _interleaved_program(p, v, m, group=group)
    find_deadlock(prog)
    for r in range(p):
        held = peak = 0
        for a in interleaved_1f1b(r, p, m, v, group):
            held += 1 if a.phase == "F" else -1
            peak = max(peak, held)
        assert peak == min(m * v, (v - 1) * group + 2 * (p - r - 1) + 1)
    res = simulate(prog, IdealCost(CostModel.load("dgx-a100-80g", 1)))
    if group >= p:
        assert res.iter_time_s == pytest.approx((m + (p - 1) / v) * 3.0, rel=1e-12)
    else:
        assert res.iter_time_s > (m + (p - 1) / v) * 3.0


def test_interleaved_1f1b_group_of_the_stages_is_megatrons():
    for r in range(4):
        assert interleaved_1f1b(r, 4, 8, 2, 4) == interleaved_1f1b(r, 4, 8, 2)


def test_interleaved_1f1b_refuses_groups_that_deadlock():
    # several groups of fewer micro-batches than stages: rank 0's warm-up needs a forward that rank 3 runs
    # only after a backward that needs rank 0 (the simulator finds the cycle; the schedule refuses it)
    with pytest.raises(ConfigError, match="deadlocks over 4 groups"):
        interleaved_1f1b(0, 4, 8, 2, 2)


@pytest.mark.parametrize(
    "rank, expected",
    [
        (0, "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3"),
        (1, "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3"),
    ],
)
def test_interleaved_schedule_text(rank, expected):
    from planlab.search_spaces.schedules import format_schedule, parse_schedule

    text = format_schedule(interleaved_1f1b(rank, 2, 4, 2))
    assert text == expected
    assert format_schedule(parse_schedule(text)) == text


def _two_collectives(order_1: tuple[int, int], idents: tuple[int, int] = (0, 1)) -> Program:
    """Two devices in two classes (device 1 computes twice as long first); each runs two
    all-reduces over both, of 1 s and 3 s, device 0 in order (0, 1), device 1 in ``order_1``."""
    from planlab.plan import Action

    def coll(k):
        return Task(f"ar{k}", TaskKind.COLLECTIVE, collective="all_reduce", group=(0, 1), nbytes=int((1 + 2 * k) * 1e9))

    devs = []
    for d, order in ((0, (0, 1)), (1, order_1)):
        tasks = (Task(f"f{d}", TaskKind.FORWARD, flops=1e9 * (d + 1)),) + tuple(
            dataclasses.replace(coll(k), ident=idents[k]) for k in order
        )
        devs.append(DeviceProgram(d, {(0, "F"): Block(0, "F", tasks)}, (Action(0, "F", 0),)))
    return Program(tuple(devs), 1, FP32)


def test_collectives_meet_by_their_identity_not_their_position():
    cost = IdealCost(CostModel.load("cpu", 2))
    res = simulate(_two_collectives((0, 1)), cost, timeline=True)
    assert res.iter_time_s == pytest.approx(2 + 1 + 3)  # both wait for device 1, then 1 s, then 3 s
    assert [(e.device, e.name, e.start_s, e.end_s) for e in res.events if e.stream == "comm"] == [
        (0, "ar0", 2.0, 3.0),
        (0, "ar1", 3.0, 6.0),
        (1, "ar0", 2.0, 3.0),
        (1, "ar1", 3.0, 6.0),
    ]
    # device 1 issuing them the other way round waits for a collective device 0 reaches only after
    # the one device 1 never reaches first: a deadlock (matching by position would pair ar0 with ar1)
    with pytest.raises(DeadlockError, match=r"device\(s\) \[0, 1\] still waiting"):
        simulate(_two_collectives((1, 0)), cost)


def test_a_collective_across_classes_needs_an_identity():
    cost = IdealCost(CostModel.load("cpu", 2))
    with pytest.raises(DeadlockError, match=r"C:all_reduce\(ar0\)@\[0, 1\] spans several device classes"):
        simulate(_two_collectives((0, 1), idents=(-1, 1)), cost)


@dataclasses.dataclass(frozen=True)
class BlockingCost(IdealCost):
    """IdealCost under a software whose pipeline sends block (``pipeline_p2p``: DeepSpeed's)."""

    software: object = dataclasses.field(default_factory=lambda: load_software("deepspeed"))


def test_blocking_sends_wait_for_the_receiver_and_follow_deepspeeds_order():
    """DeepSpeed's pipeline engine: a send starts once its receive is posted and holds the sender
    until delivered, and a forward's activation leaves only after the next backward step has
    received its gradient (RecvGrad, SendActivation, BackwardPass): stage 0 sends F1's output at
    5.0, not 2.5, and the iteration takes 11 s where asynchronous sends take 10 s (above)."""
    assert load_software("deepspeed").pipeline_p2p == "blocking"
    assert load_software("megatron").pipeline_p2p == "async"
    prog = _pipeline_program(2, 2, one_f_one_b, f_flops=1e9, b_flops=2e9, nbytes=int(0.5e9))
    res = simulate(prog, BlockingCost(CostModel.load("dgx-a100-80g", 1)), timeline=True)
    assert _event_log(res) == [
        (0, "compute", "0F0", "f0", 0.0, 1.0),
        (0, "comm", "0F0", "send_y", 1.0, 1.5),
        (0, "compute", "0F1", "f0", 1.5, 2.5),
        (0, "wait", "0B0", "recv_dy", 2.5, 5.0),
        (0, "comm", "0F1", "send_y", 5.0, 5.5),
        (0, "compute", "0B0", "b0", 5.5, 7.5),
        (0, "wait", "0B1", "recv_dy", 7.5, 9.0),
        (0, "compute", "0B1", "b0", 9.0, 11.0),
        (1, "wait", "1F0", "recv_x", 0.0, 1.5),
        (1, "compute", "1F0", "f1", 1.5, 2.5),
        (1, "compute", "1B0", "b1", 2.5, 4.5),
        (1, "comm", "1B0", "send_dx", 4.5, 5.0),
        (1, "wait", "1F1", "recv_x", 5.0, 5.5),
        (1, "compute", "1F1", "f1", 5.5, 6.5),
        (1, "compute", "1B1", "b1", 6.5, 8.5),
        (1, "comm", "1B1", "send_dx", 8.5, 9.0),
    ]
    assert res.iter_time_s == pytest.approx(11.0)


def test_a_blocking_backward_receives_before_it_recomputes():
    """Under DeepSpeed the recomputation of a checkpointed layer runs inside the backward pass,
    after the gradient is received: the receive moves to the front of the backward block."""
    recv = Recv("recv_dy", 1, 1, 0, blocking=True)
    seg = Segment(("re:f",), 1.0, 0.0, 0, 0, (1.0,))
    assert receives_first((seg, recv, seg)) == (recv, seg, seg)


@pytest.mark.parametrize("schedule", [one_f_one_b, gpipe])
@pytest.mark.parametrize("p, m", [(2, 1), (3, 2), (4, 2), (4, 3), (4, 8), (5, 7), (8, 3)])
def test_blocking_sends_never_deadlock_and_cost_at_least_asynchronous_ones(schedule, p, m):
    """With fewer micro-batches than stages too, where a forward's next DeepSpeed step has no
    backward and its activation leaves at once."""
    prog = _pipeline_program(p, m, schedule, nbytes=int(0.25e9))
    free = simulate(prog, IdealCost(CostModel.load("dgx-a100-80g", 1))).iter_time_s
    blocking = simulate(prog, BlockingCost(CostModel.load("dgx-a100-80g", 1))).iter_time_s
    assert blocking >= free


def test_megatrons_1f1b_is_deepspeeds_train_schedule_and_gpipe_is_not():
    """Blocking sends meet their receives only where every stage runs DeepSpeed's order; GPipe's
    stage 2 of 4 runs its third forward before its first backward, DeepSpeed's runs it after."""
    for p, m in ((4, 3), (4, 8), (2, 1), (8, 3)):
        assert all(in_deepspeed_order(tuple(one_f_one_b(s, p, m)), p) for s in range(p))
    assert not in_deepspeed_order(tuple(gpipe(2, 4, 3)), 4)
    assert not in_deepspeed_order(tuple(zb_h1(1, 2, 4)), 2)  # 1F1B's F/B order, with W apart
