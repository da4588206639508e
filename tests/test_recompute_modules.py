"""Selective recomputation by module (Megatron-Core's ``--recompute-modules``): which operators each
knob recomputes, what it refuses, and that it lowers the simulated peak with the bounds below it."""

from __future__ import annotations

import pytest
from conftest import traced

from planlab.costmodel import CostModel
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
        ("deepseek-tiny", dict(recompute_mla_up_proj=True), "needs recompute='selective'"),
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
