"""Calibration: fitting recovers known parameters from synthetic measurements (pure functions),
profiles round-trip and refuse malformed files, a profile's measurements take precedence over the
spec's models, and one quick end-to-end ``planlab calibrate`` run on 2 gloo processes."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from planlab.costmodel import CostModel, load_cluster
from planlab.costmodel.fit import (
    AlphaBeta,
    Roofline,
    fit_alpha_beta,
    fit_linear,
    fit_roofline,
    robust_overhead,
    roofline_time_s,
)
from planlab.costmodel.hardware import Efficiency
from planlab.costmodel.calibrate import expected_s, fit_collectives, fit_optimizer, typical_s
from planlab.costmodel.profile import CollectiveFit, KernelTime, OptimizerFit, Profile, load_profile
from planlab.errors import ConfigError
from planlab.plan.buffer import activation, weight
from planlab.plan.program import Task, TaskKind

MiB = 2**20


# ---------------------------------------------------------------- fitting known parameters


@pytest.mark.parametrize(
    "alpha_s, bytes_per_s, noise",
    [(50e-6, 4e9, 0.0), (2e-6, 200e9, 0.0), (300e-6, 0.8e9, 0.0), (50e-6, 4e9, 0.02), (1e-3, 1e9, 0.02)],
)
def test_fit_alpha_beta_recovers_parameters(alpha_s: float, bytes_per_s: float, noise: float) -> None:
    rng = np.random.default_rng(1)
    sizes = [4096 * 4**k for k in range(8)]  # 4 KiB .. 64 MiB
    pts = [(n, (alpha_s + n / bytes_per_s) * (1 + noise * rng.standard_normal())) for n in sizes]
    fit = fit_alpha_beta(pts)
    tol = 1e-6 if noise == 0 else 0.1
    assert fit.alpha_s == pytest.approx(alpha_s, rel=tol)
    assert fit.bytes_per_s == pytest.approx(bytes_per_s, rel=tol)


TRUE = dict(peak=150e9, ec=Efficiency(1.0, 2e6, 1.0), bw=12e9, em=Efficiency(1.0, 0.3 * MiB, 0.8), launch=4e-6)


def _kernel_shapes() -> list[tuple[float, float]]:
    """(flop, bytes) of square and skinny fp32 matmuls and of elementwise kernels."""
    shapes = [(2.0 * n**3, 12.0 * n * n) for n in (32, 64, 128, 256, 512, 1024)]
    shapes += [(2.0 * m * k * k, 4.0 * (2 * m * k + k * k)) for m in (256, 2048) for k in (64, 256)]
    shapes += [(float(n), 12.0 * n) for n in (1e3, 1e4, 1e5, 1e6, 4e6)]
    return shapes


@pytest.mark.parametrize("noise", [0.0, 0.02])
def test_fit_roofline_recovers_parameters(noise: float) -> None:
    rng = np.random.default_rng(0)
    t = TRUE
    data = [
        (
            f,
            b,
            roofline_time_s(f, b, t["peak"], t["ec"], t["bw"], t["em"], t["launch"])
            * (1 + noise * rng.standard_normal()),
        )
        for f, b in _kernel_shapes()
    ]
    fit = fit_roofline(data, launch_s=t["launch"])
    if noise == 0:  # exact data: every parameter back
        assert fit.peak_flops_per_s == pytest.approx(t["peak"], rel=0.01)
        assert fit.bytes_per_s == pytest.approx(t["bw"], rel=0.01)
        assert fit.compute_efficiency.half == pytest.approx(t["ec"].half, rel=0.03)
        assert fit.compute_efficiency.exponent == pytest.approx(t["ec"].exponent, rel=0.03)
        assert fit.memory_efficiency.half == pytest.approx(t["em"].half, rel=0.03)
        assert fit.memory_efficiency.exponent == pytest.approx(t["em"].exponent, rel=0.03)
    else:  # 2% noise: the rates within 5%, and the fitted model predicts every kernel within 6%
        assert fit.peak_flops_per_s == pytest.approx(t["peak"], rel=0.05)
        assert fit.bytes_per_s == pytest.approx(t["bw"], rel=0.05)
    for f, b in _kernel_shapes():
        true = roofline_time_s(f, b, t["peak"], t["ec"], t["bw"], t["em"], t["launch"])
        assert fit.time_s(f, b) == pytest.approx(true, rel=0.06 if noise else 0.005)


@pytest.mark.parametrize("fixed_s, per_tensor_s, per_param_s", [(80e-6, 50e-6, 4e-9), (0.0, 20e-6, 1e-9)])
def test_fit_optimizer_recovers_parameters(fixed_s: float, per_tensor_s: float, per_param_s: float) -> None:
    grid = [(1, 1000), (1, 10**6), (8, 1000), (32, 32000), (64, 4000), (8, 800_000)]
    fit = fit_optimizer([(k, n, fixed_s + per_tensor_s * k + per_param_s * n) for k, n in grid])
    assert (fit.fixed_s, fit.per_tensor_s, fit.per_param_s) == pytest.approx(
        (fixed_s, per_tensor_s, per_param_s), rel=1e-6, abs=1e-12
    )


def test_fit_collectives_from_points() -> None:
    measured = {
        "all_reduce/2": [[n, 90e-6 + n / 1.5e9] for n in (4096, 65536, MiB, 4 * MiB)],
        "p2p/2": [[n, 40e-6 + n / 3e9] for n in (4096, MiB)],
    }
    fits = {(c.kind, c.ranks): c for c in fit_collectives(measured)}
    assert fits[("all_reduce", 2)].fit.alpha_s == pytest.approx(90e-6)
    assert fits[("all_reduce", 2)].fit.bytes_per_s == pytest.approx(1.5e9)
    assert fits[("p2p", 2)].fit.time_s(MiB) == pytest.approx(40e-6 + MiB / 3e9)


@pytest.mark.parametrize(
    "values, expected",
    [([5.0, 5.0, 5.0], 5.0), ([1.0, 2.0, 3.0, 4.0, 5.0], 2.0), ([1.0, 1.0, 1.0, 50.0], 1.0), ([7.0], 7.0)],
)
def test_typical_is_the_lower_quartile(values: list[float], expected: float) -> None:
    assert typical_s(values) == pytest.approx(expected)


def test_robust_overhead_ignores_preempted_tasks() -> None:
    assert robust_overhead([20e-6, 22e-6, 21e-6, 5e-3, 19e-6]) == pytest.approx(21e-6)
    assert robust_overhead([-1e-6, -2e-6, 1e-6]) == 0.0  # never negative


@pytest.mark.parametrize(
    "call, fragment",
    [
        (lambda: fit_alpha_beta([(1, 1e-3)]), "at least 2"),
        (lambda: fit_alpha_beta([(4096, 1e-3), (4096, 2e-3)]), "two different sizes"),
        (lambda: fit_alpha_beta([(4096, 1e-3), (8192, -1.0)]), "times > 0"),
        (lambda: fit_roofline([(1.0, 1.0, 1.0)] * 3), "at least 6"),
        (lambda: fit_linear([[1.0, 2.0, 3.0]], [1.0]), "at least as many"),
        (lambda: robust_overhead([]), "at least one"),
    ],
)
def test_fit_errors(call, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        call()


# ---------------------------------------------------------------- profiles: files and precedence


ROOF = Roofline(100e9, Efficiency(1.0, 1e6, 1.0), 10e9, Efficiency(1.0, 0.1 * MiB, 1.0), 3e-6)
LINEAR_F = KernelTime("F", "linear", "fp32", (512, 64, 256), 2.0 * 512 * 64 * 256, 700_000.0, 400e-6)


def toy_profile() -> Profile:
    return Profile(
        device="cpu",
        rooflines=(("fp32", ROOF),),
        task_overhead_s=(("B", 60e-6), ("F", 20e-6), ("L", 10e-6)),
        optimizer=OptimizerFit(100e-6, 50e-6, 4e-9),
        collectives=(
            CollectiveFit("all_reduce", 2, AlphaBeta(90e-6, 1.5e9), ((4096.0, 93e-6),)),
            CollectiveFit("p2p", 2, AlphaBeta(40e-6, 3e9)),
        ),
        kernels=(LINEAR_F, KernelTime("B", "linear", "fp32", (512, 64, 256), 2 * LINEAR_F.flops, 700_000.0, 900e-6)),
        meta=(("host", "test"), ("quick", True)),
        view_task_s=(("B", 25e-6), ("F", 12e-6)),
    )


def _close(a, b) -> bool:
    """Equal up to float rounding (units are converted on the way out and back), field by field."""
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-18)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if hasattr(a, "__dataclass_fields__"):
        return type(a) is type(b) and all(
            _close(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__ if f not in ("meta", "path")
        )
    return a == b


def test_profile_round_trips(tmp_path) -> None:
    prof = toy_profile()
    path = prof.save(tmp_path / "p.json")
    back = load_profile(path)
    assert _close(back, prof) and back.path == str(path)
    assert json.loads(path.read_text())["format"] == "planlab-profile"
    assert dict(back.meta)["host"] == "test"


def test_a_flat_collective_curve_saves_a_profile_that_loads(tmp_path) -> None:
    """Noise can hide the bytes' cost of a collective (times flat or falling with size, as on a busy
    machine during `calibrate --quick`): the fit keeps a finite bandwidth that the file accepts."""
    for pts in ([(4096, 5e-4), (2**20, 5e-4), (2**24, 5e-4)], [(4096, 9e-4), (2**20, 6e-4), (2**24, 5e-4)]):
        fit = fit_alpha_beta(pts)
        assert fit.bytes_per_s == 1e13 and fit.alpha_s > 0
        prof = dataclasses.replace(toy_profile(), collectives=(CollectiveFit("broadcast", 2, fit, tuple(pts)),))
        back = load_profile(prof.save(tmp_path / "flat.json"))
        assert back.collectives[0].fit.bytes_per_s == pytest.approx(1e13)


def _broken(**changes) -> dict:
    obj = toy_profile().to_json()
    for key, value in changes.items():
        if value is None:
            del obj[key]
        else:
            obj[key] = value
    return obj


@pytest.mark.parametrize(
    "content, fragments",
    [
        ("{oops", ["cannot read JSON"]),
        (_broken(format="planlab-plan"), ["'format'", "'planlab-profile'"]),
        (_broken(version=7), ["'version'", "version 1"]),
        (_broken(device=None), ["'device'", "missing"]),
        (_broken(kernel_model={"fp64": {}}), ["'kernel_model.fp64'", "dtype", "'bf16'"]),
        (
            _broken(kernel_model={"fp32": dict(toy_profile().to_json()["kernel_model"]["fp32"], peak_gflops=-1)}),
            ["'kernel_model.fp32.peak_gflops'", "GFLOP/s", "-1"],
        ),
        (_broken(task_overhead_us={"F": 20, "X": 3}), ["'task_overhead_us.X'", "not a known field"]),
        (_broken(task_overhead_us={"F": 5e7}), ["'task_overhead_us.F'", "microseconds", "[0, 1e+06]"]),
        (
            _broken(collectives=[{"kind": "allreduce", "ranks": 2, "alpha_us": 1, "GBps": 1}]),
            ["'collectives[0].kind'", "'all_reduce'"],
        ),
        (
            _broken(collectives=[{"kind": "all_reduce", "ranks": 0, "alpha_us": 1, "GBps": 1}]),
            ["'collectives[0].ranks'", "integer >= 1"],
        ),
        (
            _broken(collectives=[{"kind": "all_reduce", "ranks": 2, "alpha_us": 1, "GBps": 1, "points": [[1]]}]),
            ["'collectives[0].points'", "[bytes, microseconds] pairs"],
        ),
        (
            _broken(kernels=[dict(toy_profile().to_json()["kernels"][0], shape=[4, -1])]),
            ["'kernels[0].shape'", "positive integers"],
        ),
        (
            _broken(kernels=[dict(toy_profile().to_json()["kernels"][0], time_us=0)]),
            ["'kernels[0].time_us'", "microseconds"],
        ),
        (_broken(kernels={"a": 1}), ["'kernels'", "JSON list"]),
        (_broken(view_task_us={"F": 1, "C": 2}), ["'view_task_us.C'", "not a known field"]),
        (_broken(concurrent_slowdown={"1": 1.5}), ["'concurrent_slowdown.1'", "ranks >= 2"]),
        (_broken(concurrent_slowdown={"2": 0}), ["'concurrent_slowdown.2'", "factor on compute times"]),
    ],
)
def test_malformed_profile(tmp_path, content, fragments: list[str]) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ConfigError) as info:
        load_profile(path)
    for fragment in [str(path), *fragments]:
        assert fragment in str(info.value)


def test_profile_for_another_device_is_refused() -> None:
    with pytest.raises(ConfigError, match="calibrates device 'cpu'.*'a100-80g'"):
        CostModel(load_cluster("dgx-a100-80g"), toy_profile())


@pytest.mark.parametrize(
    "flops, bytes_moved, phase, expected_s",
    [
        # the measured shape itself: its measured time
        (LINEAR_F.flops, LINEAR_F.bytes_moved, "F", 400e-6),
        # the backward entry for the backward phase
        (2 * LINEAR_F.flops, LINEAR_F.bytes_moved, "B", 900e-6),
        # a near shape (1.5x the flop): the measured time scaled by the fitted model's ratio
        (
            1.5 * LINEAR_F.flops,
            LINEAR_F.bytes_moved,
            "F",
            400e-6 * ROOF.time_s(1.5 * LINEAR_F.flops, 700_000.0) / ROOF.time_s(LINEAR_F.flops, 700_000.0),
        ),
        # far from every measured shape: the fitted roofline
        (1e10, 1e8, "F", ROOF.time_s(1e10, 1e8)),
        (1e3, 1e4, None, ROOF.time_s(1e3, 1e4)),
    ],
)
def test_profiled_table_takes_precedence_over_the_roofline(flops, bytes_moved, phase, expected_s) -> None:
    assert toy_profile().kernel_time_s(flops, bytes_moved, "fp32", phase) == pytest.approx(expected_s)


def test_the_table_prices_an_operator_by_its_own_kind() -> None:
    """A layer norm and a GELU of the same flop and bytes take different times: a task priced by
    its operator's kind takes its own kind's entry; a kind the table lacks, the nearest of any."""
    ln = KernelTime("F", "layer_norm", "fp32", (512, 64), 1e5, 3e5, 50e-6)
    gelu = KernelTime("F", "activation", "fp32", (512, 64), 1e5, 3e5, 120e-6)
    prof = dataclasses.replace(toy_profile(), kernels=(ln, gelu))
    assert prof.kernel_time_s(1e5, 3e5, "fp32", "F", "layer_norm") == pytest.approx(50e-6)
    assert prof.kernel_time_s(1e5, 3e5, "fp32", "F", "activation") == pytest.approx(120e-6)
    assert prof.kernel_time_s(1e5, 3e5, "fp32", "F", "softmax") in (50e-6, 120e-6)  # not measured: any kind
    cost = CostModel(load_cluster("cpu", 1), prof)
    task = _task(TaskKind.FORWARD, flops=1e5, bytes_moved=3e5, op_kind="layer_norm")
    assert cost.task_time_s(task, "fp32") == pytest.approx(50e-6 + 20e-6)


def test_a_time_above_a_larger_kernels_is_capped() -> None:
    """An entry measured slower than an entry of its kind that does more work (a busy machine
    preempted all its samples) is priced at the larger kernel's time; other kinds are untouched."""
    small = KernelTime("F", "layer_norm", "fp32", (128, 32), 2e4, 3e4, 130e-6)
    big = KernelTime("F", "layer_norm", "fp32", (128, 64), 4e4, 6e4, 50e-6)
    other = KernelTime("F", "add", "fp32", (128, 64), 4e4, 6e4, 10e-6)
    prof = dataclasses.replace(toy_profile(), kernels=(small, big, other))
    assert [k.time_s for k in prof.envelope] == [50e-6, 50e-6, 10e-6]
    assert prof.kernel_time_s(2e4, 3e4, "fp32", "F", "layer_norm") == pytest.approx(50e-6)


@pytest.mark.parametrize("p, work", [(0.0, False), (0.1, True)])
def test_a_dropout_of_p_zero_does_no_work(p: float, work: bool) -> None:
    """F.dropout with p = 0 returns its input (no kernel): traced without flop or bytes, it is
    priced as the view it is."""
    from planlab.graph.trace import trace
    from planlab.models.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(layers=1, hidden=32, heads=2, seq=8, vocab=64, dropout=p))
    graph = trace(model, (torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))))
    drops = [op for op in graph.operators if op.kind == "dropout"]
    assert drops and all((op.flops > 0 and op.bytes_moved > 0) == work for op in drops)


def _task(kind: TaskKind, **kw) -> Task:
    return Task("t", kind, **kw)


@pytest.mark.parametrize(
    "task, expected_s",
    [
        # a forward linear of the measured shape: its kernel + the executor's 20 us per forward task
        (_task(TaskKind.FORWARD, flops=LINEAR_F.flops, bytes_moved=700_000.0), 400e-6 + 20e-6),
        (_task(TaskKind.BACKWARD, flops=2 * LINEAR_F.flops, bytes_moved=700_000.0), 900e-6 + 60e-6),
        # a view: no kernel, but the executor still runs the task: its measured whole time
        (_task(TaskKind.FORWARD), 12e-6),
        (_task(TaskKind.BACKWARD), 25e-6),
        # the optimizer over 3 tensors of 1,000 parameters in all (12 flop per parameter)
        (
            _task(
                TaskKind.OPTIMIZER,
                writes=(weight("a"), weight("b"), weight("c")),
                flops=12_000.0,
                bytes_moved=1.0,
                params=1000.0,
            ),
            100e-6 + 3 * 50e-6 + 1000 * 4e-9,
        ),
        # a local copy of 4 KiB: 8 KiB of traffic on the roofline + 10 us
        (_task(TaskKind.LOCAL, alloc=((activation("x"), 4096),)), ROOF.time_s(0.0, 8192.0) + 10e-6),
        # an all-reduce of 1 MiB over 2 ranks: the fit
        (_task(TaskKind.COLLECTIVE, collective="all_reduce", group=(0, 1), nbytes=MiB), 90e-6 + MiB / 1.5e9),
        (_task(TaskKind.SEND, peer=1, nbytes=MiB), 0.0),
    ],
)
def test_task_time_with_a_profile(task: Task, expected_s: float) -> None:
    cost = CostModel(load_cluster("cpu", 2), toy_profile())
    assert cost.task_time_s(task, "float32") == pytest.approx(expected_s)


@pytest.mark.parametrize("devices, factor", [(1, 1.0), (2, 1.5), (3, 1.5), (4, 2.0), (8, 2.0)])
def test_compute_slows_while_every_process_computes(devices: int, factor: float) -> None:
    """Measured at 2 and 4 busy processes: 3 takes 2's factor, more take 4's; one process none."""
    prof = dataclasses.replace(toy_profile(), slowdown=((2, 1.5), (4, 2.0)))
    assert prof.slowdown_at(devices) == factor
    task = _task(TaskKind.FORWARD, flops=LINEAR_F.flops, bytes_moved=700_000.0)
    cost = CostModel(load_cluster("cpu", devices), prof)
    assert cost.task_time_s(task, "float32") == pytest.approx((400e-6 + 20e-6) * factor)
    # collectives were measured with every rank running: no factor
    if devices >= 2:
        assert cost.collective_time_s("all_reduce", MiB, (0, 1)) == pytest.approx(90e-6 + MiB / 1.5e9)


def test_collectives_carried_to_other_group_sizes_and_p2p() -> None:
    cost = CostModel(load_cluster("cpu", 4), toy_profile())
    # measured at 2 ranks (2 ring steps, traffic 1): 4 ranks have 6 steps and traffic 1.5
    assert cost.collective_time_s("all_reduce", MiB, (0, 1, 2, 3)) == pytest.approx(3 * 90e-6 + 1.5 * MiB / 1.5e9)
    assert cost.p2p_time_s(MiB, 0, 3) == pytest.approx(40e-6 + MiB / 3e9)
    # not measured: the spec's model
    spec = CostModel(load_cluster("cpu", 4))
    assert cost.collective_time_s("all_gather", MiB, (0, 1)) == spec.collective_time_s("all_gather", MiB, (0, 1))
    assert cost.collective_time_s("all_reduce", MiB, (2,)) == 0.0


def test_without_a_profile_tasks_cost_what_the_spec_says() -> None:
    """``task_time_s`` without a profile prices every task of a real Program as the simulator's
    own rule does (compute by the roofline, no work no time, copies as traffic)."""
    from conftest import traced

    from planlab.plan.materialize import materialize
    from planlab.search_spaces import Context, get_space
    from planlab.simulator.units import task_time_s

    spec, graph = traced("gpt-tiny", 8)
    plan = get_space("megatron").build(Context(graph, spec, 8, "cpu", 2, 2, 1), dict(dp=1, tp=2, pp=1, microbatch=4))
    program = materialize(plan, graph)
    cost = CostModel.load("cpu", 2)
    kinds = set()
    for dev in program.devices:
        for _, t in dev.tasks_in_order():
            if t.kind in (TaskKind.SEND, TaskKind.RECV):
                continue
            kinds.add(t.kind)
            assert cost.task_time_s(t, "float32") == pytest.approx(task_time_s(t, cost, "float32"), abs=1e-15)
    assert {TaskKind.FORWARD, TaskKind.BACKWARD, TaskKind.COLLECTIVE, TaskKind.OPTIMIZER} <= kinds


# ---------------------------------------------------------------- one quick end-to-end run


@pytest.fixture(scope="module")
def quick_profile(tmp_path_factory):
    """``planlab calibrate --quick`` on this machine (2 gloo processes for the collectives)."""
    from planlab.cli import main

    out = tmp_path_factory.mktemp("calibrate") / "profile.json"
    assert main(["calibrate", "--quick", "--out", str(out)]) == 0
    return out


def test_quick_calibration_end_to_end(quick_profile) -> None:
    prof = load_profile(quick_profile)
    assert prof.device == "cpu" and dict(prof.meta)["quick"] is True
    roof = prof.roofline("fp32")
    assert roof is not None and 1e9 < roof.peak_flops_per_s < 1e13  # between 1 GFLOP/s and 10 TFLOP/s
    assert 0 < roof.launch_s < 1e-3
    kinds = {(k.phase, k.kind) for k in prof.kernels}
    assert {("F", "linear"), ("B", "linear"), ("F", "attention"), ("F", "layer_norm")} <= kinds
    assert all(k.time_s > 0 and k.flops >= 0 for k in prof.kernels)
    assert {"F", "B", "L"} <= {k for k, _ in prof.task_overhead_s}
    assert {"F", "B"} == {k for k, _ in prof.view_task_s} and all(0 < v < 1e-3 for _, v in prof.view_task_s)
    assert dict(prof.slowdown).keys() == {2} and 0.3 < prof.slowdown_at(2) < 5
    fits = {(c.kind, c.ranks) for c in prof.collectives}
    assert {("all_reduce", 2), ("all_gather", 2), ("reduce_scatter", 2), ("broadcast", 2), ("p2p", 2)} <= fits
    for c in prof.collectives:  # loopback gloo: microseconds to tens of milliseconds, MB/s to tens of GB/s
        assert 0 <= c.fit.alpha_s < 0.05 and 1e7 < c.fit.bytes_per_s < 1e11, c
    # a measured linear forward is priced by the table (as measured, capped by the larger cases of its
    # kind that a busy machine did not disturb: the envelope, plus the executor's cost per task)
    i, k = next((i, k) for i, k in enumerate(prof.kernels) if (k.phase, k.kind) == ("F", "linear"))
    assert prof.envelope[i].time_s <= k.time_s
    cost = CostModel.load("cpu", 1, profile=quick_profile)  # one process: no slowdown
    task = Task("x", TaskKind.FORWARD, flops=k.flops, bytes_moved=k.bytes_moved, op_kind="linear")
    assert cost.task_time_s(task, "float32") == pytest.approx(prof.envelope[i].time_s + prof.overhead_s("F"))


def test_cli_uses_the_profile(quick_profile, tmp_path, capsys) -> None:
    from conftest import traced

    from planlab.cli import main
    from planlab.plan import save_plan
    from planlab.search_spaces import Context, get_space

    spec, graph = traced("gpt-tiny", 8)
    plan = get_space("megatron").build(Context(graph, spec, 8, "cpu", 2, 2, 1), dict(dp=2, tp=1, pp=1, microbatch=4))
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    times = {}
    for name, extra in (("spec", []), ("profile", ["--profile", str(quick_profile)])):
        assert main(["simulate", str(path), "--json", *extra]) == 0
        times[name] = json.loads(capsys.readouterr().out)["iter_time_s"]
    assert times["spec"] != times["profile"] and all(math.isfinite(t) and t > 0 for t in times.values())
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["simulate", str(path), "--profile", str(bad)]) == 2
    assert str(bad) in capsys.readouterr().err


def test_replaying_measured_tasks() -> None:
    """benchmarks/validate_cpu.py's replay: compute tasks at their measured lower quartile (a
    backward apart from its forward, which has the same name), a
    collective at its shortest member's duration per launch (the last to arrive waits least),
    the optimizer at the profile's price; simulated, the iteration is their sum on one device."""
    import sys
    from pathlib import Path

    from conftest import traced
    from planlab.plan import materialize
    from planlab.search_spaces import Context, get_space
    from planlab.simulator.engine import simulate

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    from validate_cpu import ReplayCost

    spec, g = traced("gpt-tiny", 8)
    plan = get_space("megatron").build(Context(g, spec, 8, "cpu", 2, 2, 1), dict(dp=1, tp=2, pp=1, microbatch=8))
    program = materialize(plan, g)
    cost = CostModel(load_cluster("cpu", 2), toy_profile())
    durations, compute, collectives = {}, 0.0, 0
    for dev in program.devices:
        for action, t in dev.tasks_in_order():
            key = (dev.device, str(action), t.name, t.kind.value, 1)
            if t.kind is TaskKind.BACKWARD:  # an operator's backward has its forward's name, not its time
                durations[key] = [6e-4, 2e-4, 4e-4, 9e-3]  # lower quartile 3.5e-4
                compute += 3.5e-4 if dev.device == 0 else 0.0
            elif t.kind in (TaskKind.FORWARD, TaskKind.LOCAL):
                durations[key] = [3e-4, 1e-4, 2e-4, 9e-3]  # lower quartile 1.75e-4
                compute += 1.75e-4 if dev.device == 0 else 0.0
            elif t.kind is TaskKind.COLLECTIVE and not t.overlap:
                durations[key] = [2e-3, 4e-3] if dev.device == 0 else [1e-3, 5e-3]  # per launch min: 1e-3, 4e-3
                collectives += dev.device == 0
    replay = ReplayCost(cost, program, durations)
    opt = next(t for _, t in program.devices[0].tasks_in_order() if t.kind is TaskKind.OPTIMIZER)
    expected = compute + collectives * typical_s([1e-3, 4e-3]) + cost.task_time_s(opt, "fp32")
    assert collectives > 0
    assert simulate(program, replay).iter_time_s == pytest.approx(expected, rel=1e-9)


def test_a_heavy_tailed_collective_is_priced_at_its_mean_without_the_rarest_outliers():
    # 80 fast repetitions, 18 woken a tick late, 2 preempted by other work: the kernels' lower
    # quartile would say 1 ms; an iteration pays about the mean of the 98 that are the collective's own
    times = [1e-3] * 80 + [5e-3] * 18 + [0.2, 0.3]
    assert typical_s(times) == pytest.approx(1e-3)
    assert expected_s(times) == pytest.approx((80 * 1e-3 + 18 * 5e-3) / 98)
    assert expected_s([2e-3]) == pytest.approx(2e-3)
    with pytest.raises(Exception, match="no measurements"):
        expected_s([])
