"""Symmetry for any plan: the Program reduced to device classes simulates like every device.

64-device versions of the plans whose operators sit on different meshes (an interlaced pipeline
with the embedding and the output layer over every device, alpa's pp 2 x tp 8 stage meshes, 3f1b)
and of a Megatron grid: the reduced Program (one representative per class) and the full one,
simulated device by device (``symmetry=False``), give the same iteration time and the same peak
memory on every device.

The training software is planlab's: with Megatron-LM's host model (``host_bound`` kernels) a
collective inside one class is lowered into the segment around it while the full simulation
meets it apart, which moves the host's issue times (a difference of the simulator's lowering, not
of the classes; see planlab.plan.symmetry).
"""

import pytest

from planlab.costmodel import CostModel
from planlab.plan.program import TaskKind
from planlab.plan.software_passes import build_program
from planlab.search_spaces import Context, get_space
from planlab.simulator import simulate

from conftest import traced

GPT = (("heads", 8), ("hidden", 128), ("layers", 4), ("seq", 32), ("vocab", 512), ("vocab_parallel", 1))
EVOFORMER = (("blocks", 4), ("recycles", 3))
# The interlaced plan's full simulation exchanges vocabulary pieces between every pair of devices:
# priced in closed form (planlab.simulator.exchange) it takes about a second, flow by flow it took 25 minutes.
INTERLACED = (
    "gpt",
    GPT,
    8,
    "interlaced",
    dict(pp=4, tp=8, dp=2, microbatch=1, embed_layout="vocab", head_layout="vocab"),
)
CASES = [
    INTERLACED,
    ("gpt", GPT, 8, "alpa", dict(pp=2, tp=8, microbatch=1)),
    ("evoformer-tiny", EVOFORMER, 64, "3f1b", dict(pp=4, dp=16, tp=1, microbatch=1)),
    ("gpt", GPT, 8, "megatron", dict(pp=4, tp=8, dp=2, microbatch=1)),
]
NODES = 8  # DGX A100 nodes: 64 devices


def _plan(model, args, batch, space, knobs):
    spec, g = traced(model, batch, args)
    cost = CostModel.load("dgx-a100-80g", NODES, software="planlab")
    ctx = Context(g, spec, batch, "dgx-a100-80g", NODES, cost.cluster.num_devices, 8)
    return get_space(space).build(ctx, knobs), g, cost


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.slow
@pytest.mark.parametrize("model, args, batch, space, knobs", CASES, ids=["interlaced", "alpa", "3f1b", "megatron"])
def test_the_reduced_program_simulates_like_every_device_on_64_devices(model, args, batch, space, knobs):
    plan, g, cost = _plan(model, args, batch, space, knobs)
    reduced = build_program(plan, g, cost, symmetric=True)
    full = build_program(plan, g, cost, symmetric=False)
    assert reduced.reduced and len(reduced.devices) <= 8 < full.num_devices == reduced.num_devices == 64
    a = _simulate_alike(reduced, full, cost)
    assert sum(d.members for d in a.devices) == 64


def _simulate_alike(reduced, full, cost):
    """The reduced Program's simulation, checked against the full one's: the same iteration time and
    per device the same peak memory as its class's representative."""
    assert cost.overlap_slowdown > 1.0  # DGX A100: computation beside a collective runs on 92 of 108 SMs
    a, b = simulate(reduced, cost), simulate(full, cost, symmetry=False)
    assert _rel(a.iter_time_s, b.iter_time_s) <= 1e-9
    peak = {d.device: d.peak_mem_bytes for d in a.devices}
    for d in b.devices:
        assert _rel(peak[reduced.classes[d.device]], d.peak_mem_bytes) <= 1e-9, d.device
    return a


def test_every_receiver_copies_its_own_piece_after_it_has_received_the_others():
    plan, g, cost = _plan(*INTERLACED)
    program = build_program(plan, g, cost, symmetric=False)
    seen = 0
    for dp in program.devices:
        for block in dp.blocks.values():
            by_buffer: dict = {}
            for t in block.tasks:
                if t.kind in (TaskKind.LOCAL, TaskKind.RECV) and t.writes:
                    by_buffer.setdefault(t.writes[0], []).append(t.kind)
            for kinds in by_buffer.values():
                if TaskKind.LOCAL in kinds and TaskKind.RECV in kinds:
                    seen += 1
                    first_copy = kinds.index(TaskKind.LOCAL)
                    assert TaskKind.RECV not in kinds[first_copy:], (dp.device, kinds)
    assert seen  # the embedding's pieces summed on their way to the first layer stage


def test_megatron_partitions_pipeline_messages_alike_in_the_full_and_the_reduced_program():
    """Megatron-LM's pipeline messages travel in tp parts, each receive followed by an all-gather:
    decided from what the tensor-parallel peers receive (not the messages' own tags), so the full
    Program is partitioned as its reduced twin is."""
    spec, g = traced("gpt", 8, GPT)
    cost = CostModel.load("dgx-a100-80g", 2, software="megatron")
    ctx = Context(g, spec, 8, "dgx-a100-80g", 2, cost.cluster.num_devices, 8)
    plan = get_space("megatron").build(ctx, dict(pp=2, tp=4, dp=2, microbatch=1))
    reduced = build_program(plan, g, cost, symmetric=True)
    full = build_program(plan, g, cost, symmetric=False)

    def messages(program, d):
        tasks = [t for b in program.device(d).blocks.values() for t in b.tasks]
        gathers = sum(t.name.endswith(":gather") for t in tasks)
        return gathers, sorted(t.nbytes for t in tasks if t.kind in (TaskKind.SEND, TaskKind.RECV))

    assert reduced.reduced
    for d in range(full.num_devices):
        assert messages(full, d) == messages(reduced, d)
    assert messages(full, 0)[0] > 0


def test_a_dualpipe_plan_reduces_to_its_pipeline_ranks_and_simulates_like_every_device():
    """DualPipe's mirrored ranks r and pp - 1 - r hold the same two stages in opposite directions and
    look alike by their meshes, but the middle pair message each other: the classes keep them apart
    (one class per pipeline rank, the data-parallel replicas merged), and the reduced Program
    simulates as the full one does."""
    spec, g = traced("gpt", 8, GPT)
    cost = CostModel.load("dgx-a100-80g", 2, software="planlab")
    ctx = Context(g, spec, 8, "dgx-a100-80g", 2, cost.cluster.num_devices, 8)
    plan = get_space("megatron").build(ctx, dict(pp=4, tp=1, dp=4, microbatch=2, schedule="dualpipe"))
    reduced = build_program(plan, g, cost, symmetric=True)
    full = build_program(plan, g, cost, symmetric=False)
    assert reduced.reduced and len(reduced.devices) == 4 < full.num_devices == 16
    _simulate_alike(reduced, full, cost)


def test_an_fsdp2_plan_simulates_alike_reduced_and_full():
    """FSDP2 (software ``torch``) under pipeline parallelism: its gathers and reduce-scatters
    overlap computation (slowed beside them) and each gather's copy-out runs on the compute stream
    where the computation waits for it, the same on every member of a class. (A model with a
    collective inside one class that blocks the device, such as gpt's vocabulary-parallel loss, would
    meet the host model's difference described above.)"""
    spec, g = traced("llama-tiny", 8)
    cost = CostModel.load("dgx-a100-80g", 2, software="torch")
    ctx = Context(g, spec, 8, "dgx-a100-80g", 2, cost.cluster.num_devices, 8)
    plan = get_space("megatron").build(ctx, dict(pp=2, tp=1, dp=8, microbatch=1, zero=3))
    reduced = build_program(plan, g, cost, symmetric=True)
    full = build_program(plan, g, cost, symmetric=False)
    assert reduced.reduced and len(reduced.devices) == 2 < full.num_devices == 16
    assert any(cost.copy_out_s(t) > 0 for dp in reduced.devices for b in dp.blocks.values() for t in b.tasks)
    a = _simulate_alike(reduced, full, cost)
    assert sum(d.members for d in a.devices) == 16


@pytest.mark.parametrize("model, args, batch, space, knobs", CASES[2:], ids=["3f1b", "megatron"])
def test_a_witness_built_without_allocations_compares_as_one_built_whole(model, args, batch, space, knobs):
    """A symmetric build assembles its witnesses bare, their lifetimes apart (``assemble_bare``): each
    witness's outline, and so the reduced Program, is what the witness assembled whole gives."""
    from planlab.plan.materialize import precision_for, run_passes
    from planlab.plan.passes.draft import Draft
    from planlab.plan.passes.layouts import Layouts
    from planlab.plan.passes.liveness import assemble, assemble_bare
    from planlab.plan.symmetry import _outline, plan_classes, reduce_program

    plan, g, cost = _plan(model, args, batch, space, knobs)
    node_of = cost.cluster.node_of
    layouts = Layouts(plan, g)
    classes = plan_classes(plan, layouts.mesh.values(), node_of)
    witnesses = {c: d for d, c in enumerate(classes) if d != c}
    bare_devices = frozenset(witnesses.values())
    keep = frozenset(classes) | bare_devices
    draft = run_passes(Draft.start(plan, g, layouts, precision_for(plan.cluster), keep=keep, overlap=True))
    whole = assemble(draft)
    bare, lives = assemble_bare(draft, bare_devices)
    assert witnesses and set(lives) == bare_devices
    for w, b in zip(whole.devices, bare.devices):
        if w.device not in bare_devices:
            assert b == w
            continue
        tasks = [t for blk in b.blocks.values() for t in blk.tasks]
        assert not any(t.alloc or t.free for t in tasks)
        assert any(t.alloc for blk in w.blocks.values() for t in blk.tasks)
        assert _outline(b, classes, node_of, {}, lives[w.device]) == _outline(w, classes, node_of, {})
    reduced = reduce_program(whole, classes, witnesses, node_of)
    assert reduced is not None and reduce_program(bare, classes, witnesses, node_of, lives) == reduced
    # a witness whose lifetimes differed from its representative's is told apart
    w = min(bare_devices)
    allocs, frees = lives[w]
    first = min(allocs)
    wrong = {**lives, w: ({**allocs, first: allocs[first][1:]}, frees)}
    assert reduce_program(bare, classes, witnesses, node_of, wrong) is None
