"""DeepSpeed's work around the optimizer step without ZeRO, as its code does it: the fp16 step's
passes and its per-tensor overflow check (``FP16_Optimizer.step``), and the copies around each
gradient bucket's all-reduce (``allreduce_and_copy``)."""

from __future__ import annotations

import pytest

from planlab.costmodel import CostModel
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
    assert host_s == pytest.approx(sw.host_call_s + sw.host_launch_s + 5 * issue_s)
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


def test_a_gradient_bucket_pays_deepspeeds_three_passes() -> None:
    ds, mg = cost_of("deepspeed"), cost_of("megatron")
    nbytes, group = 2 * 500_000_000, tuple(range(8))  # one bucket of 5e8 fp16 gradients over 8 ranks

    def bucket(role: Role) -> Task:
        return Task("grad-reduce", TaskKind.COLLECTIVE, collective="all_reduce", group=group, nbytes=nbytes, role=role)

    ring_s = ds.collective_time_s("all_reduce", nbytes, group)
    assert ds.software.grad_reduce_copies == 3  # flatten, multiply by 1/dp, copy back
    got, host = ds.device_and_host_s(bucket(Role.BUCKET), "fp16")
    assert got == pytest.approx(ring_s + 3 * pass_s(ds, 2.0 * nbytes))
    assert host == pytest.approx(ds.software.host_collective_s + 3 * ds.software.host_launch_s)
    # another all-reduce (a tensor-parallel one) and the software that reduces in place pay none
    assert ds.device_and_host_s(bucket(Role.PLAIN), "fp16")[0] == pytest.approx(ring_s)
    assert mg.software.grad_reduce_copies == 0
    assert mg.device_and_host_s(bucket(Role.BUCKET), "fp16")[0] == pytest.approx(
        mg.collective_time_s("all_reduce", nbytes, group)
    )
