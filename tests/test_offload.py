"""ZeRO-Offload (offload_optimizer): the pass's tasks and buffers, device and host memory, the
host link and CPU pricing, the host memory check, plan files, the screen, and numerics on gloo."""

import json

import pytest

from planlab.cli import GRAD_TOL, LOSS_TOL
from planlab.costmodel import CostModel
from planlab.costmodel.hardware import SPEC_DIR
from planlab.errors import ConfigError, InfeasiblePlan, PlanFileError
from planlab.executor import launch_local
from planlab.explore import memory_lower_bound_bytes
from planlab.plan import FP32, PlanBuilder, materialize, plan_from_json, plan_to_json
from planlab.plan.buffer import BufferKind
from planlab.plan.passes.offload import host_bytes_per_param
from planlab.plan.plan_file import plan_to_dict
from planlab.plan.program import Role, TaskKind
from planlab.plan.software_passes import build_program
from planlab.search_spaces import Context, get_space
from planlab.search_spaces.screen import Screen
from planlab.simulator import find_deadlock, simulate

from conftest import traced

SPACE = "megatron*offload"


def _plan(n, zero, offload=True, cluster="cpu", dp=None):
    spec, g = traced("gpt-tiny", 8)
    knobs = dict(dp=dp or n, tp=1, pp=1, microbatch=2, zero=zero, recompute="none", offload_optimizer=offload)
    return get_space(SPACE).build(Context(g, spec, 8, cluster, 1 if cluster != "cpu" else n, n, 1), knobs), g


def _update(program, dev=0):
    return next(b for k, b in program.devices[dev].blocks.items() if k[1] == "U").tasks


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_each_step_becomes_copy_to_host_host_step_copy_to_device(zero):
    plan, g = _plan(2, zero)
    program = materialize(plan, g)
    find_deadlock(program)
    tasks = _update(program)
    assert not [t for t in tasks if t.kind is TaskKind.OPTIMIZER and t.role is not Role.HOST_STEP]
    steps = [i for i, t in enumerate(tasks) if t.role is Role.HOST_STEP]
    assert steps
    for i in steps:
        to_host, step, to_device = tasks[i - 1], tasks[i], tasks[i + 1]
        assert (to_host.role, to_device.role) == (Role.TO_HOST, Role.TO_DEVICE)
        assert {b.kind for b in to_host.writes} == {BufferKind.HOST_GRAD}
        assert set(step.reads) == set(to_host.writes) | set(step.writes)
        assert to_device.reads == step.writes and {b.kind for b in step.writes} == {BufferKind.HOST_WEIGHT}
        assert to_host.nbytes == step.params * FP32.grad_bytes and to_device.nbytes == step.params * FP32.param_bytes


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_the_optimizer_states_move_from_device_to_host_memory(zero):
    plan, g = _plan(2, zero, offload=False)
    on_device = materialize(plan, g).devices[0]
    plan, g = _plan(2, zero)
    off = materialize(plan, g).devices[0]
    assert on_device.host_bytes == 0 and off.optimizer_bytes == 0
    assert off.static_bytes == on_device.static_bytes - on_device.optimizer_bytes
    stepped = sum(t.params for t in _update(materialize(plan, g)) if t.role is Role.HOST_STEP)
    assert off.host_bytes == stepped * host_bytes_per_param(FP32) == stepped * (8 + 4 + 4)  # m, v; master; grad


def test_simulated_peak_drops_by_the_states_and_the_step_costs_the_host_link_and_cpu():
    cost = CostModel.load("dgx-2-v100")
    host = cost.cluster.node.host
    res = {}
    for off in (False, True):
        plan, g = _plan(2, 0, off, cluster="dgx-2-v100")
        program = build_program(plan, g, cost)
        res[off] = (simulate(program, cost), program)
    (plain, p0), (offl, p1) = res[False], res[True]
    assert plain.peak_mem_bytes - offl.peak_mem_bytes == p0.devices[0].optimizer_bytes
    tasks = _update(p1)
    copies = [t for t in tasks if t.role in (Role.TO_HOST, Role.TO_DEVICE)]
    assert [cost.task_time_s(t, "fp32") for t in copies] == pytest.approx(
        [t.nbytes * host.devices_per_link / host.link_bytes_per_s for t in copies]
    )
    step = next(t for t in tasks if t.role is Role.HOST_STEP)
    assert cost.task_time_s(step, "fp32") == pytest.approx(step.params / host.adam_params_per_s)
    assert offl.feasible and offl.host_peak_bytes == 2 * p1.devices[0].host_bytes
    # explore's lower bound on device memory leaves the offloaded states out, and stays a bound
    bound = {off: sum(memory_lower_bound_bytes(_plan(2, 0, off, "dgx-2-v100")[0], g, cost.precision)) for off in res}
    assert bound[True] <= offl.peak_mem_bytes and bound[False] - bound[True] == p0.devices[0].optimizer_bytes


def test_host_memory_overflow_is_an_out_of_memory_result(tmp_path):
    spec = json.loads((SPEC_DIR / "dgx-2-v100.json").read_text())
    spec["host"]["memory_GB"] = 1e-4  # 100 kB of host memory
    path = tmp_path / "small-host.json"
    path.write_text(json.dumps(spec))
    cost = CostModel.load(str(path))
    plan, g = _plan(2, 0, cluster="dgx-2-v100")
    r = simulate(build_program(plan, g, cost), cost)
    assert not r.feasible and r.reason.startswith("out of host memory")


def test_a_cluster_without_a_host_side_refuses_offloading_in_one_line():
    cost = CostModel.load("cpu", nodes=2)
    plan, g = _plan(2, 0)
    with pytest.raises(ConfigError, match="gives no host side") as e:
        simulate(materialize(plan, g), cost)
    assert "\n" not in str(e.value)


def test_plan_files_keep_the_option_and_refuse_a_bad_value():
    plan, _ = _plan(2, 1)
    assert plan_from_json(plan_to_json(plan)).offload_optimizer is True
    d = plan_to_dict(plan)
    d["offload_optimizer"] = "yes"
    with pytest.raises(PlanFileError, match="offload_optimizer.*true or false"):
        plan_from_json(json.dumps(d))
    spec, g = traced("gpt-tiny", 8)
    builder = PlanBuilder(g, model=spec, global_batch=8, cluster="cpu", nodes=1, num_devices=1)
    with pytest.raises(InfeasiblePlan, match="expected True or False"):
        builder.offload_optimizer("yes")


def test_the_screen_sees_the_memory_saved_and_the_host_step():
    cost = CostModel.load("dgx-2-v100")
    spec, g = traced("gpt-tiny", 8)
    ctx = Context(g, spec, 8, "dgx-2-v100", 1, 2, 1)
    space, screen = get_space(SPACE), Screen(g, cost, cost.precision)
    est = {}
    for off in (False, True):
        est[off] = screen.estimate(space.draft(ctx, dict(dp=2, microbatch=2, zero=0, offload_optimizer=off)))
    program = build_program(space.build(ctx, dict(dp=2, microbatch=2, zero=0, offload_optimizer=False)), g, cost)
    assert est[False].static_bytes - est[True].static_bytes == pytest.approx(program.devices[0].optimizer_bytes)
    assert est[True].time_s != est[False].time_s


@pytest.mark.parametrize("n, zero", [(2, 2), pytest.param(4, 1, marks=pytest.mark.slow)])
def test_offloaded_plans_match_one_process_on_gloo(n, zero):
    """The host masters (tensors of their own, with their own Adam) are stepped and copied back
    as the plan says: two steps match one process."""
    plan, _ = _plan(n, zero)
    res = launch_local(plan, n, steps=2, lr=1e-2, record=True)
    assert res.max_loss_error <= LOSS_TOL, (res.losses, res.ref_losses)
    assert res.max_grad_error <= GRAD_TOL
    assert res.losses[1] < res.losses[0]
    ran = {t["task"].split(":")[0] for t in res.timeline if t["device"] == 0}
    assert {"grads-to-host", "host-optimizer", "weights-to-device"} <= {r.split("-shard")[0] for r in ran}
