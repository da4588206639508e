"""Activation offload (the ``act_offload`` space, ``OpPlan.offload``): the pass's copies and buffers,
device and host memory, the copy stream in the simulator, the knob, plan files, and numerics on gloo."""

import json

import pytest

from planlab.cli import GRAD_TOL, LOSS_TOL
from planlab.costmodel import CostModel
from planlab.costmodel.hardware import SPEC_DIR
from planlab.errors import ConfigError, InfeasiblePlan, PlanFileError
from planlab.executor import launch_local
from planlab.explore import memory_lower_bound_bytes
from planlab.plan import PlanBuilder, materialize, plan_from_json, plan_to_json
from planlab.plan.buffer import BufferKind
from planlab.plan.plan_file import plan_to_dict
from planlab.plan.program import Role, TaskKind
from planlab.plan.software_passes import build_program
from planlab.search_spaces import Context, get_space
from planlab.search_spaces.screen import Screen
from planlab.simulator import find_deadlock, simulate

from conftest import traced

SPACE = "megatron*act_offload"
CLUSTER = "dgx-a100-80g"


def _plan(pct, *, pp=1, dp=2, cluster=CLUSTER, microbatch=1, recompute="none"):
    spec, g = traced("gpt-tiny", 8)
    knobs = dict(dp=dp, tp=1, pp=pp, microbatch=microbatch, zero=0, recompute=recompute, offload_activations=pct)
    n = dp * pp
    return get_space(SPACE).build(Context(g, spec, 8, cluster, 1, n, 8 if cluster != "cpu" else n), knobs), g


def _copies(program, role, dev=0):
    return [t for b in program.devices[dev].blocks.values() for t in b.tasks if t.role is role]


@pytest.mark.parametrize("pp", [1, 2])
def test_saved_activations_go_to_the_host_after_the_forward_and_back_before_the_backward(pp):
    plan, g = _plan(100, pp=pp)
    assert any(p.offload for p in plan.ops)
    program = materialize(plan, g)
    find_deadlock(program)
    out, back = _copies(program, Role.SAVE_TO_HOST), _copies(program, Role.SAVE_TO_DEVICE)
    assert out and len(out) == len(back)
    blocks = program.devices[0].blocks
    for (st, phase), b in blocks.items():
        for t in b.tasks:
            if t.role is Role.SAVE_TO_HOST:
                assert phase == "F" and {w.kind for w in t.writes} == {BufferKind.HOST_ACTIVATION}
                assert t.nbytes > 0 and t.free  # the device copies are freed by the copy
            if t.role is Role.SAVE_TO_DEVICE:
                assert phase == "B" and {w.kind for w in t.writes} == {BufferKind.FETCHED}
                assert sum(n for _, n in t.alloc) == t.nbytes
    fetched = {w for t in back for w in t.writes}
    kept = {b for blk in blocks.values() for t in blk.tasks if t.kind is TaskKind.BACKWARD for b in t.saved}
    assert fetched <= kept  # the backward reads what came back
    assert not {r for t in out for r in t.reads} & kept  # and nothing it offloaded


def test_device_memory_falls_host_memory_rises_and_the_copies_run_on_their_own_stream():
    cost = CostModel.load(CLUSTER)
    res = {}
    for pct in (0, 100):
        plan, g = _plan(pct, microbatch=2)
        program = build_program(plan, g, cost)
        res[pct] = (simulate(program, cost, timeline=True), plan, program)
    (plain, plan0, p0), (off, plan1, p1) = res[0], res[100]
    assert off.peak_mem_bytes < plain.peak_mem_bytes
    assert p0.devices[0].host_bytes == 0
    assert p1.devices[0].host_bytes == sum(t.nbytes for t in _copies(p1, Role.SAVE_TO_HOST))  # 1F1B, 1 stage: 1 mb
    assert off.host_peak_bytes == 2 * p1.devices[0].host_bytes  # the two devices of the plan share a node
    assert off.iter_time_s >= plain.iter_time_s  # copies only add: what compute does not cover
    bound = [sum(memory_lower_bound_bytes(p, g, cost.precision)) for p in (plan0, plan1)]
    assert bound[1] < bound[0] and bound[1] <= off.peak_mem_bytes  # still a lower bound
    copies = [e for e in off.events if e.stream == "copy"]
    assert copies and not [e for e in plain.events if e.stream == "copy"]
    host = cost.cluster.node.host
    moved = sum(t.nbytes for t in _copies(p1, Role.SAVE_TO_HOST) + _copies(p1, Role.SAVE_TO_DEVICE))
    busy = sum(e.end_s - e.start_s for e in copies)
    assert busy >= moved * host.devices_per_link / host.link_bytes_per_s * 2 * 0.999  # two micro-batches


def test_host_memory_overflow_is_an_out_of_memory_result(tmp_path):
    spec = json.loads((SPEC_DIR / f"{CLUSTER}.json").read_text())
    spec["host"]["memory_GB"] = 1e-6  # 1 kB of host memory
    path = tmp_path / "small-host.json"
    path.write_text(json.dumps(spec))
    cost = CostModel.load(str(path))
    plan, g = _plan(100)
    r = simulate(build_program(plan, g, cost), cost)
    assert not r.feasible and r.reason.startswith("out of host memory")


def test_the_knob_takes_a_share_of_each_stage_s_first_layers_and_refuses_a_bad_value():
    plan, _ = _plan(50, pp=2)  # gpt-tiny: 2 layers, one per stage: at least one each
    layers = {p.offload for p in plan.ops if p.offload}
    assert layers == {1, 2}
    assert not any(p.offload for p in _plan(0)[0].ops)
    with pytest.raises(ConfigError, match="recompute=.full.: a recomputed layer keeps nothing to offload"):
        _plan(100, recompute="full")
    with pytest.raises(ConfigError, match="offload_activations.*= 30 is outside its range") as e:
        _plan(30)
    assert "\n" not in str(e.value)
    spec, g = traced("gpt-tiny", 8)
    builder = PlanBuilder(g, model=spec, global_batch=8, cluster="cpu", nodes=1, num_devices=1)
    with pytest.raises(InfeasiblePlan, match="non-negative integer"):
        builder.offload_activations(g.operators[0].name, -1)


def test_a_cluster_without_a_host_side_refuses_it_in_one_line():
    plan, g = _plan(100, cluster="cpu")
    with pytest.raises(ConfigError, match="gives no host side") as e:
        simulate(materialize(plan, g), CostModel.load("cpu", nodes=2))
    assert "\n" not in str(e.value)


def test_plan_files_keep_the_groups_and_refuse_a_bad_one():
    plan, _ = _plan(100, pp=2)
    assert plan_from_json(plan_to_json(plan)) == plan
    d = plan_to_dict(plan)
    d["placements"][0]["offload"] = "yes"
    with pytest.raises(PlanFileError, match="offload must be a non-negative integer"):
        plan_from_json(json.dumps(d))


@pytest.mark.parametrize(
    "dp, pp", [(1, 2), pytest.param(2, 1, marks=pytest.mark.slow), pytest.param(2, 2, marks=pytest.mark.slow)]
)
def test_offloaded_activations_move_and_match_one_process_on_gloo(dp, pp):
    plan, _ = _plan(100, dp=dp, pp=pp, cluster="cpu", microbatch=2)
    res = launch_local(plan, dp * pp, steps=2, lr=1e-2, record=True)
    assert res.max_loss_error <= LOSS_TOL, (res.losses, res.ref_losses)
    assert res.max_grad_error <= GRAD_TOL
    ran = {t["task"].split(":")[0] for t in res.timeline}
    assert {"save-to-host", "save-to-device"} <= ran


def test_the_screen_leaves_the_offloaded_activations_out_and_prices_the_copies_it_cannot_hide():
    cost = CostModel.load(CLUSTER)
    spec, g = traced("gpt-tiny", 8)
    ctx = Context(g, spec, 8, CLUSTER, 1, 2, 8)
    space, screen = get_space(SPACE), Screen(g, cost, cost.precision)
    knobs = dict(dp=2, tp=1, pp=1, microbatch=2, zero=0, recompute="none")
    est = {pct: screen.estimate(space.draft(ctx, dict(knobs, offload_activations=pct))) for pct in (0, 100)}
    assert est[100].mem_bytes < est[0].mem_bytes and est[100].bound_bytes < est[0].bound_bytes
    assert est[100].time_s >= est[0].time_s  # copies only add
