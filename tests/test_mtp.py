"""DeepSeek-V3's multi-token prediction (report section 2.2; Megatron-Core's ``mtp_num_layers``):
the module as a traced part of the model, its loss against a hand computation, where a pipeline
puts it, and a plan that runs it on gloo matching one process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from planlab.cli import LOSS_TOL
from planlab.costmodel import CostModel
from planlab.errors import ConfigError, InfeasiblePlan
from planlab.executor import launch_local
from planlab.models import ModelSpec, build_model
from planlab.models.init import build_full
from planlab.explore import memory_lower_bound_bytes
from planlab.plan.software_passes import build_program
from planlab.search_spaces.screen import Screen
from planlab.simulator import simulate
from planlab.search_spaces import Context, get_space

from conftest import traced

MTP = (("mtp_layers", 1),)


def test_the_module_traces_with_its_parameters_and_adds_one_moe_layer():
    spec, g = traced("deepseek-tiny", 4, MTP)
    _, base = traced("deepseek-tiny", 4)
    model, _ = build_model(spec, batch=1)
    assert not g.unknown
    assert g.num_params == sum(p.numel() for p in model.parameters()) == spec.config().num_params()
    kinds = [op.kind for op in g.operators]
    assert kinds.count("topk") == [op.kind for op in base.operators].count("topk") + 1  # its MoE layer
    assert kinds.count("embedding") == 2  # its own table, as Megatron-Core keeps one on its stage
    # the head is shared: one output layer scores both depths
    heads = [op for op in g.operators if op.module == "output"]
    assert len(heads) == 1 and g.tensors[heads[0].outputs[0]].shape[2] == 2


def test_the_loss_is_the_main_loss_plus_the_weighted_next_next_token_loss():
    spec = ModelSpec("deepseek-tiny", MTP + (("aux_loss_coef", 0.0),))
    model, (idx, targets) = build_full(spec, batch=2)
    with torch.no_grad():
        cos, sin = model.rope_cos, model.rope_sin
        x = model.tok_embeddings(idx)
        for block in model.blocks:
            x, _ = block(x, cos, sin)
        h = model.norm(x)
        m = model.mtp[0]
        ahead = torch.roll(idx, -1, dims=1)  # the token after each target
        y, _ = m.block(m.eh_proj(torch.cat((m.enorm(m.embed(ahead)), m.hnorm(h)), dim=-1)), cos, sin)
        main = F.cross_entropy(model.output(h).flatten(0, 1), targets.flatten(0, 1))
        depth1 = F.cross_entropy(model.output(m.norm(y)).flatten(0, 1), torch.roll(targets, -1, dims=1).flatten(0, 1))
        assert torch.allclose(model(idx, targets), main + 0.1 * depth1, atol=1e-5)


def test_a_pipeline_puts_the_module_on_the_last_stage_with_the_head():
    spec, g = traced("deepseek-tiny", 8, MTP)
    ctx = Context(g, spec, 8, "dgx-h100", 1, 4, 4)
    plan = get_space("megatron").build(ctx, dict(dp=2, tp=1, pp=2, microbatch=2))
    stage = {p.op: p.stage for p in plan.ops}
    mtp = [op.name for op in g.operators if op.module.startswith("mtp.")]
    assert mtp and {stage[n] for n in mtp} == {1}
    assert {stage[op.name] for op in g.operators if op.module == "tok_embeddings"} == {0}


def test_bad_module_counts_are_one_line():
    with pytest.raises(ConfigError, match=r"^mtp_layers=-1 must be at least 0"):
        ModelSpec("deepseek-tiny", (("mtp_layers", -1),)).config()
    with pytest.raises(ConfigError, match=r"^mtp_loss_coef=-0.5 must be at least 0"):
        ModelSpec("deepseek-tiny", (("mtp_loss_coef", -0.5),)).config()
    with pytest.raises(ConfigError, match=r"^vocab_parallel=2 must be 0 or 1"):
        ModelSpec("deepseek-tiny", (("vocab_parallel", 2),)).config()
    with pytest.raises(ConfigError, match=r"^mtp_shared_embedding=2 must be 0 or 1"):
        ModelSpec("deepseek-tiny", (("mtp_shared_embedding", 2),)).config()


def test_a_pipeline_with_the_module_on_2_ranks_matches_one_process():
    spec, g = traced("deepseek-tiny", 8, MTP)
    ctx = Context(g, spec, 8, "cpu", 2, 2, 1)
    plan = get_space("megatron").build(ctx, dict(dp=1, tp=1, pp=2, microbatch=2))
    res = launch_local(plan, 2, steps=2, lr=1e-2)
    assert res.max_loss_error <= LOSS_TOL, (res.losses, res.ref_losses)


def test_a_vocabulary_parallel_head_splits_over_tp_and_matches_one_process():
    spec, g = traced("deepseek-tiny", 8, MTP + (("vocab_parallel", 1),))
    ctx = Context(g, spec, 8, "cpu", 2, 2, 1)
    plan = get_space("megatron").build(ctx, dict(dp=1, tp=2, pp=1, microbatch=2, sequence_parallel=True))
    # Megatron-Core's column-parallel output layer: the head's vocabulary split over the tp ranks
    assert "n" in plan.op_plan("output").dims
    assert [op.kind for op in g.operators].count("vocab_cross_entropy") == 2
    res = launch_local(plan, 2, steps=2, lr=1e-2)
    assert res.max_loss_error <= LOSS_TOL, (res.losses, res.ref_losses)


SHARED = MTP + (("mtp_shared_embedding", 1),)


def test_a_shared_embedding_is_one_parameter_read_twice():
    """``mtp_shared_embedding=1`` (DeepSeek-V3 report section 3.2.3): the module looks its tokens up
    in the main table, one parameter (``vocab x hidden`` fewer than with Megatron-Core's copy) read
    by two embedding operators."""
    spec, g = traced("deepseek-tiny", 4, SHARED)
    _, copy = traced("deepseek-tiny", 4, MTP)
    model, _ = build_model(spec, batch=1)
    cfg = spec.config()
    assert g.num_params == sum(p.numel() for p in model.parameters()) == cfg.num_params()
    assert copy.num_params - g.num_params == cfg.vocab * cfg.hidden
    lookups = [op for op in g.operators if op.kind == "embedding"]
    assert len(lookups) == 2 and {op.inputs[1] for op in lookups} == {"tok_embeddings.weight"}


@pytest.mark.parametrize(
    "knobs",
    [dict(dp=2, tp=1, pp=1, microbatch=2), dict(dp=1, tp=1, pp=2, microbatch=2, schedule="dualpipe")],
    ids=["dp2", "dualpipe-pp2"],
)
def test_a_shared_embedding_trains_as_one_process_on_2_ranks(knobs):
    """The tied table's two readers add into one gradient: with data parallelism, and with DualPipe,
    which puts the embedding's stage and the module's on each of its two ranks, 2 gloo ranks match
    one process training the module with its one table; each rank holds the table once."""
    spec, g = traced("deepseek-tiny", 8, SHARED)
    ctx = Context(g, spec, 8, "cpu", 2, 2, 1)
    plan = get_space("megatron").build(ctx, knobs)
    cost = CostModel.load("dgx-h100", 1)
    cfg, param = spec.config(), cost.precision.param_bytes
    shared = build_program(plan, g, cost)
    _, copy_g = traced("deepseek-tiny", 8, MTP)
    copy = build_program(get_space("megatron").build(Context(copy_g, spec, 8, "cpu", 2, 2, 1), knobs), copy_g, cost)
    for a, b in zip(copy.devices, shared.devices):
        assert a.param_bytes - b.param_bytes == cfg.vocab * cfg.hidden * param
    if knobs.get("schedule") == "dualpipe":  # the explorer's bound and the screen hold the table once too
        table = cfg.vocab * cfg.hidden * (param + cost.precision.grad_bytes + cost.precision.optimizer_bytes)
        held = [_bounds(gr, Context(gr, spec, 8, "cpu", 2, 2, 1), knobs, cost) for gr in (copy_g, g)]
        assert all(bound <= peak and screen <= peak for bound, screen, peak in held)
        assert [a - b for a, b in zip(*held)] == [table] * 3
    res = launch_local(plan, 2, steps=2, lr=1e-2)
    assert res.max_loss_error <= LOSS_TOL, (res.losses, res.ref_losses)


def _bounds(g, ctx, knobs, cost) -> tuple[float, float, int]:
    """(the explorer's memory bound, the screen's, the simulated peak) of a plan."""
    plan = get_space("megatron").build(ctx, knobs)
    bound = sum(memory_lower_bound_bytes(plan, g, cost.precision, cost.software))
    screen = Screen(g, cost, cost.precision).estimate(get_space("megatron").draft(ctx, knobs)).bound_bytes
    return bound, screen, simulate(build_program(plan, g, cost), cost).peak_mem_bytes


def test_a_shared_embedding_on_two_pipeline_ranks_is_refused_in_one_line():
    """A pipeline that puts the module on another rank than the embedding (1F1B's last stage) would
    need two copies and an all-reduce between them (Megatron-Core's embedding group): refused."""
    spec, g = traced("deepseek-tiny", 8, SHARED)
    plan = get_space("megatron").build(Context(g, spec, 8, "dgx-h100", 1, 4, 4), dict(dp=2, tp=1, pp=2, microbatch=2))
    with pytest.raises(InfeasiblePlan, match=r"^parameter 'tok_embeddings.weight' is read .* \(tied weights\) placed"):
        build_program(plan, g, CostModel.load("dgx-h100", 1))
