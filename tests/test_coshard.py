"""Co-located pieces (nnScaler's coshard): the plan's placement checked, the chunk tasks and their
order against golden text, the collectives of the tensor-parallel plan a coshard plan refines,
the simulated peak memory against a hand count, the ``coshard`` space, and plans of swin-tiny
and gpt-tiny on 2 gloo ranks against one process."""

import dataclasses
from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from planlab.cli import GRAD_TOL, LOSS_TOL
from planlab.costmodel import CostModel
from planlab.errors import ConfigError, InfeasiblePlan
from planlab.executor import launch_local
from planlab.graph import trace
from planlab.models import ModelSpec, build_model
from planlab.plan import PlanBuilder, load_plan, materialize, save_plan
from planlab.plan.buffer import BufferKind
from planlab.plan.program import TaskKind
from planlab.search_spaces import Context, get_space
from planlab.simulator import find_deadlock, simulate

from conftest import traced

HERE = __name__  # this module, as the model function's package path


class MLP(nn.Module):
    """fc1 (column-parallel), GELU, fc2 (row-parallel), cross-entropy: coshard's smallest case."""

    def __init__(self, h: int = 4, f: int = 16, c: int = 4) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(h, f), nn.GELU(), nn.Linear(f, c)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.fc2(self.act(self.fc1(x))), y)  # x: (B, h) -> (B, f) -> (B, c)


def mlp():
    return MLP(), (torch.randn(8, 4), torch.randint(0, 4, (8,)))


SPLIT = {"fc1": "n", "act": "a1", "fc2": "k"}  # the hidden dimension in each operator's signature


def _mlp_graph():
    spec = ModelSpec(f"{HERE}:mlp")
    model, inputs = build_model(spec, batch=8)
    return spec, trace(model, inputs)


def mlp_plan(devices: int, k: int, *, recompute: bool = True, placement=None):
    """fc1, act and fc2 split into ``k * devices`` pieces, ``k`` on each device; the rest replicated."""
    spec, g = _mlp_graph()
    b = PlanBuilder(g, model=spec, global_batch=8, cluster="cpu", nodes=devices, num_devices=devices)
    for op in g.operators:
        if op.name in SPLIT:
            b.op_trans(op.name, SPLIT[op.name], k * devices)
            b.op_assign(op.name, placement or [d for d in range(devices) for _ in range(k)])
            if recompute:
                b.recompute(op.name, 1)
        else:
            b.op_trans(op.name, None, devices)
            b.op_assign(op.name, list(range(devices)))
    return b.build(), g


# ---- the plan's placement -----------------------------------------------------------------


@pytest.mark.parametrize(
    "splits, devices, message",
    [
        (
            [("n", 4)],
            [0, 1, 0, 1],
            "device 0 holds pieces [0, 2] of the 4 along mesh axis 0; co-located pieces must "
            "be 2 consecutive ones, e.g. devices [0, 0, 1, 1]",
        ),
        ([("n", 4)], [0, 0, 0, 1], "devices hold 1 or 3 pieces; co-located pieces must be as many on every device"),
        ([(None, 2), ("n", 2)], [0, 0, 0, 0], "a device's pieces differ along mesh axes [0, 1]"),
        ([(None, 4)], [0, 0, 1, 1], "2 replicas on one device; co-located pieces must split a dimension"),
        ([("n", 2), ("n", 2)], [0, 1, 0, 1], "mesh axis 1 splits dimension 'n' again inside the co-located pieces"),
        ([("n", 2), ("n", 2)], [0, 0, 1, 1], ""),  # the same as op_trans(fc1, n, 4) on [0, 0, 1, 1]
        ([(None, 2), ("n", 2)], [0, 0, 1, 1], ""),  # two replicas, each as two pieces on its device
    ],
)
def test_malformed_co_locations_are_refused_naming_operator_and_devices(splits, devices, message):
    spec, g = _mlp_graph()
    b = PlanBuilder(g, model=spec, global_batch=8, cluster="cpu", nodes=2, num_devices=2)
    for dim, n in splits:
        b.op_trans("fc1", dim, n)
    if not message:
        b.op_assign("fc1", devices)
        return
    with pytest.raises(InfeasiblePlan) as e:
        b.op_assign("fc1", devices)
    assert str(e.value).startswith(f"operator 'fc1' on devices {devices}: {message}")


def test_materialize_refuses_a_malformed_plan_file(tmp_path):
    plan, g = mlp_plan(2, 2)
    save_plan(plan, tmp_path / "plan.json")
    plan = load_plan(tmp_path / "plan.json")
    assert plan.op_plan("fc1").devices == (0, 0, 1, 1)  # the primitives alone carry the co-location
    ops = tuple(dataclasses.replace(p, devices=(0, 1, 1, 0)) if p.op == "act" else p for p in plan.ops)
    with pytest.raises(InfeasiblePlan, match=r"^operator 'act' on devices \[0, 1, 1, 0\]: device 0 holds pieces"):
        materialize(dataclasses.replace(plan, ops=ops), g)


# ---- chunk tasks and their order ------------------------------------------------------------

GOLDEN_MLP_TP2_K2 = """\
0F0 L:load:x
0F0 F:fc1@0
0F0 F:act@0
0F0 F:fc2@0
0F0 F:fc1@1
0F0 F:act@1
0F0 F:fc2@1
0F0 C:all_reduce(fc2:all_reduce0)@[0, 1]
0F0 L:load:y
0F0 F:cross_entropy
0B0 B:cross_entropy
0B0 F:re:fc1@0
0B0 F:re:act@0
0B0 F:re:fc2@0
0B0 B:fc2@0
0B0 B:act@0
0B0 B:fc1@0
0B0 F:re:fc1@1
0B0 F:re:act@1
0B0 F:re:fc2@1
0B0 B:fc2@1
0B0 B:act@1
0B0 B:fc1@1
0B0 C:all_reduce(grad-reduce[0, 1]#fc2.bias)@[0, 1]
0U0 O:optimizer"""


def test_chunks_run_in_turn_each_recomputed_before_its_backward():
    """Each device's two pieces run fc1, act, fc2 for chunk 0, then for chunk 1; fc2's partial
    sums add up locally and one all-reduce (the tensor-parallel plan's) sums the devices."""
    plan, g = mlp_plan(2, 2)
    prog = materialize(plan, g)
    find_deadlock(prog)
    assert "\n".join(f"{a} {t}" for a, t in prog.devices[0].tasks_in_order()) == GOLDEN_MLP_TP2_K2
    tasks = {t.name: t for _, t in prog.devices[1].tasks_in_order() if t.kind is not TaskKind.BACKWARD}
    # device 1 holds hidden units 8..16: its chunks are 8..12 and 12..16 of fc1's weight rows
    assert tasks["fc1@0"].slices == (None, ((0, 4), (0, 4)), ((0, 4),))
    assert tasks["fc1@1"].slices == (None, ((4, 8), (0, 4)), ((4, 8),))
    assert tasks["fc2@1"].places == ((((0, 8), (0, 4)), (8, 4)),)  # a partial sum of the whole output
    first = {t.name: t for _, t in prog.devices[0].tasks_in_order() if t.kind is not TaskKind.BACKWARD}
    # fc2's bias is added once: by device 0's first chunk
    assert [first["fc2@0"].lead, first["fc2@1"].lead, tasks["fc2@0"].lead, tasks["fc2@1"].lead] == [
        True,
        False,
        False,
        False,
    ]
    assert tasks["fc1@0"].recompute == "drop" and tasks["re:fc1@0"].recompute == "redo"


def test_zero3_chunks_remade_in_the_backward_read_the_backward_gather():
    """ZeRO-3 frees a unit's forward gather after the forward: a co-located chunk remade before its
    backward reads the backward's gather, and no task of the backward reads or frees a forward gather
    (one freed there took the storage from under the remade chunks' graphs: fuzz_plans.py plan 44)."""
    spec, g = traced("gpt-tiny", 8)
    knobs = dict(dp=2, microbatch=2, zero=3, coshard=2, coshard_blocks="attention")
    prog = materialize(get_space("dp*coshard").build(Context(g, spec, 8, "cpu", 2, 2, 1), knobs), g)
    find_deadlock(prog)
    for dev in prog.devices:
        for (_, phase), block in dev.blocks.items():
            for t in block.tasks:
                forward_gathers = [str(b) for b in (*t.reads, *t.free) if str(b).startswith("zf:")]
                assert phase == "F" or not forward_gathers, (t.name, forward_gathers)
        remade = [t for _, t in dev.tasks_in_order() if t.name.startswith("re:blocks_0_attn_q@")]
        assert len(remade) == 2 * 2  # 2 chunks, 2 micro-batches
        assert all("zb:blocks.0.attn.q.weight" in map(str, t.reads) for t in remade)


@pytest.mark.parametrize(
    "model_args, knobs",
    [
        ((("num_heads", "4,8,16"),), dict(dp=1, tp=2, k=2)),
        ((("num_heads", "4,8,16"),), dict(dp=2, tp=1, k=4)),
    ],
)
def test_swin_chunk_and_recompute_tasks_per_device_and_unchanged_collectives(model_args, knobs):
    spec, g = traced("swin-tiny", 8, model_args)
    ctx = Context(g, spec, 8, "cpu", 2, 2, 1)
    base = dict(dp=knobs["dp"], tp=knobs["tp"], pp=1, microbatch=8 // knobs["dp"])
    k = knobs["k"]
    progs = {c: materialize(get_space("megatron*coshard").build(ctx, dict(base, coshard=c)), g) for c in (1, k)}
    attention = [op for op in g.operators if ".attn" in op.module]
    assert len(attention) == 6 * 22 + 2 * 3  # 6 blocks of 22 operators, 3 more in the 2 that shift windows
    for dev in (0, 1):
        plain = [t for _, t in progs[1].devices[dev].tasks_in_order()]
        tasks = [t for _, t in progs[k].devices[dev].tasks_in_order()]
        kinds = Counter((t.kind, t.recompute) for t in tasks if t.chunk >= 0 and t.kind is not TaskKind.COLLECTIVE)
        backward = sum(t.kind is TaskKind.BACKWARD and t.op in {op.name for op in attention} for t in plain)
        assert kinds == {
            (TaskKind.FORWARD, "drop"): k * len(attention),
            (TaskKind.FORWARD, "redo"): k * len(attention),
            (TaskKind.BACKWARD, ""): k * backward,
        }
        assert {t.chunk for t in tasks if t.chunk >= 0} == set(range(k))
        # the plain plan's collectives, in its order, and none run per chunk; under data parallelism
        # the gradient of each position-bias gather (no batch axis: a partial sum over the replicas)
        # stays partial through the chunks, as in the plain plan (planlab.plan.partial_grads), and
        # the bias tables are reduced with the other weights once a step: no per-micro-batch all-reduce
        chunked = [t for t in tasks if t.kind is TaskKind.COLLECTIVE and t.chunk >= 0]
        assert chunked == []
        if knobs["dp"] > 1:
            for p in (progs[1], progs[k]):
                backward = p.devices[dev].blocks[(0, "B")].tasks
                assert not [
                    t for t in backward if t.kind is TaskKind.COLLECTIVE and not t.name.startswith("grad-reduce")
                ]
        for key, block in progs[1].devices[dev].blocks.items():
            mine = [t for t in progs[k].devices[dev].blocks[key].tasks if t.kind is TaskKind.COLLECTIVE]
            theirs = [t for t in block.tasks if t.kind is TaskKind.COLLECTIVE]
            assert list(dict.fromkeys((t.collective, t.group, t.name.split("@")[0]) for t in mine)) == [
                (t.collective, t.group, t.name) for t in theirs
            ]
            assert sum(t.nbytes for t in mine) == sum(t.nbytes for t in theirs)


# ---- memory -----------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_peak_activation_memory_falls_with_k_as_counted_by_hand(k):
    """One device, fp32; B=8 samples, h=4, f=16 hidden units, c=4 classes. In bytes: x 128,
    labels 64, fc2's output and its gradient 128 each, fc1's and act's outputs 512 / k per chunk
    (and their gradients). The backward holds x and fc2's gradient (256) throughout; chunk c
    then holds its recomputed fc1 and act outputs (1024 / k), and either fc2's recomputed partial
    sum (128: 384 + 1024 / k) or the gradient of act's output (512 / k: 256 + 1536 / k). Before
    that, cross-entropy's backward holds x, fc2's output, the labels and fc2's gradient (448).
    The forward holds less (at most 256 + 1024 / k). With k = 1 the three operators are one
    piece recomputed as a layer, the same count."""
    plan, g = mlp_plan(1, k)
    prog = materialize(plan, g)
    assert prog.devices[0].static_bytes == 148 * 16  # 148 parameters: weight, gradient, 2 Adam moments
    res = simulate(prog, CostModel.load("cpu", 1))
    assert res.peak_mem_bytes - prog.devices[0].static_bytes == max(256 + 1536 // k, 384 + 1024 // k, 448)


def test_chunks_without_recompute_keep_every_chunks_activations():
    peaks = {}
    for rc in (False, True):
        plan, g = mlp_plan(1, 4, recompute=rc)
        prog = materialize(plan, g)
        tasks = [t for _, t in prog.devices[0].tasks_in_order()]
        assert sum(t.recompute == "redo" for t in tasks) == (12 if rc else 0)
        peaks[rc] = simulate(prog, CostModel.load("cpu", 1)).peak_mem_bytes
    assert peaks[True] < peaks[False]


# ---- the space --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fixed, message",
    [
        (
            dict(tp=2, coshard=4, coshard_blocks="attention"),
            "tp=2 x coshard=4 does not divide the model's 2 attention heads",
        ),
        (
            dict(tp=2, coshard=2, coshard_blocks="both"),
            "tp=2 x coshard=2 does not divide the model's 2 attention heads",
        ),
        (
            dict(tp=1, coshard=1, coshard_blocks="mlp"),
            "coshard=1 co-shards nothing, so coshard_blocks='mlp' has no effect",
        ),
    ],
)
def test_space_refuses_what_does_not_divide(fixed, message):
    spec, g = traced("swin-tiny", 8)  # heads 2, 4, 8
    ctx = Context(g, spec, 8, "cpu", 2, 2, 1)
    with pytest.raises(ConfigError, match=message):
        get_space("megatron*coshard").build(ctx, dict(dict(dp=2 // fixed["tp"], pp=1, microbatch=1), **fixed))
    with pytest.raises(ConfigError, match="coshard=3 is not valid here: knob 'coshard' takes 1, 2, 4 or 8"):
        list(get_space("dp*coshard").assignments(ctx, dict(coshard=3, coshard_blocks="mlp")))
    # the MLP's hidden units split further than the heads
    assert get_space("megatron*coshard").build(
        ctx, dict(dp=1, tp=2, pp=1, microbatch=8, coshard=8, coshard_blocks="mlp")
    )


def test_space_co_shards_the_chosen_blocks_and_composes():
    spec, g = traced("gpt-tiny", 8)
    ctx = Context(g, spec, 8, "cpu", 2, 2, 1)
    sp = get_space("dp*tp*coshard")
    assert [k.name for k in sp.all_knobs()] == [
        "dp",
        "microbatch",
        "zero",
        "tp",
        "sequence_parallel",
        "coshard",
        "coshard_blocks",
        "coshard_outputs",
        "coshard_remade_percent",
    ]
    # tp=2 and 4 heads: coshard 1; 2 on the attention, the MLP or both; 4 or 8 on the MLP only
    assert [
        (a["coshard"], a["coshard_blocks"])
        for a in sp.assignments(ctx, {"dp": 1, "microbatch": 8, "sequence_parallel": False})
    ] == [(1, "attention"), (2, "attention"), (2, "mlp"), (2, "both"), (4, "mlp"), (8, "mlp")]
    for part, where in (("attention", ".attn"), ("mlp", ".mlp"), ("both", "")):
        plan = sp.build(ctx, dict(dp=1, tp=2, microbatch=8, coshard=2, coshard_blocks=part))
        co = {p.op for p in plan.ops if len(set(p.devices)) < len(p.devices)}
        assert co and all(where in g.op(o).module for o in co)
        assert all(plan.op_plan(o).devices == (0, 0, 1, 1) and plan.op_plan(o).recompute for o in co)


# ---- numerics on 2 gloo ranks -----------------------------------------------------------


@pytest.mark.parametrize(
    "model, model_args, knobs",
    [
        (
            "swin-tiny",
            (("num_heads", "4,8,16"),),
            dict(dp=1, tp=2, pp=1, microbatch=4, coshard=2, coshard_blocks="both", recompute="full"),
        ),
        (
            "swin-tiny",
            (("num_heads", "4,8,16"),),
            dict(dp=2, tp=1, pp=1, microbatch=2, coshard=4, coshard_blocks="attention"),
        ),
        ("gpt-tiny", (), dict(dp=1, tp=1, pp=2, microbatch=2, coshard=4, coshard_blocks="both")),
        # the co-sharded results made again in the layer's recomputation (a checkpoint nested in the layer's)
        (
            "swin-tiny",
            (("num_heads", "4,8,16"),),
            dict(
                dp=1,
                tp=2,
                pp=1,
                microbatch=4,
                coshard=2,
                coshard_blocks="both",
                recompute="full",
                coshard_outputs="recompute",
            ),
        ),
        (
            "gpt-tiny",
            (),
            dict(
                dp=2,
                tp=1,
                pp=1,
                microbatch=2,
                coshard=2,
                coshard_blocks="attention",
                recompute="full",
                coshard_outputs="recompute",
            ),
        ),
        # some layers remake them, the others keep them
        (
            "swin-tiny",
            (("num_heads", "4,8,16"),),
            dict(
                dp=2,
                tp=1,
                pp=1,
                microbatch=2,
                coshard=2,
                coshard_blocks="attention",
                recompute="full",
                coshard_outputs="recompute",
                coshard_remade_percent=25,
            ),
        ),
        # ZeRO-3: the chunks remade in the backward read the backward's gathered weights (the forward's
        # are freed after the forward), as each chunk's backward does (fuzz_plans.py plan 44 of seed 0)
        ("gpt-tiny", (), dict(dp=2, tp=1, pp=1, microbatch=2, zero=3, coshard=2, coshard_blocks="attention")),
    ],
)
def test_coshard_plans_match_one_process(model, model_args, knobs):
    spec, g = traced(model, 8, model_args)
    plan = get_space("megatron*coshard").build(Context(g, spec, 8, "cpu", 2, 2, 1), knobs)
    prog = materialize(plan, g)
    res = launch_local(plan, 2, steps=2, lr=1e-2, record=True)
    assert res.max_loss_error <= LOSS_TOL, (res.losses, res.ref_losses)
    assert res.max_grad_error <= GRAD_TOL
    assert res.losses[1] < res.losses[0]
    if knobs["dp"] > 1:  # Swin's position-bias gradients stay partial through the chunks: no all-reduce per chunk
        assert not [
            t.name for _, t in prog.devices[0].tasks_in_order() if t.kind is TaskKind.COLLECTIVE and t.chunk >= 0
        ]
    for dev in (0, 1):  # every chunk task ran, and the collectives the program issues
        ran = Counter(t["kind"] for t in res.timeline if t["device"] == dev)
        want = Counter(t.kind.value for _, t in prog.devices[dev].tasks_in_order())
        assert ran == want  # collectives, sends and receives included
        assert (
            sum("@" in t["task"] for t in res.timeline if t["device"] == dev)
            == sum(t.chunk >= 0 for _, t in prog.devices[dev].tasks_in_order())
            > 0
        )


def test_selective_recompute_is_not_a_second_row_of_a_coshard_attention_plan():
    spec, g = traced("gpt-tiny", 8)
    ctx = Context(g, spec, 8, "cpu", 2, 2, 1)
    sp = get_space("megatron*coshard")
    rows = sp.enumerate(ctx, {"dp": 1, "tp": 2, "pp": 1, "microbatch": 8})
    recomputes = {(r["coshard"], r["coshard_blocks"]): set() for r in rows}
    for r in rows:
        recomputes[(r["coshard"], r["coshard_blocks"])].add(r["recompute"])
    assert recomputes[(1, "attention")] == {"none", "selective", "full"}
    assert recomputes[(2, "attention")] == recomputes[(2, "both")] == {"none", "full"}
    assert recomputes[(2, "mlp")] == {"none", "selective", "full"}
    with pytest.raises(ConfigError, match="recompute='selective' adds nothing"):
        sp.build(
            ctx, dict(dp=1, tp=2, pp=1, microbatch=8, coshard=2, coshard_blocks="attention", recompute="selective")
        )


def test_sequence_parallelism_is_refused_where_it_splits_nothing():
    spec, g = traced("swin-tiny", 8, (("num_heads", "4,8,16"),))
    ctx = Context(g, spec, 8, "cpu", 2, 2, 1)
    with pytest.raises(ConfigError, match="sequence_parallel=True would split nothing"):
        get_space("megatron").build(ctx, dict(dp=1, tp=2, pp=1, microbatch=8, sequence_parallel=True))
    assert {r["sequence_parallel"] for r in get_space("megatron").enumerate(ctx, {"tp": 2})} == {False}
    spec, g = traced("gpt-tiny", 8)
    gctx = Context(g, spec, 8, "cpu", 2, 2, 1)
    assert {r["sequence_parallel"] for r in get_space("megatron").enumerate(gctx, {"tp": 2})} == {False, True}


# ---- coshard_outputs: the co-sharded results kept, or made again in the layer's recomputation ----


def test_remade_outputs_are_not_kept_from_the_forward_and_cost_one_more_forward():
    spec, g = traced("swin-tiny", 8, (("num_heads", "4,8,16"),))
    ctx = Context(g, spec, 8, "cpu", 2, 2, 1)
    base = dict(dp=1, tp=2, pp=1, microbatch=8, coshard=2, coshard_blocks="attention", recompute="full")
    progs = {
        o: materialize(get_space("megatron*coshard").build(ctx, dict(base, coshard_outputs=o)), g)
        for o in ("keep", "recompute")
    }
    attention = {op.name for op in g.operators if ".attn" in op.module}
    for dev in (0, 1):
        tasks = {o: [(a, t) for a, t in progs[o].devices[dev].tasks_in_order()] for o in progs}
        kinds = {
            o: Counter(
                (a.phase, t.kind, t.recompute) for a, t in tasks[o] if t.chunk >= 0 and t.kind is TaskKind.FORWARD
            )
            for o in progs
        }
        # one more chunked forward of every attention operator, in the backward, keeping no graph
        assert kinds["recompute"][("B", TaskKind.FORWARD, "drop")] == 2 * len(attention)
        assert ("B", TaskKind.FORWARD, "drop") not in kinds["keep"]
        assert kinds["recompute"] - Counter({("B", TaskKind.FORWARD, "drop"): 2 * len(attention)}) == kinds["keep"]
        # what the attention hands to the rest of its layer is no longer read in the backward block
        leaving = {
            w
            for a, t in tasks["keep"]
            if a.phase == "F" and t.op in attention and t.chunk >= 0
            for w in t.writes
            if w is not None and w.kind is BufferKind.ACTIVATION and w.chunk < 0
        }
        read_late = {
            o: {b for a, t in tasks[o] if a.phase == "B" for b in t.reads + t.saved if b in leaving} for o in progs
        }
        assert read_late["keep"] and not read_late["recompute"]
        # so the forward holds less: each layer keeps its input only
        held = {o: _held_bytes_at_first_backward(progs[o], dev) for o in progs}
        assert held["recompute"] < held["keep"]
        sizes = {b: n for _, t in tasks["keep"] for b, n in t.alloc}
        assert held["keep"] - held["recompute"] == sum(sizes[b] for b in read_late["keep"])


def _held_bytes_at_first_backward(prog, dev: int) -> int:
    """Bytes of activations alive on ``dev`` when its first backward task starts."""
    live: dict[str, int] = {}
    for a, t in prog.devices[dev].tasks_in_order():
        if a.phase != "F":
            break
        live.update(dict(t.alloc))
        for b in t.free:
            live.pop(b, None)
    return sum(live.values())


def test_coshard_outputs_recompute_needs_coshard_and_full_recompute():
    spec, g = traced("gpt-tiny", 8)
    ctx = Context(g, spec, 8, "cpu", 2, 2, 1)
    sp = get_space("megatron*coshard")
    rows = sp.enumerate(ctx, {"dp": 1, "tp": 2, "pp": 1, "microbatch": 8, "coshard_blocks": "attention"})
    outputs: dict = {}
    for r in rows:
        outputs.setdefault((r["coshard"], r["recompute"]), set()).add(r["coshard_outputs"])
    assert outputs[(2, "full")] == {"keep", "recompute"}
    assert outputs[(2, "none")] == outputs[(1, "full")] == outputs[(1, "none")] == {"keep"}
    with pytest.raises(ConfigError, match="coshard_outputs='recompute'.*recompute='full'.*coshard=2, recompute='none'"):
        sp.build(ctx, dict(dp=1, tp=2, pp=1, microbatch=8, coshard=2, recompute="none", coshard_outputs="recompute"))


def test_a_share_of_the_layers_remakes_its_results_spread_over_the_layers():
    from planlab.search_spaces.coshard import remade

    assert [i for i in range(12) if remade(i, 25)] == [0, 4, 8]
    assert [i for i in range(12) if remade(i, 75)] == [0, 1, 2, 4, 5, 6, 8, 9, 10]
    assert all(remade(i, 100) for i in range(12))
    spec, g = traced("swin-tiny", 8, (("num_heads", "4,8,16"),))
    ctx = Context(g, spec, 8, "cpu", 2, 2, 1)
    base = dict(
        dp=1,
        tp=2,
        pp=1,
        microbatch=8,
        coshard=2,
        coshard_blocks="attention",
        recompute="full",
        coshard_outputs="recompute",
    )
    layer_of = {op.name: int(op.module.split(".")[1]) for op in g.operators if op.module.startswith("blocks.")}
    outer = {}
    for pct in (25, 50, 100):
        prog = materialize(get_space("megatron*coshard").build(ctx, dict(base, coshard_remade_percent=pct)), g)
        outer[pct] = {layer_of[t.op] for _, t in prog.devices[0].tasks_in_order() if t.name.endswith(":outer") and t.op}
    blocks = sorted(set(layer_of.values()))
    assert outer[100] == set(blocks)
    assert outer[50] == {i for i in blocks if i % 4 < 2}
    assert outer[25] == {i for i in blocks if i % 4 == 0}
    sp = get_space("megatron*coshard")
    with pytest.raises(ConfigError, match="coshard_remade_percent=50 .* needs coshard_outputs='recompute' .*'keep'"):
        sp.build(ctx, dict(base, coshard_outputs="keep", coshard_remade_percent=50))


def test_groups_spliced_at_once_land_as_spliced_one_by_one():
    """run_chunks replaces each group's members by its chunk tasks in one pass when the groups' spans
    do not overlap: the same list as splicing them one at a time, the last first, with the tasks
    between a group's members that read its results moved after its chunks and the others before."""
    from planlab.plan.buffer import activation
    from planlab.plan.coshard import _splice_all
    from planlab.plan.program import Task

    b = [activation(f"t{i}") for i in range(10)]
    reads = {1: (b[0],), 2: (b[1],), 3: (b[0],), 6: (b[4],)}
    tasks = [Task(f"t{i}", TaskKind.FORWARD, reads=reads.get(i, ()), writes=(b[i],)) for i in range(10)]
    a_seq = [Task("a@0", TaskKind.FORWARD, writes=(b[1],)), Task("a@1", TaskKind.FORWARD, writes=(b[3],))]
    b_seq = [Task("b@0", TaskKind.FORWARD, writes=(b[4], b[7]))]
    jobs = [([1, 3], a_seq, ["t1", "t3"]), ([4, 7], b_seq, ["t4", "t7"])]
    at_once = _splice_all(tasks, jobs)
    assert [t.name for t in at_once] == ["t0", "a@0", "a@1", "t2", "t5", "b@0", "t6", "t8", "t9"]
    assert at_once == _splice_all(_splice_all(tasks, jobs[1:]), jobs[:1])
