"""AlphaFold2's recycling (planlab/models/evoformer.py, planlab/search_spaces/recycling.py): the
traced module against the real recycling loop (R-1 passes under torch.no_grad, then one with
gradients), the passes told apart, no backward for the no-grad passes, each pass its own pipeline
chunk, and data-parallel, plain-pipeline and 3f1b plans on gloo ranks against one process."""

import pytest
import torch

from planlab.cli import GRAD_TOL, LOSS_TOL
from planlab.errors import ConfigError
from planlab.executor import launch_local
from planlab.models import ModelSpec, build_model
from planlab.plan.buffer import GATHERED_KINDS
from planlab.plan.materialize import materialize
from planlab.plan.program import Program, TaskKind
from planlab.search_spaces import Context, get_space
from planlab.search_spaces.recycling import num_passes, passes_of
from planlab.search_spaces.schedules import format_schedule
from planlab.simulator.dryrun import find_deadlock

from conftest import traced

R3 = (("recycles", 3),)


def _plain_loop(inputs, passes: int):
    """AlphaFold2's recycling as a training loop writes it, on the one-pass module: passes 0..R-2
    under torch.no_grad, each feeding its last block's first MSA row and pair representation to the
    next; the last pass with gradients. Returns the loss and the gradients."""
    model, _ = build_model(ModelSpec("evoformer-tiny"), batch=4, device="cpu", seed=0)
    out = {}
    model.blocks[-1].register_forward_hook(lambda mod, i, o: out.update(mz=o))
    *feats, prev_m1, prev_z, bins = inputs
    with torch.no_grad():
        for _ in range(passes - 1):
            model(*feats, prev_m1, prev_z, bins)
            m, z = out["mz"]
            prev_m1, prev_z = m[:, 0], z
    loss = model(*feats, prev_m1, prev_z, bins)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("passes", [1, 3])
def test_recycling_module_is_the_plain_recycling_loop(passes):
    model, inputs = build_model(ModelSpec("evoformer-tiny", (("recycles", passes),)), batch=4, device="cpu", seed=0)
    loss = model(*inputs)
    loss.backward()
    ref_loss, ref_grads = _plain_loop(inputs, passes)
    assert torch.allclose(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, ref_grads[n], rtol=1e-5, atol=1e-7), n
    if passes > 1:  # recycling changes the loss: the check compares something
        one, _ = _plain_loop(inputs, 1)
        assert abs(float(one) - float(ref_loss)) > 1e-4


def test_passes_and_stages_of_the_traced_loop():
    spec, g = traced("evoformer-tiny", 4, R3)
    assert num_passes(g) == 3 and num_passes(traced("evoformer-tiny", 4)[1]) == 1
    p = passes_of(g)
    q = [op for op in g.operators if op.module == "blocks.1.tri_att_end.mha.linear_o"]
    assert [o.name for o in q] == [
        "blocks_1_tri_att_end_mha_linear_o",
        "blocks_1_tri_att_end_mha_linear_o_1",
        "blocks_1_tri_att_end_mha_linear_o_2",
    ]  # one module path, three calls
    assert [p[o.name] for o in q] == [0, 1, 2]
    assert {p[op.name] for op in g.operators if op.module.startswith("input_embedder")} == {0, 1, 2}
    assert [p[op.name] for op in g.operators if op.kind == "detach"] == [0, 0, 1, 1]
    plan = get_space("3f1b").build(Context(g, spec, 4, "cpu", 2, 2, 1), dict(pp=2, dp=1, tp=1, microbatch=1))
    stage = {o.op: o.stage for o in plan.ops}
    assert [stage[o.name] for o in q] == [1, 3, 5]  # pass r, block 1 of 2 on 2 stages: r * pp + 1
    assert stage["distogram"] == 5


def test_no_backward_for_the_no_grad_passes():
    spec, g = traced("evoformer-tiny", 4, R3)
    plan = get_space("megatron").build(Context(g, spec, 4, "cpu", 1, 1, 1), dict(dp=1, tp=1, pp=1, microbatch=4))
    prog = materialize(plan, g)
    p = passes_of(g)
    bwd = {t.op for dp in prog.devices for b in dp.blocks.values() for t in b.tasks if t.kind is TaskKind.BACKWARD}
    fwd = {t.op for dp in prog.devices for b in dp.blocks.values() for t in b.tasks if t.kind is TaskKind.FORWARD}
    assert {p[o] for o in fwd} == {0, 1, 2}
    assert bwd and {p[o] for o in bwd} == {2}
    assert not any(op.startswith(("getitem", "detach")) and p[op] < 2 for op in bwd)
    # every parameter held once, though each pass reads it
    names = [n for n, _ in prog.devices[0].params]
    assert len(names) == len(set(names)) == len([t for t, s in g.tensors.items() if s.role == "param"])


# Golden schedules of a recycling model (R = 3, 2 device groups, 4 micro-batches): the plain
# pipeline sweeps the no-grad passes, group 0 then runs the last pass in GPipe's order (one ordered
# channel carries group 1's recycled outputs and gradients); 3f1b interleaves them.
GOLDEN = {
    ("megatron", 0): "0F0 0F1 0F2 0F3 2F0 2F1 2F2 2F3 4F0 4F1 4F2 4F3 4B0 4B1 4B2 4B3 0U0",
    ("megatron", 1): "1F0 1F1 1F2 1F3 3F0 3F1 3F2 3F3 5F0 5B0 5F1 5B1 5F2 5B2 5F3 5B3 1U0",
    ("3f1b", 0): "0F0 0F1 2F0 2F1 4F0 4F1 0F2 4B0 0F3 4B1 2F2 2F3 4F2 4F3 4B2 4B3 0U0",
    ("3f1b", 1): "1F0 1F1 3F0 3F1 5F0 5B0 5F1 5B1 1F2 1F3 3F2 3F3 5F2 5B2 5F3 5B3 1U0",
}


@pytest.mark.parametrize("space", ["megatron", "3f1b"])
def test_pipelined_recycling_schedules(space):
    spec, g = traced("evoformer-tiny", 4, R3)
    plan = get_space(space).build(Context(g, spec, 4, "cpu", 2, 2, 1), dict(dp=1, tp=1, pp=2, microbatch=1))
    prog = materialize(plan, g)
    assert find_deadlock(prog, raise_error=False) is None
    for dp in prog.devices:
        assert format_schedule(list(dp.schedule)) == GOLDEN[(space, dp.device)]
        assert {ph for s, ph in dp.blocks if s < 4} <= {"F", "U"}  # the no-grad chunks only run forwards


def test_interleaved_refused_for_a_recycling_model():
    spec, g = traced("evoformer-tiny", 4, (("blocks", 4),) + R3)
    with pytest.raises(ConfigError, match="recycles its trunk 3 times"):
        get_space("megatron").build(
            Context(g, spec, 4, "cpu", 2, 2, 1),
            dict(dp=1, tp=1, pp=2, microbatch=1, schedule="interleaved", virtual_stages=2),
        )


@pytest.mark.parametrize(
    "space,knobs,nproc",
    [
        ("megatron", dict(dp=2, tp=1, pp=1, microbatch=1), 2),  # data parallel, each rank 3 passes per micro-batch
        ("megatron", dict(dp=1, tp=1, pp=2, microbatch=1), 2),  # plain pipeline: no-grad sweeps, then the last pass
        ("3f1b", dict(dp=1, tp=1, pp=2, microbatch=1), 2),
        ("3f1b", dict(dp=2, tp=1, pp=2, microbatch=1), 4),
        ("3f1b*coshard", dict(dp=1, tp=1, pp=2, microbatch=1, coshard=2), 2),  # attention heads in 2 pieces each
        ("dp*recompute*coshard", dict(dp=2, microbatch=1, coshard=2, recompute="none"), 2),
    ],
)
def test_recycling_plans_match_one_process(space, knobs, nproc):
    spec, g = traced("evoformer-tiny", 4, R3)
    plan = get_space(space).build(Context(g, spec, 4, "cpu", nproc, nproc, 1), knobs)
    res = launch_local(plan, nproc, steps=2, lr=1e-2, timeout_s=180)
    assert res.max_loss_error <= LOSS_TOL, (res.losses, res.ref_losses)
    assert res.max_grad_error <= GRAD_TOL
    assert res.losses[1] < res.losses[0]


def test_training_flops_count_no_backward_for_the_no_grad_passes():
    from planlab.plan.shared_params import training_flops

    _, one = traced("evoformer-tiny", 4)
    _, three = traced("evoformer-tiny", 4, R3)
    assert training_flops(one) == 3.0 * one.flops
    # three forwards and one backward (twice a forward's FLOPs): 5 passes' worth, not 9 (a little less:
    # the masks, computed from the inputs alone, get no backward in the recycling graph)
    assert 4.9 * one.flops < training_flops(three) < 5.0 * one.flops


def _gathered_reads_without_a_write(prog: Program) -> list[str]:
    """Each read of a ZeRO-3 gathered weight, in the order a device runs its schedule, that no gather
    on that device wrote for that micro-batch since it was last freed; and each gathered weight not
    freed in the block that gathered it (FSDP reshards after each module's forward and backward)."""
    bad = []
    for dp in prog.devices:
        live: dict = {}  # (buffer, micro-batch) -> the action that gathered it
        for a, t in dp.tasks_in_order():
            for b in t.reads:
                if b is not None and b.kind in GATHERED_KINDS and (b, a.microbatch) not in live:
                    bad.append(f"device {dp.device}, {a}, {t.name}: reads {b} before a gather wrote it")
            live.update({(b, a.microbatch): a for b in t.writes if b is not None and b.kind in GATHERED_KINDS})
            for b in t.free:
                got = live.pop((b, a.microbatch), None)
                if got is not None and (got.stage, got.phase) != (a.stage, a.phase):
                    bad.append(f"device {dp.device}: {b} gathered in {got}, freed in {a}")
        bad += [f"device {dp.device}: {b} gathered in {a}, never freed" for (b, _), a in live.items()]
    return bad


@pytest.mark.parametrize(
    "space,knobs",
    [
        ("3f1b", dict(dp=2, tp=1, pp=2, microbatch=1, zero=3)),  # fuzz plan 343's shape (seed 0)
        ("3f1b", dict(dp=2, tp=1, pp=2, microbatch=1, zero=3, recompute="full")),
        ("megatron", dict(dp=2, tp=1, pp=2, microbatch=1, zero=3)),  # the plain recycled pipeline
        ("megatron", dict(dp=4, tp=1, pp=1, microbatch=1, zero=3)),  # every pass on one device
    ],
)
def test_zero3_gathers_the_weights_each_recycling_pass_reads(space, knobs):
    """Every pass reads the last pass's weights (the owners of their gradients): under ZeRO-3 each
    pass's forward gathers them itself, and frees them before the next pass."""
    spec, g = traced("evoformer-tiny", 4, R3)
    prog = materialize(get_space(space).build(Context(g, spec, 4, "cpu", 4, 4, 1), knobs), g)
    assert _gathered_reads_without_a_write(prog) == []
    assert find_deadlock(prog, raise_error=False) is None
    gathers = {
        (s, ph)
        for dp in prog.devices
        for (s, ph), b in dp.blocks.items()
        for t in b.tasks
        if t.name.startswith("zero3-gather")
    }
    assert {s for s, ph in gathers if ph == "F"} == {s for dp in prog.devices for s, ph in dp.blocks if ph == "F"}
