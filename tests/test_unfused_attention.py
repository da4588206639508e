"""The batched GEMMs of an unfused attention core (Megatron's ``baddbmm`` and ``bmm`` and their backward)
run at the device's measured ``attention_efficiency.unfused`` where it has one (the A100s: fitted to
FlashAttention-2's bars of standard PyTorch attention, ``benchmarks/unfused_attention.py``), at the
GEMMs' own efficiency and tile overhead elsewhere; no other GEMM moves."""

from __future__ import annotations

import dataclasses

import pytest

from planlab.costmodel import CostModel
from planlab.costmodel.gemm import gemm_time_s
from planlab.costmodel.hardware import UNFUSED_ATTENTION
from planlab.costmodel.kernels import Kernel, op_kernels

SHAPES = ((2, 32, 2048, 96),) * 4  # micro-batch 2, 32 heads of 96 (GPT 3.6B at tp 1), sequence 2048


def _gemm_s(cost: CostModel, kernel: Kernel, dtype: str, spec) -> float:
    dev = cost.cluster.device
    b, m, n, k = kernel.gemm
    hbm = dev.hbm_bytes_per_s * dev.memory_efficiency.max
    peak = dev.peak_flops_per_s[dtype]
    run = dict(batch=b, m=m, n=n, k=k, elem_bytes=2, peak_flops_per_s=peak, hbm_bytes_per_s=hbm)
    return gemm_time_s(spec, **run) + dev.launch_overhead_s


def test_the_unfused_core_s_gemms_are_marked_and_no_other_kernel() -> None:
    for phase in ("F", "B"):
        kernels = op_kernels("attention", phase, SHAPES, 2, "megatron").kernels
        gemms = [k for k in kernels if k.gemm is not None]
        assert len(gemms) == (2 if phase == "F" else 4)
        assert all(k.core and k.backward == (phase == "B") for k in gemms)
        assert not any(k.core for k in kernels if k.gemm is None)
        fused = op_kernels("attention", phase, SHAPES, 2, "torch").kernels
        assert not any(k.core for k in fused)
        linear = op_kernels("linear", phase, ((2, 2048, 3072), (9216, 3072), (2, 2048, 9216)), 2, "megatron")
        assert not any(k.core for k in linear.kernels)


def test_an_a100_prices_the_core_s_gemms_at_its_measured_efficiency() -> None:
    cost = CostModel.load("dgx-a100-80g", software="megatron")
    spec = cost.cluster.device.gemm
    assert spec.measured_attention(UNFUSED_ATTENTION)
    eff, over_k = spec.attention(UNFUSED_ATTENTION, False)
    assert (eff, over_k) == spec.attention(UNFUSED_ATTENTION, True) == (0.65, 416)
    measured = dataclasses.replace(spec, efficiency=eff, tile_overhead_k=over_k)
    for phase in ("F", "B"):
        for kernel in op_kernels("attention", phase, SHAPES, 2, "megatron").kernels:
            if kernel.gemm is None:
                continue
            priced = cost.kernel_time_s(kernel, "fp16")
            assert priced == pytest.approx(_gemm_s(cost, kernel, "fp16", measured))
            # the same GEMM outside an attention core: the GEMMs' own efficiency and tile overhead, cheaper
            plain = cost.kernel_time_s(dataclasses.replace(kernel, core=False, backward=False), "fp16")
            assert plain == pytest.approx(_gemm_s(cost, kernel, "fp16", spec))
            assert priced > 1.2 * plain


def test_a_device_without_a_measurement_prices_the_core_as_any_gemm() -> None:
    cost = CostModel.load("dgx-1-v100", software="megatron-2019")
    spec = cost.cluster.device.gemm
    assert not spec.measured_attention(UNFUSED_ATTENTION)
    for kernel in op_kernels("attention", "B", SHAPES, 2, "megatron").kernels:
        if kernel.gemm is not None:
            assert cost.kernel_time_s(kernel, "fp16") == pytest.approx(_gemm_s(cost, kernel, "fp16", spec))
