"""The simulator at scale: the Program reduced to device classes, links shared by concurrent
transfers, and gradient reductions overlapped with the backward."""

import dataclasses
import json

import pytest

from planlab.costmodel import CostModel
from planlab.costmodel.hardware import SPEC_DIR
from planlab.errors import ConfigError
from planlab.plan import Action, Block, DeviceProgram, FP32, Program, Task, TaskKind, materialize
from planlab.plan.buffer import weight, weight_grad
from planlab.plan.layout import box_numel
from planlab.plan.symmetry import plan_classes, reduce_program
from planlab.search_spaces import Context, get_space
from planlab.simulator import simulate

from conftest import traced
from test_simulator import IdealCost


def _stats(res):
    return [
        (
            d.device,
            d.members,
            d.finish_s,
            d.compute_s,
            d.comm_s,
            d.wait_s,
            d.peak_mem_bytes,
            d.peak_at_s,
            d.exposed_comm_s,
            d.bubble_s,
        )
        for d in res.devices
    ]


@pytest.mark.parametrize(
    "model, cluster, nodes, knobs",
    [
        ("gpt-tiny", "cpu", 4, dict(dp=4, tp=1, pp=1, microbatch=2)),
        ("gpt-tiny", "cpu", 4, dict(dp=2, tp=1, pp=2, microbatch=2, schedule="1f1b")),
        ("gpt-tiny", "cpu", 4, dict(dp=1, tp=2, pp=2, microbatch=1, recompute="full")),
        ("gpt-small", "dgx-a100-80g", 2, dict(dp=2, tp=4, pp=2, microbatch=1, sequence_parallel=True)),
        ("gpt-small", "dgx-a100-80g", 2, dict(dp=4, tp=2, pp=2, microbatch=2, zero=1)),
        (
            "gpt-small",
            "dgx-a100-80g",
            2,
            dict(dp=4, tp=2, pp=2, microbatch=2, schedule="interleaved", virtual_stages=2),
        ),
        ("llama-tiny", "dgx-a100-80g", 1, dict(dp=4, tp=2, pp=1, microbatch=1)),
    ],
)
def test_the_reduced_program_simulates_exactly_like_every_device(model, cluster, nodes, knobs):
    spec, g = traced(model, 16)
    cost = CostModel.load(cluster, nodes)
    ctx = Context(g, spec, 16, cluster, nodes, cost.cluster.num_devices, 1)
    plan = get_space("megatron").build(ctx, knobs)
    full = materialize(plan, g)
    reduced = materialize(plan, g, symmetric=True)
    assert reduced.reduced and len(reduced.devices) < full.num_devices == reduced.num_devices
    a, b = simulate(full, cost), simulate(reduced, cost)
    assert a.iter_time_s == b.iter_time_s  # bit for bit
    assert _stats(a) == _stats(b)
    assert simulate(reduced, cost) == b  # deterministic


def test_classes_that_do_not_hold_are_caught_by_the_witness():
    spec, g = traced("gpt-tiny", 8)
    cost = CostModel.load("cpu", 2)
    plan = get_space("megatron").build(Context(g, spec, 8, "cpu", 2, 2, 1), dict(dp=1, tp=1, pp=2, microbatch=2))
    full = materialize(plan, g)
    # pretend the two pipeline stages were copies of each other
    assert reduce_program(full, (0, 0), {0: 1}, cost.cluster.node_of) is None
    # the classes the plan gives are right: two stages, two classes
    layouts = {p.op: p for p in plan.ops}
    assert len(layouts) == len(g.operators)
    assert materialize(plan, g, symmetric=True).num_devices == 2


def test_plan_classes_of_a_data_parallel_plan_on_two_nodes():
    spec, g = traced("gpt", 16, tuple(sorted(dict(layers=1, hidden=64, heads=8, seq=16, vocab=64).items())))
    cost = CostModel.load("dgx-a100-80g", 2)
    ctx = Context(g, spec, 16, "dgx-a100-80g", 2, 16, 1)
    plan = get_space("megatron").build(ctx, dict(dp=2, tp=8, pp=1, microbatch=1))
    from planlab.plan.passes.layouts import Layouts

    classes = plan_classes(plan, Layouts(plan, g).mesh.values(), cost.cluster.node_of)
    assert sorted(set(classes)) == [0]  # tensor-parallel inside each node, replicas across nodes


def _sender_program(sends: list[tuple[int, int]], nbytes: int = 10**9) -> Program:
    """Devices 0..3; each ``(src, dst)`` is one message sent at time 0."""
    tasks = {d: [] for d in range(4)}
    for tag, (src, dst) in enumerate(sends):
        tasks[src].append(Task(f"send{tag}", TaskKind.SEND, (), (), peer=dst, tag=tag, nbytes=nbytes))
    for tag, (src, dst) in enumerate(sends):
        tasks[dst].append(Task(f"recv{tag}", TaskKind.RECV, (), (), peer=src, tag=tag, nbytes=nbytes))
    devs = tuple(DeviceProgram(d, {(0, "F"): Block(0, "F", tuple(tasks[d]))}, (Action(0, "F", 0),)) for d in range(4))
    return Program(devs, 1, FP32)


@pytest.mark.parametrize(
    "sends, seconds",
    [
        ([(0, 1)], 1.0),  # alone on its links: the cost model's time
        ([(0, 1), (0, 2)], 2.0),  # two transfers out of one device: half the bandwidth each
        ([(1, 0), (2, 0)], 2.0),  # two into one device
        ([(0, 1), (2, 3)], 1.0),  # different links: no sharing
        ([(0, 1), (0, 2), (3, 2)], 2.0),  # max-min: 0->1 and 0->2 share 0's port, 3->2 shares 2's
    ],
)
def test_concurrent_transfers_share_their_links(sends, seconds):
    cost = IdealCost(CostModel.load("cpu", 4))
    res = simulate(_sender_program(sends), cost, symmetry=False, timeline=True)
    assert res.iter_time_s == pytest.approx(seconds)
    ends = [e.end_s for e in res.events if e.stream == "comm"]
    assert max(ends) == pytest.approx(seconds)


def test_max_min_fair_rates_give_the_spare_bandwidth_to_the_unshared_flow():
    # 0->1 and 0->2 share device 0's outgoing port (half each); 3->1 shares 1's incoming port with
    # 0->1, which only uses half of it, so 3->1 runs at one half too; after 2 s all are done.
    cost = IdealCost(CostModel.load("cpu", 4))
    res = simulate(_sender_program([(0, 1), (0, 2), (3, 1)]), cost, symmetry=False, timeline=True)
    assert res.iter_time_s == pytest.approx(2.0)
    # a flow alone on one link after the others end speeds up: 1 GB, then 3 GB more, on 0->1
    res = simulate(_sender_program([(0, 1), (0, 2)], nbytes=10**9), cost, symmetry=False)
    assert res.iter_time_s == pytest.approx(2.0)


def _dp_program(reduce_s: float, overlap: bool, microbatches: int = 1) -> Program:
    """Two data-parallel devices: backward = two 1 s tasks with a gradient all-reduce between them."""
    devs = []
    for d in range(2):
        b = (
            Task("b1", TaskKind.BACKWARD, (), (), flops=1e9),
            Task(
                "grad-reduce",
                TaskKind.COLLECTIVE,
                (weight_grad("w"),),
                (weight_grad("w"),),
                collective="all_reduce",
                group=(0, 1),
                nbytes=int(reduce_s * 1e9),
                final=True,
                overlap=overlap,
                ident=0,
            ),
            Task("b2", TaskKind.BACKWARD, (), (), flops=1e9),
        )
        w = (Task("optimizer", TaskKind.OPTIMIZER, (weight_grad("w"),), (weight("w"),)),)
        sched = tuple(Action(0, "B", k) for k in range(microbatches)) + (Action(0, "U", 0),)
        devs.append(DeviceProgram(d, {(0, "B"): Block(0, "B", b), (0, "U"): Block(0, "U", w)}, sched))
    return Program(tuple(devs), microbatches, FP32)


@pytest.mark.parametrize(
    "reduce_s, overlap, microbatches, seconds, exposed",
    [
        (0.5, True, 1, 2.0, 0.0),  # hidden behind b2: costs nothing extra
        (0.5, False, 1, 2.5, 0.5),  # in the way of the backward
        (1.5, True, 1, 2.5, 0.5),  # longer than what is left to hide it: the optimizer waits 0.5 s
        (0.5, True, 3, 6.0, 0.0),  # issued with the last micro-batch only
        (0.5, False, 3, 6.5, 0.5),
    ],
)
def test_an_overlapped_gradient_reduction_hides_behind_the_backward(reduce_s, overlap, microbatches, seconds, exposed):
    cost = IdealCost(CostModel.load("cpu", 2))
    res = simulate(_dp_program(reduce_s, overlap, microbatches), cost, symmetry=False)
    assert res.iter_time_s == pytest.approx(seconds)
    assert res.devices[0].exposed_comm_s == pytest.approx(exposed)
    assert res.devices[0].comm_s == pytest.approx(reduce_s)


def test_compute_sharing_the_device_with_communication_slows_down():
    cost = IdealCost(CostModel.load("cpu", 2))
    res = simulate(_dp_program(0.5, True), cost, symmetry=False, overlap_slowdown=1.2)
    # b2 advances at 1/1.2 while the 0.5 s reduction runs beside it: 0.5 / 1.2 s of its 1 s, the rest alone
    assert res.iter_time_s == pytest.approx(1.0 + 0.5 + (1.0 - 0.5 / 1.2))


def test_a_collective_starting_during_a_computation_slows_the_rest_of_it():
    # device 1 straggles (1.5x): the reduction starts at 1.5 s, when device 1 issues it, while
    # device 0 is half-way through b2 (from 1.0 s); both devices' b2 slow down from 1.5 s to 2.0 s
    cost = IdealCost(CostModel.load("cpu", 2))
    res = simulate(_dp_program(0.5, True), cost, symmetry=False, stragglers={1: 1.5}, overlap_slowdown=1.2)
    finish = {d.device: d.finish_s for d in res.devices}
    assert finish[0] == pytest.approx(2.0 + (0.5 - 0.5 / 1.2))
    assert finish[1] == pytest.approx(2.0 + (1.5 - 0.5 / 1.2))
    assert res.devices[0].comm_s == pytest.approx(0.5)


class _CopyOutCost(IdealCost):
    def copy_out_s(self, task):
        return 0.2  # of each overlapped collective's 0.5 s, run on the compute stream once it is done


def test_a_copy_out_runs_on_the_compute_stream_after_its_collective():
    res = simulate(_dp_program(0.5, True), _CopyOutCost(CostModel.load("cpu", 2)), symmetry=False)
    # the reduction's 0.3 s on the communication stream hides behind b2 (1 s to 2 s); its 0.2 s
    # copy-out then runs before the optimizer
    assert res.iter_time_s == pytest.approx(2.2)
    assert res.devices[0].comm_s == pytest.approx(0.3)
    torch = CostModel.load("dgx-a100-80g", 2, software="torch")
    gather = _dp_program(0.5, True).devices[0].blocks[(0, "B")].tasks[1]
    assert torch.copy_out_s(gather) == 0.0  # an all-reduce: DDP's buckets are not copied
    gather = dataclasses.replace(gather, collective="all_gather", group=tuple(range(16)))
    assert torch.copy_out_s(gather) == pytest.approx(torch.buffer_copies_s("all_gather", gather.nbytes, 16))
    assert CostModel.load("dgx-a100-80g", 2, software="deepspeed").copy_out_s(gather) == 0.0


def test_a_dgx_a100_computes_on_the_sms_its_collectives_leave(tmp_path):
    # NCCL takes 16 of an A100's 108 SMs on a DGX with 8 NICs (nccl issue 689): 108 / 92
    for name in ("dgx-a100-80g", "dgx-a100-40g"):
        assert CostModel.load(name, 2).overlap_slowdown == pytest.approx(108 / 92)
    assert CostModel.load("dgx-h100", 2).overlap_slowdown == 1.0  # not stated: none
    spec = json.loads((SPEC_DIR / "dgx-a100-80g.json").read_text())
    path = tmp_path / "cluster.json"
    spec["collective_sms"] = 108
    path.write_text(json.dumps(spec))
    with pytest.raises(ConfigError, match="collective_sms.*is 108; expected fewer than the device's SMs"):
        CostModel.load(path, 2)


def test_materialized_data_parallel_plans_overlap_their_gradient_buckets(monkeypatch):
    import importlib

    mat = importlib.import_module("planlab.plan.passes.gradients")
    monkeypatch.setattr(mat, "BUCKET_ELEMENTS", 5000)  # gpt-tiny's 100k parameters in several buckets
    spec, g = traced("gpt-tiny", 8)
    plan = get_space("megatron").build(Context(g, spec, 8, "cpu", 2, 2, 1), dict(dp=2, tp=1, pp=1, microbatch=2))
    prog = materialize(plan, g)
    b = prog.devices[0].blocks[(0, "B")].tasks
    reduces = [i for i, t in enumerate(b) if t.kind is TaskKind.COLLECTIVE and t.name.startswith("grad-reduce")]
    assert reduces and all(b[i].final and b[i].overlap for i in reduces)
    # each bucket is issued right after the backward that completes it, before the backward ends
    assert reduces[0] < max(i for i, t in enumerate(b) if t.kind is TaskKind.BACKWARD)
    assert not any(t.kind is TaskKind.COLLECTIVE for t in prog.devices[0].blocks[(0, "U")].tasks)
    assert len(reduces) > 3
    # each gradient is reduced once, in the last micro-batch only, the position embedding's among them
    # (its gradient stays a partial sum over dp until then: planlab.plan.partial_grads)
    reduced = [r for a, t in prog.devices[0].tasks_in_order() if t.name.startswith("grad-reduce") for r in t.reads]
    numel = dict((weight_grad(p), box_numel(bx)) for p, bx in prog.devices[0].params)
    assert len(reduced) == len(set(reduced)) == len(numel) and weight_grad("wpe.weight") in reduced
    assert sum(b[i].nbytes for i in reduces) == 4 * sum(numel[r] for r in reduced)
