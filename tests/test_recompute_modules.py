"""Selective recomputation by module (Megatron-Core's ``--recompute-modules``): which operators each
knob recomputes, what it refuses, and that it lowers the simulated peak with the bounds below it."""

from __future__ import annotations

import pytest
from conftest import traced

import dataclasses
import json

from planlab.cli import LOSS_TOL
from planlab.costmodel import CostModel
from planlab.executor import launch_local
from planlab.plan.buffer import BufferKind
from planlab.errors import PlanFileError
from planlab.plan.plan_file import plan_from_dict, plan_to_json
from planlab.plan.program import Recompute, TaskKind
from planlab.errors import PlanlabError
from planlab.explore import memory_lower_bound_bytes
from planlab.plan.software_passes import build_program
from planlab.search_spaces.builtin import get_space
from planlab.search_spaces.recompute_modules import module_groups
from planlab.search_spaces.screen import Screen
from planlab.search_spaces.space import Context
from planlab.simulator import simulate

FP8 = CostModel.load("dgx-h100", 1, software="megatron", precision="fp8")


@pytest.fixture(scope="module")
def deepseek():
    return traced("deepseek-tiny", 8)


def test_each_module_knob_recomputes_its_modules_operators(deepseek):
    _, g = deepseek
    kinds = lambda knob: {
        (op.module.split(".", 2)[-1], op.kind) for op in g.operators if op.name in module_groups(g, knob)
    }  # noqa: E731
    assert kinds("recompute_moe_act") == {("feed_forward.experts", "activation"), ("feed_forward.experts", "mul")}
    up = kinds("recompute_mla_up_proj")
    assert {("attention.wq_b", "linear"), ("attention.wkv_b", "linear"), ("attention.q_norm", "rms_norm")} <= up
    assert not {m for m, _ in up} & {"attention.wq_a", "attention.wkv_a", "attention.wo"}
    assert all(k != "attention" for _, k in up)  # the core is selective's; nothing after it
    dense = {op.module.split(".")[1] for op in g.operators if op.name in module_groups(g, "recompute_mlp")}
    assert dense == {str(i) for i in range(g_dense_layers(g))}


def g_dense_layers(g) -> int:
    routed = {op.module.split(".")[1] for op in g.operators if op.module.endswith(".experts")}
    layers = {op.module.split(".")[1] for op in g.operators if op.module.startswith("blocks.")}
    return len(layers - routed)


@pytest.mark.parametrize(
    "name, knobs, message",
    [
        ("deepseek-tiny", dict(recompute="full", recompute_moe_act=True), "recompute='full' recomputes every"),
        ("gpt-tiny", dict(recompute_moe_act=True), "recompute_moe_act=true: the model has no routed experts"),
    ],
)
def test_a_module_knob_that_does_not_fit_is_one_line(name, knobs, message):
    spec, g = traced(name, 8)
    ctx = Context(g, spec, 8, "dgx-h100", 1, 2, 8)
    with pytest.raises(PlanlabError, match=message):
        get_space("megatron").build(ctx, dict(dp=2, tp=1, pp=1, **knobs))


def test_module_recomputation_lowers_the_peak_and_the_bounds_stay_below(deepseek):
    spec, g = deepseek
    ctx = Context(g, spec, 8, "dgx-h100", 1, 2, 8)
    peaks = []
    for more in ({}, dict(recompute_moe_act=True, recompute_mla_up_proj=True, recompute_mlp=True)):
        knobs = dict(dp=2, ep=2, tp=1, pp=1, microbatch=2, recompute="selective", **more)
        plan = get_space("megatron").build(ctx, knobs)
        peak = simulate(build_program(plan, g, FP8), FP8).peak_mem_bytes
        bound = sum(memory_lower_bound_bytes(plan, g, FP8.precision, FP8.software))
        screen = Screen(g, FP8, FP8.precision).estimate(get_space("megatron").draft(ctx, knobs)).bound_bytes
        assert bound <= peak and screen <= peak
        peaks.append(peak)
    assert peaks[1] < peaks[0]


# ---- mla_up_proj without the attention core (Megatron-Core's CheckpointWithoutOutput) ---------


def _up_proj_program(deepseek, recompute: str):
    spec, g = deepseek
    ctx = Context(g, spec, 8, "dgx-h100", 1, 2, 8)
    knobs = dict(dp=2, tp=1, pp=1, microbatch=2, recompute=recompute, recompute_mla_up_proj=True)
    plan = get_space("megatron").build(ctx, knobs)
    return plan, build_program(plan, g, FP8)


def test_up_projections_alone_are_remade_for_the_attention_core_which_is_not(deepseek):
    _, g = deepseek
    plan, program = _up_proj_program(deepseek, "none")
    up = module_groups(g, "recompute_mla_up_proj", alone=True)
    assert set(plan.discard_outputs) == set(up.values())
    assert not set(up.values()) & set(module_groups(g, "recompute_mla_up_proj").values())
    cores = {op.name for op in g.operators if op.kind == "attention"}
    blocks = program.devices[0].blocks
    forward = [t for (_, ph), b in blocks.items() if ph == "F" for t in b.tasks]
    backward = [t for (_, ph), b in blocks.items() if ph == "B" for t in b.tasks]
    # the core runs once, keeps its graph, and its backward reads the remade queries, keys and values
    assert all(t.recompute is Recompute.NONE for t in forward if t.op in cores)
    assert not [t for t in backward if t.op in cores and t.kind is TaskKind.FORWARD]
    for t in backward:
        if t.op in cores and t.kind is TaskKind.BACKWARD:
            inputs = [b for b in t.saved if b.tensor in g.op(t.op).inputs]
            assert len(inputs) == 3 and all(b.kind is BufferKind.RECOMPUTED for b in inputs)
    # each layer's up-projections run again before its core's backward
    order = [(t.op, t.kind) for t in backward]
    for core in cores:
        at = order.index((core, TaskKind.BACKWARD))
        layer = g.op(core).module.split(".")[1]
        redo = [
            i
            for i, t in enumerate(backward)
            if t.recompute is Recompute.REDO and t.op and g.op(t.op).module.split(".")[1] == layer
        ]
        assert redo and max(redo) < at


def test_up_projections_alone_free_more_than_none_and_cost_less_than_with_the_core(deepseek):
    spec, g = deepseek
    ctx = Context(g, spec, 8, "dgx-h100", 1, 2, 8)
    base = get_space("megatron").build(ctx, dict(dp=2, tp=1, pp=1, microbatch=2, recompute="none"))
    none = simulate(build_program(base, g, FP8), FP8)
    alone = simulate(_up_proj_program(deepseek, "none")[1], FP8)
    with_core = simulate(_up_proj_program(deepseek, "selective")[1], FP8)
    assert alone.peak_mem_bytes < none.peak_mem_bytes
    assert none.iter_time_s < alone.iter_time_s < with_core.iter_time_s
    # the explorer's bound and the screen leave the discarded outputs out, and stay below the simulation
    knobs = dict(dp=2, tp=1, pp=1, microbatch=2, recompute="none", recompute_mla_up_proj=True)
    plan = get_space("megatron").build(ctx, knobs)
    bound = sum(memory_lower_bound_bytes(plan, g, FP8.precision, FP8.software))
    draft = get_space("megatron").draft(ctx, knobs)
    screen = Screen(g, FP8, FP8.precision).estimate(draft).bound_bytes
    assert bound <= alone.peak_mem_bytes and screen <= alone.peak_mem_bytes
    # counted as kept, the queries, keys and values would raise both
    kept = sum(memory_lower_bound_bytes(dataclasses.replace(plan, discard_outputs=()), g, FP8.precision, FP8.software))
    draft.discard_outputs = set()
    assert kept > bound and Screen(g, FP8, FP8.precision).estimate(draft).bound_bytes > screen


def test_a_plan_file_keeps_the_discarded_groups(deepseek):
    plan, _ = _up_proj_program(deepseek, "none")
    back = plan_from_dict(json.loads(plan_to_json(plan)))
    assert back.discard_outputs == plan.discard_outputs and back.discard_outputs
    bad = json.loads(plan_to_json(plan))
    bad["discard_outputs"] = [0]
    with pytest.raises(PlanFileError, match=r"field 'discard_outputs' must be a list of recompute groups >= 1"):
        plan_from_dict(bad)


def test_up_projections_alone_on_2_ranks_match_one_process(deepseek):
    spec, g = deepseek
    ctx = Context(g, spec, 8, "cpu", 2, 2, 1)
    plan = get_space("megatron").build(ctx, dict(dp=2, tp=1, pp=1, microbatch=2, recompute_mla_up_proj=True))
    res = launch_local(plan, 2, steps=2, lr=1e-2)
    assert res.max_loss_error <= LOSS_TOL, (res.losses, res.ref_losses)


def test_the_experts_second_gemm_keeps_the_remade_activation_under_moe_act(deepseek):
    spec, g = deepseek
    bf16 = CostModel.load("dgx-h100", 1, software="megatron", precision="bf16")
    ctx = Context(g, spec, 8, "dgx-h100", 1, 2, 8)
    peaks = []
    for more in ({}, dict(recompute_moe_act=True)):
        plan = get_space("megatron").build(ctx, dict(dp=2, ep=2, tp=1, pp=1, microbatch=2, **more))
        program = build_program(plan, g, bf16)
        peaks.append(simulate(program, bf16).peak_mem_bytes)
    act = module_groups(g, "recompute_moe_act")
    assert set(plan.discard_outputs) == set(act.values())
    made = {t for op in g.operators if op.name in act for t in op.outputs}
    second = [
        t
        for b in program.devices[0].blocks.values()
        for t in b.tasks
        if t.kind is TaskKind.BACKWARD and any(x.tensor in made for x in t.saved) and t.op not in act
    ]
    assert second and all(x.kind is BufferKind.RECOMPUTED for t in second for x in t.saved if x.tensor in made)
    assert peaks[1] < peaks[0]
