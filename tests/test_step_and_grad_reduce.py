"""The work around the optimizer step without ZeRO, as the training software's code does it:
DeepSpeed's fp16 step (``FP16_Optimizer.step``: its passes and its per-tensor overflow check), and
each software's passes over a gradient bucket around its all-reduce (DeepSpeed's
``allreduce_and_copy``, Megatron's division by the data-parallel size)."""

from __future__ import annotations

import dataclasses

import pytest

from planlab.costmodel import CostModel
from planlab.costmodel.software import Fusion
from planlab.plan.buffer import weight, weight_grad
from planlab.plan.program import Role, Task, TaskKind

CLUSTER = "hgx-a100-80g-4nic"  # vTrain's system (planlab.validation)


def cost_of(software: str) -> CostModel:
    return CostModel.load(CLUSTER, 1, software=software, precision="fp16")


def step(params: float, tensors: int, role: Role = Role.PLAIN) -> Task:
    names = [f"w{i}" for i in range(tensors)]
    return Task(
        "optimizer",
        TaskKind.OPTIMIZER,
        tuple(weight(n) for n in names) + tuple(weight_grad(n) for n in names),
        tuple(weight(n) for n in names),
        params=params,
        role=role,
    )


def pass_s(cost: CostModel, nbytes: float) -> float:
    dev = cost.cluster.device
    return nbytes / (dev.hbm_bytes_per_s * dev.memory_efficiency.at(nbytes)) + dev.launch_overhead_s


def test_the_fp16_step_moves_70_bytes_a_parameter_and_syncs_once_a_tensor() -> None:
    cost = cost_of("deepspeed")
    sw = cost.software
    # check (2 + 4 + 4), cast and flatten (6 + 8), norm (4), unscale (8), Adam (28), copy back (6)
    assert cost.precision.optimizer_pass_bytes == 10 + 14 + 4 + 8 + 28 + 6
    issue_s = 2 * (sw.host_call_s + sw.host_launch_s)  # x.float() and .sum(), then float() waits
    device_s, host_s = cost.device_and_host_s(step(1e8, 5), "fp16")
    assert device_s == pytest.approx(pass_s(cost, 70e8) + 5 * issue_s)
    assert host_s == pytest.approx(sw.host_call_s + sw.host_launch_s)  # the gaps are the device's, once
    # twice the tensors, twice the synchronizations; the bytes stay
    more = cost.device_and_host_s(step(1e8, 10), "fp16")[0]
    assert more - device_s == pytest.approx(5 * issue_s)


def test_the_per_tensor_check_is_the_whole_weight_steps_only() -> None:
    ds = cost_of("deepspeed")
    shard = ds.device_and_host_s(step(1e8, 5, Role.SHARD_STEP), "fp16")[0]  # ZeRO's own optimizers
    assert shard == pytest.approx(pass_s(ds, 70e8))
    mg = cost_of("megatron")  # one multi-tensor check (_amp_foreach_non_finite_check_and_unscale_)
    assert not mg.precision.per_tensor_overflow_check
    assert mg.device_and_host_s(step(1e8, 5), "fp16")[0] == pytest.approx(pass_s(mg, 1e8 * 52))


@pytest.mark.parametrize(
    "software, copies",
    [
        ("deepspeed", 3),  # flatten into the bucket, multiply by 1/dp, copy back (allreduce_and_copy)
        ("megatron-2019", 3),  # flatten, divide after the all-reduce, copy back (allreduce_params)
        ("megatron-2022", 1),  # the contiguous buffer divided by dp in place
        ("megatron", 1),  # Megatron-Core's grad_data *= gradient_scaling_factor
        ("torch", 0),
    ],
)
def test_a_gradient_bucket_pays_the_softwares_passes(software: str, copies: int) -> None:
    cost = cost_of(software)
    sw = cost.software
    nbytes, group = 2 * 500_000_000, tuple(range(8))  # a bucket of 5e8 fp16 gradients over 8 ranks

    def bucket(role: Role) -> Task:
        return Task("grad-reduce", TaskKind.COLLECTIVE, collective="all_reduce", group=group, nbytes=nbytes, role=role)

    ring_s = cost.collective_time_s("all_reduce", nbytes, group)
    assert sw.grad_reduce_copies == copies
    got, host = cost.device_and_host_s(bucket(Role.BUCKET), "fp16")
    assert got == pytest.approx(ring_s + copies * (pass_s(cost, 2.0 * nbytes) if copies else 0.0))
    assert host == pytest.approx(sw.host_collective_s + copies * sw.host_launch_s)
    # another all-reduce (a tensor-parallel one) pays none
    assert cost.device_and_host_s(bucket(Role.PLAIN), "fp16")[0] == pytest.approx(ring_s)


@pytest.mark.parametrize(
    "model, merged",
    [
        ("gpt-tiny", {Fusion.QKV: 2 * 4}),  # two layers: q, k, v weights as one tensor, their biases as another
        ("llama-tiny", {Fusion.QKV: 2 * 2, Fusion.GATE_UP: 2 * 1}),  # no biases; gate and up as one weight
    ],
)
def test_the_overflow_check_counts_the_tensors_as_megatron_holds_them(model: str, merged: dict) -> None:
    """Megatron's query_key_value (and linear_fc1 of gate and up) is one tensor where the graph keeps
    three (two): a software fusing them checks that many fewer tensors; one that does not, every one."""
    from conftest import traced
    from planlab.plan import materialize
    from planlab.search_spaces import Context, get_space

    spec, g = traced(model, 8)
    plan = get_space("megatron").build(Context(g, spec, 8, "cpu", 2, 2, 1), dict(dp=1, tp=2, pp=1, microbatch=2))
    (opt,) = [t for _, t in materialize(plan, g).devices[0].tasks_in_order() if t.kind is TaskKind.OPTIMIZER]
    assert dict(opt.merged_tensors) == merged
    ds = cost_of("deepspeed")
    issue_s = 2 * (ds.software.host_call_s + ds.software.host_launch_s)
    fused = ds.device_and_host_s(opt, "fp16")[0]
    assert fused == pytest.approx(pass_s(ds, 70 * opt.params) + (len(opt.writes) - sum(merged.values())) * issue_s)
    apart = dataclasses.replace(ds, software=dataclasses.replace(ds.software, fused_qkv=False, fused_gate_up=False))
    assert apart.device_and_host_s(opt, "fp16")[0] - fused == pytest.approx(sum(merged.values()) * issue_s)
