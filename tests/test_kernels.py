"""Kernel-level cost model: GEMMs by tile and wave quantization, Megatron's kernels per operator,
the host's issue time, the software spec and its errors. Expected values are computed by hand
from the formulas in the modules' docstrings."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from planlab.costmodel import CostModel, load_cluster
from planlab.costmodel.gemm import GemmSpec, gemm_time_s, tile_efficiency
from planlab.costmodel.kernels import Kernel, flash_causal_share, fused_softmax_available, op_kernels
from planlab.costmodel.model import host_bound_elapsed_s
from planlab.costmodel.software import Fusion, load_software
from planlab.errors import ConfigError
from planlab.plan.buffer import contribution, grad, weight_grad
from planlab.plan.program import Task, TaskKind

PEAK = 312e12  # A100 dense fp16 flop/s
SMS = 108
ONE_TILE = GemmSpec(SMS, 0.8, 1e30, ((128, 128),))  # one tile shape, unlimited L2: tile efficiency 0.8
PER_SM = PEAK / SMS


def tile_s(k: int, tm: int = 128, tn: int = 128, eff: float = 0.8) -> float:
    """One tile's mainloop: its flop at one SM's share of the peak times the efficiency."""
    return 2.0 * tm * tn * k / (PER_SM * eff)


@pytest.mark.parametrize(
    "m, n, k, waves",
    [
        (128 * 12, 128 * 9, 4096, 1),  # 108 tiles: one full wave
        (128 * 109, 128, 4096, 2),  # 109 tiles: a second wave for one tile (wave quantization)
        (128 * 12, 128 * 9 - 1, 4096, 1),  # the last column of tiles padded (tile quantization): still 108 tiles
        (128 * 12 + 1, 128 * 9, 4096, 2),  # one row too many: 117 tiles, two waves
        (128 * 216, 128, 4096, 2),  # 216 tiles: exactly two waves
    ],
)
def test_gemm_wave_and_tile_quantization(m: int, n: int, k: int, waves: int) -> None:
    t = gemm_time_s(ONE_TILE, batch=1, m=m, n=n, k=k, elem_bytes=2, peak_flops_per_s=PEAK, hbm_bytes_per_s=1e30)
    assert t == pytest.approx(waves * tile_s(k))


def test_gemm_split_k_fills_idle_sms() -> None:
    # 4 tiles of k = 8192 leave 104 SMs idle: split-K by 16 makes 64 tiles of k = 512 in one wave,
    # plus writing and reading 16 fp32 partial outputs once.
    m = n = 256
    t = gemm_time_s(ONE_TILE, batch=1, m=m, n=n, k=8192, elem_bytes=2, peak_flops_per_s=PEAK, hbm_bytes_per_s=2e12)
    expected = tile_s(512) + 2.0 * 16 * m * n * 4 / 2e12
    assert t == pytest.approx(expected)
    assert t < tile_s(8192)  # faster than one wave of the whole k


@pytest.mark.parametrize(
    "m, waves",
    [
        (128 * 109, 109 / 108),  # stream-K: the 109th tile is split along k over all SMs, not a second wave
        (128 * 216, 2),  # whole waves cost the same either way
        (128 * 100, 1),  # one partial wave: no tiles to spread (split-K's business), one wave
    ],
)
def test_gemm_stream_k_pays_fractional_waves(m: int, waves: float) -> None:
    spec = dataclasses.replace(ONE_TILE, stream_k=True)
    t = gemm_time_s(spec, batch=1, m=m, n=128, k=4096, elem_bytes=2, peak_flops_per_s=PEAK, hbm_bytes_per_s=1e30)
    assert t == pytest.approx(waves * tile_s(4096))


def test_gemm_tile_overhead_costs_each_tile_and_each_split() -> None:
    # 128 more steps of k per tile: one full wave of k = 384 costs as k = 512 would, a third more;
    # split-K by 16 of k = 8192 pays it on each of its 16 splits of 512.
    spec = dataclasses.replace(ONE_TILE, tile_overhead_k=128)
    run = dict(batch=1, elem_bytes=2, peak_flops_per_s=PEAK, hbm_bytes_per_s=2e12)
    assert gemm_time_s(spec, m=128 * 12, n=128 * 9, k=384, **run) == pytest.approx(tile_s(512))
    split = gemm_time_s(spec, m=256, n=256, k=8192, **run)
    assert split == pytest.approx(tile_s(512 + 128) + 2.0 * 16 * 256 * 256 * 4 / 2e12)


def test_gemm_power_ceiling_caps_the_multiply_adds_not_the_tile_overhead() -> None:
    # one full wave of 108 tiles at efficiency 0.8, capped at 0.5 of the peak: the tiles' multiply-adds (padding
    # included) run at half the peak. The tile overhead is not capped: with 2048 more steps at k 2048, the tile
    # model's 4096 steps at 0.8 take longer than the capped 2048 at 0.5, and set the time
    spec = dataclasses.replace(ONE_TILE, power_ceiling=0.5)
    run = dict(batch=1, m=128 * 12, n=128 * 9, elem_bytes=2, peak_flops_per_s=PEAK, hbm_bytes_per_s=1e30)
    assert gemm_time_s(spec, k=4096, **run) == pytest.approx(2.0 * 128 * 12 * 128 * 9 * 4096 / (0.5 * PEAK))
    overhead = dataclasses.replace(spec, tile_overhead_k=2048)  # 2048 + 2048 steps at 0.8 beat 2048 at 0.5
    assert gemm_time_s(overhead, k=2048, **run) == pytest.approx(tile_s(4096))
    padded = gemm_time_s(spec, k=4096, **{**run, "n": 128 * 9 - 1})  # the padded column is multiplied too
    assert padded == pytest.approx(2.0 * 128 * 12 * 128 * 9 * 4096 / (0.5 * PEAK))
    # a ceiling above what the tile model reaches changes nothing; FP8 GEMMs have none of their own
    assert gemm_time_s(dataclasses.replace(ONE_TILE, power_ceiling=0.9), k=4096, **run) == pytest.approx(tile_s(4096))
    assert spec.fp8().power_ceiling == 0.0


def test_the_device_power_ceiling_slows_long_gemms_only() -> None:
    # h100-80g: at 8192 x 8192 x 16384 the tile model alone runs above the MAMF rate, the ceiling holds it there;
    # a short-k GEMM and fused attention keep their time
    dev = load_cluster("dgx-h100").device
    assert dev.gemm.power_ceiling == 0.815
    free = dataclasses.replace(dev.gemm, power_ceiling=0.0)
    peak = dev.peak_flops_per_s["bf16"]
    run = dict(batch=1, m=8192, n=8192, elem_bytes=2, peak_flops_per_s=peak, hbm_bytes_per_s=3e12)
    assert gemm_time_s(dev.gemm, k=16384, **run) == pytest.approx(2.0 * 8192 * 8192 * 16384 / (0.815 * peak))
    assert gemm_time_s(free, k=16384, **run) < gemm_time_s(dev.gemm, k=16384, **run)
    assert gemm_time_s(free, k=1024, **run) == gemm_time_s(dev.gemm, k=1024, **run)


def test_gemm_memory_floor() -> None:
    # an outer product writes a large output: 8192 x 8 by 8 x 8192 in fp16 at 1 TB/s
    m, n, k = 8192, 8192, 8
    t = gemm_time_s(ONE_TILE, batch=1, m=m, n=n, k=k, elem_bytes=2, peak_flops_per_s=PEAK, hbm_bytes_per_s=1e12)
    assert t == pytest.approx((m * k + k * n + m * n) * 2 / 1e12)


FED_256x128 = 7219e9 * (256 * 128 / (384 * 2)) / PEAK  # the L2 feeds the best tile 0.987 of the peak


@pytest.mark.parametrize(
    "tm, tn, l2_GBps, expected",
    [
        (256, 128, 7219, 0.86),  # the best tile (intensity 42.7 flop/byte) reaches the GEMM efficiency
        (128, 256, 7219, 0.86),
        (128, 128, 7219, 0.86 * (7219e9 * 32 / PEAK) / FED_256x128),  # 32 flop/byte: 0.74 of the peak fed
        (64, 64, 7219, 0.86 * (7219e9 * 16 / PEAK) / FED_256x128),
        (64, 64, 1, 0.86 * 16 / (256 * 128 / 384 / 2)),  # starved L2: in proportion to the intensities
    ],
)
def test_tile_efficiency_by_arithmetic_intensity(tm: int, tn: int, l2_GBps: float, expected: float) -> None:
    spec = GemmSpec(SMS, 0.86, l2_GBps * 1e9)
    assert tile_efficiency(spec, tm, tn, PEAK, 2) == pytest.approx(expected)


@pytest.mark.parametrize(
    "bh, sq, sk, available",
    [
        (4, 1024, 1024, True),
        (2, 1024, 1024, False),
        (8, 2048, 2048, True),
        (16, 2048, 8192, False),
        (4, 128, 128, False),
        (8, 128, 128, True),
        (4, 1023, 1024, False),
    ],
)
def test_megatron_fused_softmax_conditions(bh: int, sq: int, sk: int, available: bool) -> None:
    assert fused_softmax_available(bh, sq, sk) is available


def test_unfused_attention_moves_the_scores_through_memory() -> None:
    # B=2, H=4 (8 attention batches: the fused softmax is available), T=1024, D=64, fp16
    q = (2, 4, 1024, 64)
    found = op_kernels("attention", "F", (q, q, q, q), 2, "megatron")
    scores = 2 * 4 * 1024 * 1024
    by_name = {k.name: k for k in found.kernels}
    assert by_name["baddbmm-scores"].gemm == (8, 1024, 1024, 64)
    assert by_name["bmm-context"].gemm == (8, 1024, 64, 1024)
    assert by_name["scale-mask-softmax"].bytes == 2 * scores * 2  # read and write fp16 scores
    assert by_name["attention-dropout"].bytes == scores * (2 * 2 + 1)  # read, write, one-byte mask
    assert by_name["permute-contiguous"].bytes == 2 * 2 * 4 * 1024 * 64 * 2
    back = op_kernels("attention", "B", (q, q, q, q), 2, "megatron")
    assert sorted(k.gemm for k in back.kernels if k.gemm) == sorted(
        [(8, 1024, 1024, 64), (8, 1024, 64, 1024), (8, 1024, 64, 1024), (8, 1024, 64, 1024)]
    )
    assert {k.name: k.bytes for k in back.kernels}["scale-mask-softmax-bwd"] == 3 * scores * 2
    # one attention batch fewer than the kernel needs: PyTorch's fp32 path, five passes each way
    q1 = (1, 2, 1024, 64)
    slow = op_kernels("attention", "F", (q1, q1, q1, q1), 2, "megatron")
    s1 = 2 * 1024 * 1024
    assert [k.bytes for k in slow.kernels if not k.gemm][:5] == [s1 * 6, s1 * 8, s1 * 9, s1 * 8, s1 * 6]
    flash = op_kernels("attention", "F", (q, q, q, q), 2, "torch")
    assert [k.gemm for k in flash.kernels] == [(8, 1024, 1024, 128)]


@pytest.mark.parametrize(
    "kind, phase, shapes, names, nbytes, calls",
    [
        ("linear", "F", ((4, 8, 16), (32, 16), (32,), (4, 8, 32)), ["gemm"], [0.0], 1),
        (
            "linear",
            "B",
            ((4, 8, 16), (32, 16), (32,), (4, 8, 32)),
            ["gemm-dgrad", "gemm-wgrad", "bias-grad", "grad-accumulate", "grad-accumulate"],
            [0.0, 0.0, (32 * 32 + 32) * 2, 3 * 512 * 2, 3 * 32 * 2],
            3,
        ),
        ("layer_norm", "F", ((32, 16), (16,), (16,), (32, 16)), ["layer-norm"], [2 * 512 * 2 + 32 * 8], 1),
        ("dropout", "B", ((32, 16), (32, 16)), ["dropout-bwd"], [512 * 5], 1),
        ("add", "F", ((32, 16), (16,), (32, 16)), ["add"], [(512 + 16 + 512) * 2], 1),
        ("add", "B", ((32, 16), (32, 16), (32, 16)), [], [], 1),  # the gradient passes through
        ("reshape", "F", ((32, 16), (512,)), [], [], 1),
        (
            "vocab_cross_entropy",
            "B",
            ((8, 100), (8,), (1,)),
            ["target-one-hot", "grad-multiply", "to-half"],
            [4 * 8 * 4, 2 * 800 * 4, 800 * 6],
            4,
        ),
    ],
)
def test_kernels_by_kind(kind, phase, shapes, names, nbytes, calls) -> None:
    found = op_kernels(kind, phase, shapes, 2, "megatron")
    assert [k.name for k in found.kernels] == names
    assert [k.bytes for k in found.kernels] == nbytes
    assert found.calls == calls
    assert op_kernels(kind, phase, (), 2, "megatron") is None or kind == "reshape"  # shapes missing
    assert op_kernels("mystery", phase, shapes, 2, "megatron") is None


@pytest.mark.parametrize(
    "kind, shapes, inputs, weights",
    [
        (
            "linear",
            ((4, 8, 16), (32, 16), (32,), (4, 8, 32)),
            ["gemm-dgrad"],
            ["gemm-wgrad", "bias-grad", "grad-accumulate", "grad-accumulate"],
        ),
        (
            "layer_norm",
            ((32, 16), (16,), (16,), (32, 16)),
            ["layer-norm-dx"],
            ["layer-norm-dweight", "grad-accumulate", "grad-accumulate"],
        ),
        (
            "embedding",
            ((4, 8), (100, 16), (4, 8, 16)),
            [],
            [
                "embedding-bwd-zero",
                "embedding-bwd-sort",
                "embedding-bwd-segments",
                "embedding-bwd-add",
                "grad-accumulate",
            ],
        ),
        ("dropout", ((32, 16), (32, 16)), ["dropout-bwd"], []),
    ],
)
def test_backward_parts_partition_the_kernels(kind, shapes, inputs, weights) -> None:
    """Zero-bubble's I and W tasks run the input- and weight-gradient kernels of the backward."""
    whole = op_kernels(kind, "B", shapes, 2, "megatron")
    i, w = whole.part(inputs=True, weights=False), whole.part(inputs=False, weights=True)
    assert [k.name for k in i.kernels] == inputs and [k.name for k in w.kernels] == weights
    assert whole.part(inputs=True, weights=True) is whole
    assert (i.calls > 0) == bool(inputs) and (w.calls > 0) == bool(weights)


def test_split_backward_tasks_are_priced_by_their_part() -> None:
    """A linear's backward split into I (writes the input's gradient) and W (the weight's and
    bias's): the device times add up to the whole backward's, kernel by kernel."""
    from planlab.plan.backward_split import split_task
    from planlab.plan.buffer import grad

    cost = vtrain_cost()
    x, w, b, y = (2, 1024, 1024), (4096, 1024), (4096,), (2, 1024, 4096)
    whole = Task(
        "fc",
        TaskKind.BACKWARD,
        (grad("y"),),
        (contribution("x", "fc", 0), weight_grad("w"), weight_grad("b")),
        flops=3e9,
        op_kind="linear",
        shapes=(x, w, b, y),
    )
    i, wt = split_task(whole, "linear")
    dev = cost.cluster.device
    dgrad = cost.kernel_time_s(op_kernels("linear", "B", (x, w, b, y), 2, "megatron").kernels[0], "fp16")
    assert cost.device_and_host_s(i, "fp16")[0] == pytest.approx(dgrad)
    assert cost.device_and_host_s(i, "fp16")[0] + cost.device_and_host_s(wt, "fp16")[0] == pytest.approx(
        cost.device_and_host_s(whole, "fp16")[0], rel=1e-12
    )
    assert dgrad > dev.launch_overhead_s


def test_zero_bubble_and_coshard_tasks_carry_their_kernels() -> None:
    """The tasks the later passes of materialize make keep the operator's kind and their own
    shapes: ZB-H1's I and W tasks together cost what 1F1B's backward does under the kernel model,
    and a co-located chunk's shapes are its share of the piece's."""
    from conftest import traced
    from planlab.plan import materialize
    from planlab.search_spaces import Context, get_space

    spec, g = traced("gpt-tiny", 8)
    cost = vtrain_cost()
    knobs = dict(dp=1, tp=1, pp=2, microbatch=2)
    programs = {
        s: materialize(get_space("megatron").build(Context(g, spec, 8, "cpu", 2, 2, 1), dict(knobs, schedule=s)), g)
        for s in ("1f1b", "zb-h1")
    }

    def backward_s(prog, blocks):
        return sum(
            cost.device_and_host_s(t, "fp16")[0]
            for d in prog.devices
            for (_, ph), blk in d.blocks.items()
            if ph in blocks
            for t in blk.tasks
            if t.kind is TaskKind.BACKWARD
        )

    base, zb = backward_s(programs["1f1b"], "B"), backward_s(programs["zb-h1"], "IW")
    assert zb == pytest.approx(base, rel=1e-9) and base > 0
    plan = get_space("megatron*coshard").build(
        Context(g, spec, 8, "cpu", 2, 2, 1), dict(dp=1, tp=2, pp=1, microbatch=8, coshard=2, coshard_blocks="mlp")
    )
    tasks = [t for _, t in materialize(plan, g).devices[0].tasks_in_order()]
    fc = [t for t in tasks if t.kind is TaskKind.FORWARD and t.chunk >= 0 and t.op_kind == "linear"]
    assert fc
    for t in fc:  # (x, w, b, y) or (x, w, y): the chunk's GEMM holds its share of the piece's flop
        x, w, y = t.shapes[0], t.shapes[1], t.shapes[-1]
        assert 2 * math.prod(y) * x[-1] == pytest.approx(t.flops, rel=1e-9)  # shapes and flop per micro-batch
        assert w[0] == y[-1]


@pytest.mark.parametrize(
    "device, host, elapsed",
    [
        ([1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]),  # the host is never in the way
        ([1.0, 1.0, 1.0], [2.0, 2.0, 2.0], [3.0, 2.0, 2.0]),  # host-bound: the device waits for each task
        ([5.0, 0.5, 0.5], [1.0, 1.0, 1.0], [6.0, 0.5, 0.5]),  # the host ran ahead during the long kernel
        ([0.5, 0.5, 5.0], [1.0, 1.0, 1.0], [1.5, 1.0, 5.5]),  # issued at 1, 2, 3: ends at 1.5, 2.5, 8
        ([], [], []),
    ],
)
def test_host_bound_elapsed_by_hand(device, host, elapsed) -> None:
    assert host_bound_elapsed_s(device, host) == pytest.approx(elapsed)
    if device:
        assert sum(host_bound_elapsed_s(device, host)) >= max(sum(device), sum(host)) - 1e-12


VTRAIN = dict(software="deepspeed", precision="fp16")  # vTrain's system: planlab.validation
CLUSTER = "hgx-a100-80g-4nic"


def vtrain_cost(nodes: int = 1) -> CostModel:
    return CostModel.load(CLUSTER, nodes, **VTRAIN)


def inline_device_spec(**device_change) -> dict:
    """dgx-a100-80g with its device inline (specs/devices.json's a100-80g), changed as given
    (a None value removes the field; without ``sm_count`` the node states no ``collective_sms``)."""
    from planlab.costmodel.hardware import DEVICES_FILE, SPEC_DIR

    spec = json.loads((SPEC_DIR / "dgx-a100-80g.json").read_text())
    device = dict(json.loads((SPEC_DIR / DEVICES_FILE).read_text())["a100-80g"], name="my-a100")
    for key, value in device_change.items():
        if value is None:
            device.pop(key)
        else:
            device[key] = value
    spec["device"] = device
    if "sm_count" not in device:  # the SMs a collective takes are a share of the device's SMs
        spec.pop("collective_sms", None)
    return spec


def test_kernel_model_prices_tasks(tmp_path) -> None:
    cost = vtrain_cost()
    sw, dev = cost.software, cost.cluster.device
    assert cost.host_bound and sw.implementation == "megatron"
    x, w, b, y = (2, 1024, 1024), (4096, 1024), (4096,), (2, 1024, 4096)
    fwd = Task("fc", TaskKind.FORWARD, op_kind="linear", shapes=(x, w, b, y))
    d, h = cost.device_and_host_s(fwd, "fp16")
    gemm = gemm_time_s(
        dev.gemm,
        batch=1,
        m=2048,
        n=4096,
        k=1024,
        elem_bytes=2,
        peak_flops_per_s=312e12,
        hbm_bytes_per_s=dev.hbm_bytes_per_s * dev.memory_efficiency.max,
    )
    assert d == pytest.approx(gemm + dev.launch_overhead_s)
    assert h == pytest.approx(sw.host_call_s + sw.host_launch_s)
    assert cost.task_time_s(fwd, "fp16") == pytest.approx(max(d, h))
    opt = Task("optimizer", TaskKind.OPTIMIZER, flops=12.0 * 1e6, params=1e6)  # a million parameters
    nbytes = 1e6 * cost.precision.optimizer_pass_bytes
    assert cost.device_and_host_s(opt, "fp16")[0] == pytest.approx(
        nbytes / (dev.hbm_bytes_per_s * dev.memory_efficiency.at(nbytes)) + dev.launch_overhead_s
    )
    coll = Task("ar", TaskKind.COLLECTIVE, collective="all_reduce", group=(0, 1), nbytes=2**20)
    assert cost.device_and_host_s(coll, "fp16") == (
        cost.collective_time_s("all_reduce", 2**20, (0, 1)),
        sw.host_collective_s,
    )
    # a device without the GEMM fields is priced by its roofline and the host is free
    path = tmp_path / "no-sms.json"
    path.write_text(json.dumps(inline_device_spec(sm_count=None, gemm_efficiency=None, l2_GBps=None)))
    plain = CostModel.load(path)
    assert not plain.host_bound and plain.device_and_host_s(fwd, "bf16")[1] == 0.0


def software_file(**change) -> dict:
    from planlab.costmodel.software import SOFTWARE_DIR

    sw = json.loads((SOFTWARE_DIR / "megatron.json").read_text())
    for key, value in change.items():
        if value is None:
            sw.pop(key)
        else:
            sw[key] = value
    return sw


@pytest.mark.parametrize(
    "change, fragments",
    [
        (dict(implementation="jax"), ["'implementation'", "'jax'", "'megatron'", "'torch'"]),
        (dict(host_call_us=-3), ["'host_call_us'", "microseconds"]),
        (dict(host_call_ms=3), ["'host_call_ms'", "not a known field"]),
        (dict(grad_reduce="sometimes"), ["'grad_reduce'", "'overlapped'", "'after_backward'"]),
        (dict(implementation=None), ["'implementation'", "missing"]),
        (dict(precisions={"bf8": {}}), ["'precisions.bf8'", "not a precision", "'fp16'"]),
        (
            dict(precisions={"bf16": {**software_file()["precisions"]["bf16"], "param_bytes": "2"}}),
            ["'precisions.bf16.param_bytes'", "must be a number", "bytes per element"],
        ),
        (dict(memory={"fragmentation": 1.5}), ["'memory.fragmentation'", "fraction of the memory"]),
        (dict(memory={"cuda_context_GB": 1}), ["'memory.cuda_context_GB'", "not a known field"]),
        (dict(grad_reduce_copies=-1), ["'grad_reduce_copies'", "whole number >= 0", "-1"]),
        (dict(grad_reduce_copies=2.5), ["'grad_reduce_copies'", "whole number >= 0", "2.5"]),
        (
            dict(precisions={"fp16": {**software_file()["precisions"]["fp16"], "per_tensor_overflow_check": "yes"}}),
            ["'precisions.fp16.per_tensor_overflow_check'", "true or false", "'yes'"],
        ),
    ],
)
def test_malformed_software_file(tmp_path, change, fragments) -> None:
    from planlab.costmodel.software import load_software

    path = tmp_path / "bad.json"
    path.write_text(json.dumps(software_file(**change)))
    with pytest.raises(ConfigError) as info:
        load_software(path)
    for fragment in [str(path), "software file", *fragments]:
        assert fragment in str(info.value)


@pytest.mark.parametrize(
    "name, fragments",
    [
        ("jax", ["unknown software 'jax'", "'deepspeed'", "'megatron'", "'torch'", "a path"]),
        ("missing.json", ["software file 'missing.json' not found"]),
    ],
)
def test_unknown_software(name, fragments) -> None:
    with pytest.raises(ConfigError) as info:
        CostModel.load("dgx-a100-80g", software=name)
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize(
    "device_change, fragments",
    [
        (dict(sm_count=0), ["'device.sm_count'", "integer >= 1"]),
        (dict(gemm_efficiency=1.5), ["'device.gemm_efficiency'", "(0, 1]", "fraction of the dense peak"]),
        (dict(l2_GBps=None), ["'device.l2_GBps'", "missing"]),
        (dict(gemm_tiles=[[128]]), ["'device.gemm_tiles'", "[rows, columns] pairs"]),
        (dict(gemm_tile_overhead_k=0.5), ["'device.gemm_tile_overhead_k'", "integer >= 1", "0.5"]),
        (dict(gemm_tile_overhead_k_fp8=-2), ["'device.gemm_tile_overhead_k_fp8'", "integer >= 1", "-2"]),
        (dict(gemm_stream_k="yes"), ["'device.gemm_stream_k'", "true or false", "'yes'"]),
        (dict(gemm_power_ceiling=1.2), ["'device.gemm_power_ceiling'", "(0, 1]", "power limit", "1.2"]),
        (
            dict(attention_efficiency={"flash2": {"forward": 1.2, "backward": 0.5}}),
            ["'device.attention_efficiency.flash2.forward'", "(0, 1]", "fused attention"],
        ),
        (
            dict(attention_efficiency={"flash9": 0.5}),
            ["'device.attention_efficiency'", "'flash9'", "'cudnn'", "'unfused'"],
        ),
        (
            dict(attention_efficiency={"cudnn": {"forward": 0.5, "backward": 0.5, "overhead_k": 0.5}}),
            ["'device.attention_efficiency.cudnn.overhead_k'", "integer >= 1"],
        ),
        (dict(architecture="pascal"), ["'device.architecture'", "'pascal'", "'hopper'"]),
        (dict(memory_MiB=-1), ["'device.memory_MiB'", "MiB of device memory as the driver reports it"]),
        (dict(default_precision="fp8"), ["'device.default_precision'", "'fp8'", "'bf16'"]),
    ],
)
def test_malformed_device_fields(tmp_path, device_change, fragments) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(inline_device_spec(**device_change)))
    with pytest.raises(ConfigError) as info:
        load_cluster(path)
    for fragment in [str(path), *fragments]:
        assert fragment in str(info.value)


def test_gemm_tiles_from_the_spec(tmp_path) -> None:
    path = tmp_path / "one-tile.json"
    path.write_text(json.dumps(inline_device_spec(gemm_tiles=[[128, 128]], gemm_tile_overhead_k=128)))
    gemm = load_cluster(path).device.gemm
    assert (gemm.tiles, gemm.tile_overhead_k) == (((128, 128),), 128)
    dev = load_cluster("dgx-a100-80g").device
    assert dev.gemm.tile_overhead_k == 128  # the A100's, from its measured GEMM table
    # its efficiency is the one at which the tile model runs the MAMF measurement: 271.2 TFLOP/s at 1024x10240x5120
    m, n, k = 1024, 10240, 5120
    hbm = dev.hbm_bytes_per_s * dev.memory_efficiency.max
    t = gemm_time_s(dev.gemm, batch=1, m=m, n=n, k=k, elem_bytes=2, peak_flops_per_s=312e12, hbm_bytes_per_s=hbm)
    assert 2.0 * m * n * k / (t + dev.launch_overhead_s) == pytest.approx(271.2e12, rel=1e-3)


# ---------------------------------------------------------------- the measured system's plans (planlab.validation)


@pytest.mark.parametrize("tp, vocab", [(1, 50304), (2, 50432), (4, 50688), (8, 51200), (16, 51200)])
def test_megatron_pads_the_vocabulary(tp: int, vocab: int) -> None:
    from planlab.validation import padded_vocab

    assert padded_vocab(tp) == vocab


def test_megatron_plan_splits_the_vocabulary_and_spans_nodes() -> None:
    """tp=16 over two 8-GPU nodes: built directly (the tp space keeps tp inside a node); the
    embedding, output layer and loss split the vocabulary; messages between stages carry a
    tp-th and the receivers all-gather."""
    from planlab.plan.program import TaskKind
    from planlab.validation import MeasuredRun, program_of

    run = MeasuredRun(
        gpus=32, global_batch=4, micro_batch=1, hidden=64, heads=16, layers=2, seq=32, tp=16, dp=1, pp=2, measured_s=1.0
    )
    program, cost = program_of(run)
    assert cost.cluster.nodes == 4 and program.num_devices == 32 and program.microbatches == 4
    tasks = [t for dp in program.devices for b in dp.blocks.values() for t in b.tasks]
    kinds = {t.op_kind: t.shapes for t in tasks if t.kind is TaskKind.FORWARD}
    vocab = 51200 // 16
    assert kinds["vocab_embedding"][1] == (vocab, 64)  # the table's shard
    assert kinds["linear"] and kinds["vocab_cross_entropy"][0] == (32, vocab)  # logits of one shard
    sends = [t for t in tasks if t.kind is TaskKind.SEND]
    gathers = [t for t in tasks if t.kind is TaskKind.COLLECTIVE and t.collective == "all_gather"]
    assert sends and gathers
    assert all(t.nbytes == 1 * 32 * 64 * 2 // 16 for t in sends)  # a 16th of one micro-batch's fp16 activation
    assert {len(t.group) for t in gathers} == {16}
    tp_groups = {
        t.group for t in tasks if t.kind is TaskKind.COLLECTIVE and t.collective == "all_reduce" and len(t.group) == 16
    }
    assert tp_groups and all({cost.cluster.node_of(d) for d in g} == {g[0] // 8, g[0] // 8 + 1} for g in tp_groups)


def test_shared_programs_give_the_same_prediction() -> None:
    """A run materialized at one micro-batch per replica, its schedules made for its micro-batches,
    is priced exactly as the run materialized whole."""
    from planlab.validation import MeasuredRun, predict

    run = MeasuredRun(
        gpus=4, global_batch=16, micro_batch=2, hidden=64, heads=4, layers=4, seq=32, tp=2, dp=1, pp=2, measured_s=0.01
    )
    whole = predict(run)
    shared = predict(run, batch=run.dp * run.micro_batch)
    assert shared["predicted_s"] == pytest.approx(whole["predicted_s"], rel=1e-12)


@pytest.mark.parametrize(
    "text, fragments",
    [
        ("# GPUs,global batch\n2,16\n", ["'micro batch'", "is missing"]),
        (None, ["line 2", "'micro batch'", "'x'", "an integer"]),
        ("HEADER\n2,16,8,1024,16,24,1024,1,2,2,372.16\n", ["line 2", "tp x dp x pp = 4 for 2 GPUs"]),
    ],
)
def test_malformed_ground_truth(tmp_path, text, fragments) -> None:
    from planlab.validation import _COLUMNS, load_runs

    header = ",".join(_COLUMNS)
    if text is None:
        text = f"{header}\n2,16,x,1024,16,24,1024,1,1,2,372.16\n"
    text = text.replace("HEADER", header)
    path = tmp_path / "runs.csv"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_runs(path)
    for fragment in [str(path), *fragments]:
        assert fragment in str(info.value)


@pytest.mark.parametrize(
    "nodes, ratios, a100",
    [
        (1, 1.0, 1.0),
        (2, 1.0, 1.0),
        (16, 0.76 / 0.92, 1.0),
        (4, (0.92 - 0.16 / 3) / 0.92, 1.0),
        (32, (0.76 - 0.45 / 3) / 0.92, 1.0 - 0.59 / 3),
        (128, 0.31 / 0.92, 0.41),
        (512, 0.31 / 0.92, 0.41),
    ],
)
def test_inter_node_collectives_slow_with_scale(nodes: int, ratios: float, a100: float) -> None:
    """The reference's measured ratios (0.92, 0.76, 0.31 of peak on 2, 16, 128 nodes) on the H100
    cluster; on DGX A100 the nccl-tests anchors show no loss up to 16 nodes, then the ratios' fall."""
    from planlab.costmodel.comm import scale_efficiency

    assert scale_efficiency(load_cluster("dgx-h100").node, nodes) == pytest.approx(ratios)
    assert scale_efficiency(load_cluster("dgx-a100-80g").node, nodes) == pytest.approx(a100)


@pytest.mark.parametrize("batch", [4, 6])
def test_rebatch_is_the_trace_at_that_batch(batch: int) -> None:
    from planlab.graph.trace import trace
    from planlab.models.registry import build_model
    from planlab.validation import MeasuredRun, _traced, model_spec, rebatch

    spec = model_spec(MeasuredRun(8, 32, 2, 64, 4, 2, 32, 2, 4, 1, 1.0))
    made, traced = rebatch(_traced(spec), batch), trace(*build_model(spec, batch=batch))
    assert made.tensors == traced.tensors and made.labels == traced.labels
    assert [(o.name, o.dim_sizes, o.flops, o.bytes_moved) for o in made.operators] == [
        (o.name, o.dim_sizes, o.flops, o.bytes_moved) for o in traced.operators
    ]


# ---------------------------------------------------------------- FP8 as a software precision


@pytest.mark.parametrize("impl, per", [("megatron", 2 + 2), ("torch", 2 + 2 + 2)])
def test_fp8_linear_casts_then_fp8_gemms(impl: str, per: int) -> None:
    """Transformer Engine's cast-transpose (read bf16, write FP8 and its transpose: 4 bytes an
    element); torchao's dynamic scaling reads the tensor once more for its maximum (6)."""
    x, w, y = (2, 256, 512), (1024, 512), (2, 256, 1024)
    fwd = op_kernels("linear", "F", (x, w, y), 2, impl, fp8=True)
    assert [k.name for k in fwd.kernels] == ["fp8-cast-input", "fp8-cast-weight", "gemm"]
    assert [k.bytes for k in fwd.kernels[:2]] == [512 * 512 * per, 1024 * 512 * per]
    assert fwd.kernels[2].fp8 and fwd.kernels[2].gemm == (1, 512, 1024, 512)
    bwd = op_kernels("linear", "B", (x, w, y), 2, impl, fp8=True)
    assert [k.name for k in bwd.kernels if k.gemm] == ["gemm-dgrad", "gemm-wgrad"]
    assert all(k.fp8 for k in bwd.kernels if k.gemm) and bwd.kernels[0].bytes == 512 * 1024 * per
    assert not any(k.fp8 for k in op_kernels("linear", "F", (x, w, y), 2, impl).kernels)


def test_fp8_projections_fused_into_one_gemm_cast_their_shared_input_once() -> None:
    """A fused GEMM is one Transformer Engine module (Megatron-Core's linear_qkv, linear_fc1, an
    expert stack's grouped linear_fc1), which casts the input its projections share once: the
    projections' input casts sum to one cast, each weight is still cast whole."""
    per = 2 + 2
    x = (2, 256, 512)
    widths = (1024, 256, 256)  # q, k, v of a grouped-query attention
    casts = []
    for n in widths:
        w, y = (n, 512), (2, 256, n)
        fwd = op_kernels("linear", "F", (x, w, y), 2, "megatron", fp8=True, fused_widths=widths)
        assert fwd.kernels[1].bytes == n * 512 * per  # its own weight's cast
        casts.append(fwd.kernels[0].bytes)
    assert sum(casts) == pytest.approx(512 * 512 * per)
    alone = op_kernels("linear", "F", (x, (1024, 512), (2, 256, 1024)), 2, "megatron", fp8=True)
    assert alone.kernels[0].bytes == 512 * 512 * per
    xs, ws = (8, 512, 1024), (8, 1024, 2048)  # an expert stack's gate (and its up twin)
    gate = op_kernels(
        "matmul", "F", (xs, ws, (8, 512, 2048)), 2, "megatron", True, fused_widths=(2048, 2048), fp8_matmul=True
    )
    assert gate.kernels[0].bytes == 8 * 512 * 1024 * per / 2


def test_fp8_runs_a_matmul_with_a_weight_in_fp8_where_the_software_says() -> None:
    """The experts' grouped GEMMs (a matmul over stacked weights): with ``fp8_matmul`` the input and the
    weight are cast forward and the output gradient backward, each GEMM on FP8 operands; without it (or
    without FP8) the same 16-bit GEMMs as before. Megatron (Transformer Engine's GroupedLinear) runs them in
    FP8; torch's Float8 training swaps nn.Linear only and leaves them in 16 bits."""
    x, w, y = (8, 512, 1024), (8, 1024, 2048), (8, 512, 2048)  # 8 experts: (E, tokens, in) @ (E, in, out)
    per = 2 + 2  # a cast reads 16 bits and writes the FP8 copy and its transpose
    fwd = op_kernels("matmul", "F", (x, w, y), 2, "megatron", fp8=True, fp8_matmul=True)
    assert [k.name for k in fwd.kernels] == ["fp8-cast-input", "fp8-cast-weight", "bmm"]
    assert [k.bytes for k in fwd.kernels[:2]] == [8 * 512 * 1024 * per, 8 * 1024 * 2048 * per]
    assert fwd.kernels[2].fp8 and fwd.kernels[2].gemm == (8, 512, 2048, 1024)
    bwd = op_kernels("matmul", "B", (x, w, y), 2, "megatron", fp8=True, fp8_matmul=True)
    assert [k.name for k in bwd.kernels] == ["fp8-cast-grad", "bmm-grad-a", "bmm-grad-b"]
    assert bwd.kernels[0].bytes == 8 * 512 * 2048 * per and all(k.fp8 for k in bwd.kernels[1:])
    for kw in (dict(fp8=True), dict(fp8_matmul=True), {}):
        plain = op_kernels("matmul", "F", (x, w, y), 2, "megatron", **kw)
        assert [(k.name, k.fp8) for k in plain.kernels] == [("bmm", False)]
    from planlab.costmodel.software import load_software

    assert load_software("megatron").fp8_weight_matmuls and load_software("megatron-hybridep").fp8_weight_matmuls
    assert not load_software("torch").fp8_weight_matmuls
    # the cost model asks for it only on a task marked as a matmul with a weight
    fp8 = CostModel.load("dgx-h100", precision="fp8")
    task = Task("e", TaskKind.FORWARD, op_kind="matmul", shapes=(x, w, y))
    marked = Task("e", TaskKind.FORWARD, op_kind="matmul", shapes=(x, w, y), weight_matmul=True)
    assert fp8.software.name == "megatron"
    bmm8, bmm16 = (
        fp8.kernel_time_s(k, "bf16") for k in (fwd.kernels[2], dataclasses.replace(fwd.kernels[2], fp8=False))
    )
    assert bmm8 < bmm16  # the GEMM itself at the FP8 peak; its casts may cost more than it saves at this size
    want = sum(fp8.kernel_time_s(k, "bf16") for k in fwd.kernels)
    assert fp8.device_and_host_s(marked, "fp8")[0] == pytest.approx(want, rel=1e-12)
    assert fp8.device_and_host_s(task, "fp8")[0] == pytest.approx(bmm16, rel=1e-12)


def test_fp8_prices_gemms_at_the_fp8_peak_and_efficiency() -> None:
    from planlab.costmodel.kernels import Kernel

    bf16 = CostModel.load("dgx-h100", precision="bf16")
    fp8 = CostModel.load("dgx-h100", precision="fp8")
    dev = fp8.cluster.device
    big = Kernel("gemm", gemm=(1, 8192, 8192, 8192), fp8=True)
    flop = 2.0 * 8192**3
    # 2048 tiles of 256 x 128 on 132 SMs: 15.52 waves, the last one split along k (Hopper's stream-K), each
    # tile 480 steps of k longer (its prologue and epilogue at FP8's rate, not the 16-bit GEMMs' 224), at the
    # FP8 efficiency of the spec
    assert dev.gemm.stream_k and dev.gemm.tile_overhead_k == 224
    assert (dev.gemm.tile_overhead_k_fp8, dev.gemm.efficiency_fp8) == (480, 0.74)
    ideal = flop * (8192 + 480) / 8192 / (1979e12 * 0.74) + dev.launch_overhead_s
    assert fp8.kernel_time_s(big, "fp8") == pytest.approx(ideal, rel=1e-9)
    # a 16-bit GEMM of the same shape keeps the 16-bit overhead and efficiency, which would run it at 823 TFLOP/s:
    # above the power ceiling (0.815 of the peak), which sets its time; the FP8 GEMM has no ceiling of its own
    assert flop * (8192 + 224) / 8192 / (989e12 * 0.855) < flop / (989e12 * 0.815)
    ideal16 = flop / (989e12 * 0.815) + dev.launch_overhead_s
    assert bf16.kernel_time_s(dataclasses.replace(big, fp8=False), "bf16") == pytest.approx(ideal16, rel=1e-9)
    whole = dataclasses.replace(dev.gemm.fp8(), stream_k=False)
    # without stream-K the same GEMM pays 16 whole waves (wave quantization, 3%)
    hbm = dev.hbm_bytes_per_s * dev.memory_efficiency.max
    run = dict(batch=1, m=8192, n=8192, k=8192, elem_bytes=1, peak_flops_per_s=1979e12, hbm_bytes_per_s=hbm)
    assert gemm_time_s(whole, **run) == pytest.approx((ideal - dev.launch_overhead_s) * 16 / (2048 / 132), rel=1e-9)
    x, w, y = (4, 2048, 8192), (8192, 8192), (4, 2048, 8192)
    for phase in ("F", "B"):
        writes = (contribution("x", "fc", 0), weight_grad("w"))
        task = Task("fc", TaskKind(phase), writes=writes, op_kind="linear", shapes=(x, w, y))
        t8, t16 = fp8.device_and_host_s(task, "fp8")[0], bf16.device_and_host_s(task, "bf16")[0]
        assert 0.55 * t16 < t8 < 0.85 * t16  # faster GEMMs, less so for the casts
    with pytest.raises(ConfigError, match="'a100-80g' has no fp8 peak for precision 'fp8'; choose 'bf16', 'fp16'"):
        CostModel.load("dgx-a100-80g", precision="fp8")
    with pytest.raises(ConfigError, match="software 'deepspeed' has no precision 'fp8'"):
        CostModel.load("dgx-h100", software="deepspeed", precision="fp8")


def test_a_formula_that_fails_raises_instead_of_falling_back_to_the_roofline():
    """Missing shapes or a vector product are left to the roofline (None); a formula that fails on
    the shapes it is given is a bug and says so, naming the kind and the shapes."""
    from planlab.errors import KernelFormulaError

    assert op_kernels("linear", "F", (), 2) is None
    assert op_kernels("matmul", "F", ((8,), (8, 4), (4,)), 2) is None
    with pytest.raises(KernelFormulaError, match=r"'linear' \(F\) failed on shapes \(\(4, 8\),\)"):
        op_kernels("linear", "F", ((4, 8),), 2)  # no weight: the formula indexes past the shapes


def test_flash_attention_pays_no_gemm_tile_overhead() -> None:
    # on an A100 (tile overhead 128) a GEMM with k = 256 pays it; flash attention of the same flop does not
    cost = CostModel.load("dgx-a100-80g", software="torch")
    dev = cost.cluster.device
    shape = (1, 128 * 12, 128 * 9, 256)
    plain = cost.kernel_time_s(Kernel("gemm", gemm=shape), "bf16")
    flash = [k for k in op_kernels("attention", "F", ((1, 1, shape[1], 128),) * 4, 2, "torch").kernels][0]
    assert flash.fused and flash.gemm == (1, shape[1], shape[1], 256)
    free = dataclasses.replace(dev.gemm, tile_overhead_k=0)
    hbm = dev.hbm_bytes_per_s * dev.memory_efficiency.max
    run = dict(batch=1, k=256, elem_bytes=2, peak_flops_per_s=312e12, hbm_bytes_per_s=hbm)
    # at FlashAttention-2's measured efficiency, not the GEMMs'
    assert dev.architecture == "ampere" and cost.software.attention_kernel("ampere") == "flash2"
    assert dev.gemm.attention("flash2", False) == dev.gemm.attention("flash2", True) == (0.61, 0)
    flash_spec = dataclasses.replace(free, efficiency=0.61)
    want_flash = gemm_time_s(flash_spec, m=shape[1], n=shape[1], **run) + dev.launch_overhead_s
    assert cost.kernel_time_s(flash, "bf16") == pytest.approx(want_flash)
    assert plain == pytest.approx(gemm_time_s(dev.gemm, m=shape[1], n=shape[2], **run) + dev.launch_overhead_s)
    assert plain > gemm_time_s(free, m=shape[1], n=shape[2], **run) + dev.launch_overhead_s


@pytest.mark.parametrize(
    "t, s, head_dim, backward, share",
    [
        # forward at head dim 128: blocks of 128 queries x 64 keys; query block m computes key blocks
        # up to the diagonal, 2 (m + 1) of them: 2 (1 + ... + 8) = 72 of 8 x 16
        (1024, 1024, 128, False, 72 / 128),
        # backward at head dim 128: 64 queries x 128 keys; key block n from query block 2 n: 16 - 2 n, 72 of 16 x 8
        (1024, 1024, 128, True, 72 / 128),
        # head dim 64, 128 x 128 both ways: block m computes m + 1 of 8: 36 of 64
        (1024, 1024, 64, False, 36 / 64),
        (1024, 1024, 64, True, 36 / 64),
        # one block holds the whole sequence: computed in full, then masked
        (128, 128, 64, False, 1.0),
        # fewer queries than keys, the mask at the bottom right: query block m sees 16 + 2 (m + 1) key blocks of 32
        (1024, 2048, 128, False, sum(min(32, 16 + 2 * (m + 1)) for m in range(8)) / 256),
        # head dim 80 takes the blocks of 96 (128 x 64 forward)
        (1024, 1024, 80, False, 72 / 128),
    ],
)
def test_flash_causal_share_counts_the_blocks_by_hand(t, s, head_dim, backward, share) -> None:
    assert flash_causal_share(t, s, head_dim, backward) == pytest.approx(share)


def test_causal_flash_attention_prices_the_blocks_it_computes() -> None:
    # fused attention (megatron with TE, torch SDPA) of a causal GPT layer: the blocks the mask hides
    # entirely are skipped; the unfused path (megatron-2022) computes and masks every score
    shapes = ((4, 16, 2048, 128),) * 4
    for phase in ("F", "B"):
        full = op_kernels("attention", phase, shapes, 2, "torch").kernels[0]
        causal = op_kernels("attention", phase, shapes, 2, "torch", causal=True).kernels[0]
        assert causal.gemm == full.gemm and full.computed == 1.0
        assert causal.computed == pytest.approx(flash_causal_share(2048, 2048, 128, phase == "B"))
        cost = CostModel.load("dgx-a100-80g", software="torch")
        launch = cost.cluster.device.launch_overhead_s
        assert cost.kernel_time_s(causal, "bf16") - launch == pytest.approx(
            (cost.kernel_time_s(full, "bf16") - launch) * causal.computed
        )
        unfused = op_kernels("attention", phase, shapes, 2, "megatron")
        assert op_kernels("attention", phase, shapes, 2, "megatron", causal=True) == unfused


def test_causal_attention_tasks_are_marked_and_priced_causal() -> None:
    # GPT's attention (is_causal=True) reaches the cost model as causal pieces, which the kernel model
    # prices below the same task without the mask once the sequence spans several blocks
    from conftest import traced
    from planlab.plan import materialize
    from planlab.search_spaces import Context, get_space

    spec, g = traced("gpt-tiny", 8)
    plan = get_space("megatron").build(Context(g, spec, 8, "cpu", 2, 2, 1), dict(dp=1, tp=2, pp=1, microbatch=8))
    tasks = [t for _, t in materialize(plan, g).devices[0].tasks_in_order() if t.op_kind == "attention"]
    assert tasks and all(t.causal for t in tasks)
    long = tasks[0].but(shapes=tuple((*s[:-2], 2048, s[-1]) for s in tasks[0].shapes))
    cost = CostModel.load("dgx-a100-80g")
    assert cost.device_and_host_s(long, "bf16")[0] < cost.device_and_host_s(long.but(causal=False), "bf16")[0]


def test_fused_attention_runs_the_software_s_kernel_for_the_device() -> None:
    """On an H100, Megatron-Core (Transformer Engine) runs cuDNN's fused attention and torch's SDPA
    FlashAttention-2, each at its measured forward and backward efficiency and overhead per score
    element; a software that names no kernel prices the fused kernel at the GEMMs' efficiency. A
    fused kernel's memory floor is its operands, not a GEMM's T x S output."""
    shapes = ((2, 16, 4096, 128),) * 4
    fwd = op_kernels("attention", "F", shapes, 2, "torch").kernels[0]
    bwd = op_kernels("attention", "B", shapes, 2, "torch").kernels[0]
    assert fwd.fused and bwd.fused and bwd.backward and not fwd.backward
    assert fwd.bytes == 4 * 2 * 16 * 4096 * 128 * 2 and bwd.bytes == 2 * fwd.bytes

    def priced(cost: CostModel, kernel: Kernel, efficiency: float, overhead_k: int) -> float:
        dev = cost.cluster.device
        # no GEMM power ceiling: the kernel's measured efficiency holds what the power limit takes
        at = dataclasses.replace(dev.gemm, tile_overhead_k=overhead_k, efficiency=efficiency, power_ceiling=0.0)
        b, m, n, k = kernel.gemm
        flop_s = gemm_time_s(
            at, batch=b, m=m, n=n, k=k, elem_bytes=2, peak_flops_per_s=989e12, hbm_bytes_per_s=math.inf
        )
        hbm = dev.hbm_bytes_per_s * dev.memory_efficiency.max
        return max(flop_s, kernel.bytes / hbm) + dev.launch_overhead_s

    times = {}
    for software in ("megatron", "torch"):
        cost = CostModel.load("dgx-h100", software=software)
        dev = cost.cluster.device
        name = cost.software.attention_kernel(dev.architecture)
        assert name == {"megatron": "cudnn", "torch": "flash2"}[software]
        measured = {n: (f, b, k0) for n, f, b, k0 in dev.gemm.attention_efficiency}[name]
        for kernel, eff in ((fwd, measured[0]), (bwd, measured[1])):
            assert cost.kernel_time_s(kernel, "bf16") == pytest.approx(priced(cost, kernel, eff, measured[2]))
        times[software] = sum(cost.kernel_time_s(k, "bf16") for k in (fwd, bwd))
    assert times["megatron"] < times["torch"]  # cuDNN's kernels are the faster on Hopper
    cost = CostModel.load("dgx-h100", software="torch")
    none = dataclasses.replace(cost, software=dataclasses.replace(cost.software, attention_kernels=()))
    assert none.kernel_time_s(fwd, "bf16") == pytest.approx(priced(cost, fwd, cost.cluster.device.gemm.efficiency, 0))


def _projection_tasks(widths: tuple[int, ...], m: int, k: int, fusion: Fusion = Fusion.QKV) -> list[tuple[Task, Task]]:
    """The forward and backward tasks of projections of ``widths`` reading one ``m x k`` input (an
    attention's query, key and value; a gated unit's gate and up), as materialize marks them
    (``fusion``, ``fused_widths``)."""
    x = (1, m, k)
    out = []
    for name, n in zip("qkv" if fusion is Fusion.QKV else ("gate", "up"), widths):
        shapes = (x, (n, k), (1, m, n))
        fields = dict(op_kind="linear", shapes=shapes, fused_widths=widths, fusion=fusion)
        fwd = Task(name, TaskKind.FORWARD, flops=2.0 * m * n * k, **fields)
        bwd = Task(name, TaskKind.BACKWARD, (grad(name),), (contribution("x", name, 0), weight_grad(name)), **fields)
        out.append((fwd, bwd))
    return out


@pytest.mark.parametrize("widths, m, k", [((1024, 1024, 1024), 1024, 1024), ((2048, 512, 512), 2048, 2048)])
def test_fused_qkv_prices_one_gemm_of_the_summed_width(widths, m, k) -> None:
    """With Megatron's fused query_key_value (``fused_qkv``) the three projections together cost
    one GEMM of their summed width each way, their last waves no longer each partly idle: less
    than three GEMMs at these shapes (three 1024^3 GEMMs leave 108 SMs' last wave part-empty
    three times over). Each projection pays its width's share. torch's separate wq, wk, wv stay
    three GEMMs, the fused widths ignored."""
    megatron = vtrain_cost()
    assert megatron.software.fused_qkv
    torch = CostModel(megatron.cluster, software=load_software("torch"), precision=megatron.precision)
    assert not torch.software.fused_qkv
    tasks = _projection_tasks(widths, m, k)
    total = sum(widths)
    for phase in (0, 1):
        fused = [megatron.device_and_host_s(t[phase], "fp16")[0] for t in tasks]
        alone = [megatron.device_and_host_s(t[phase].but(fused_widths=()), "fp16")[0] for t in tasks]
        plain = [torch.device_and_host_s(t[phase], "fp16")[0] for t in tasks]
        assert sum(fused) < 0.9 * sum(alone)
        assert plain == pytest.approx(
            [torch.device_and_host_s(t[phase].but(fused_widths=()), "fp16")[0] for t in tasks]
        )
    for n, (fwd, _) in zip(widths, tasks):  # each projection computes its width's share of each fused GEMM
        gemms = [
            kn for p in "FB" for kn in op_kernels("linear", p, fwd.shapes, 2, "megatron", fused_widths=widths).kernels
        ]
        gemms = [(kn.gemm, kn.computed) for kn in gemms if kn.gemm]
        assert gemms == [((1, m, total, k), n / total), ((1, m, k, total), n / total), ((1, total, k, m), n / total)]
    one = megatron.kernel_time_s(Kernel("gemm", gemm=(1, m, total, k)), "fp16")
    assert sum(megatron.device_and_host_s(t[0], "fp16")[0] for t in tasks) == pytest.approx(
        one + 2 * megatron.cluster.device.launch_overhead_s
    )


def test_the_simulator_prices_tasks_that_differ_only_in_kernel_fields_apart() -> None:
    """The simulator prices tasks alike once per block; a query projection (fused into the QKV GEMM)
    and an output projection of the same shapes (its own GEMM), or a causal and a full attention
    piece of the same shapes, are not alike: each keeps its own price within one block."""
    from planlab.plan.program import Block
    from planlab.simulator.units import Segment, lower_block

    cost = CostModel.load("dgx-a100-80g", 1)  # megatron: the fused QKV GEMM, FlashAttention-2
    (q, _), _, _ = _projection_tasks((1024, 1024, 1024), 1024, 1024)
    o = q.but(name="o", fused_widths=())
    shapes = ((1, 16, 2048, 64),) * 4
    att = Task("att", TaskKind.FORWARD, flops=4.0 * 16 * 2048 * 2048 * 64, op_kind="attention", shapes=shapes)
    pairs = ((q, o), (att.but(name="causal", causal=True), att))
    for first, second in pairs:
        assert cost.device_and_host_s(first, "bf16")[0] != pytest.approx(cost.device_and_host_s(second, "bf16")[0])
        for order in ((first, second), (second, first)):
            units = lower_block(Block(0, "F", order), device=0, cls=[0], cost=cost, dtype="bf16", sizes={})
            got = [d for u in units if isinstance(u, Segment) for d in u.durations]
            device_s, host_s = zip(*(cost.device_and_host_s(t, "bf16") for t in order))
            assert got == pytest.approx(host_bound_elapsed_s(list(device_s), list(host_s)))


def test_materialize_marks_the_query_key_value_projections() -> None:
    """The q, k and v projections of a GPT and of a LLaMA (grouped-query attention, rotary
    embedding between projection and attention) read one input under tp 2: each forward and
    backward piece carries the three local widths; the other linear layers none."""
    from conftest import traced
    from planlab.plan import materialize
    from planlab.search_spaces import Context, get_space

    for model, widths in (("gpt-tiny", (32, 32, 32)), ("llama-tiny", (32, 16, 16))):
        spec, g = traced(model, 8)
        plan = get_space("megatron").build(Context(g, spec, 8, "cpu", 2, 2, 1), dict(dp=1, tp=2, pp=1, microbatch=2))
        linear = [t for _, t in materialize(plan, g).devices[0].tasks_in_order() if t.op_kind == "linear"]
        marked = [t for t in linear if t.fusion is Fusion.QKV]
        assert {t.fused_widths for t in marked} == {widths}
        assert {t.kind for t in marked} == {TaskKind.FORWARD, TaskKind.BACKWARD}
        assert len({(t.kind, t.name) for t in marked}) == 6 * 2  # two layers, three projections, forward and backward
        assert all(t.shapes[1][0] in widths for t in marked)


def test_fused_gate_up_prices_a_swiglu_mlp_as_one_gemm_of_twice_the_width() -> None:
    """Megatron-Core's linear_fc1 with a gated linear unit (``fused_gate_up``): LLaMA-2 7B's gate and
    up projections under tp 4 (2752 wide each, 4096 tokens) cost one GEMM of 5504 each way, each
    charged half, about 0.87 of two GEMMs' time on an A100 (the two GEMMs' last waves each partly
    idle); the pair's shares sum to one GEMM. The QKV flag does not fuse them, nor does torch
    (torchtitan's separate w1 and w3)."""
    megatron = CostModel.load("dgx-a100-80g", 1)
    assert megatron.software.fused_gate_up
    torch = CostModel(megatron.cluster, software=load_software("torch"), precision=megatron.precision)
    qkv_only = dataclasses.replace(megatron, software=dataclasses.replace(megatron.software, fused_gate_up=False))
    m, k, f = 4096, 4096, 2752
    tasks = _projection_tasks((f, f), m, k, Fusion.GATE_UP)
    for phase in (0, 1):
        fused = [megatron.device_and_host_s(t[phase], "bf16")[0] for t in tasks]
        alone = [megatron.device_and_host_s(t[phase].but(fused_widths=(), fusion=None), "bf16")[0] for t in tasks]
        assert sum(fused) < 0.95 * sum(alone)
        for other in (torch, qkv_only):
            assert [other.device_and_host_s(t[phase], "bf16")[0] for t in tasks] == pytest.approx(
                [other.device_and_host_s(t[phase].but(fused_widths=(), fusion=None), "bf16")[0] for t in tasks]
            )
    gemms = [kn for kn in op_kernels("linear", "F", tasks[0][0].shapes, 2, "megatron", fused_widths=(f, f)).kernels]
    assert [(kn.gemm, kn.computed) for kn in gemms] == [((1, m, 2 * f, k), 0.5)]
    one = megatron.kernel_time_s(Kernel("gemm", gemm=(1, m, 2 * f, k)), "bf16")
    assert sum(megatron.device_and_host_s(t[0], "bf16")[0] for t in tasks) == pytest.approx(
        one + megatron.cluster.device.launch_overhead_s
    )


def test_an_expert_stack_fuses_its_gate_and_up_products() -> None:
    """The experts' batched products with w1 and w3 (Megatron-Core's grouped linear_fc1, doubled per
    expert) fuse as a linear layer's do: one batched GEMM of the summed width each way, halves."""
    e, t, h, f = 8, 1024, 4096, 14336
    shapes = ((e, t, h), (e, h, f), (e, t, f))
    fused = op_kernels("matmul", "F", shapes, 2, "megatron", fused_widths=(f, f)).kernels
    assert [(kn.gemm, kn.computed) for kn in fused] == [((e, t, 2 * f, h), 0.5)]
    back = op_kernels("matmul", "B", shapes, 2, "megatron", fused_widths=(f, f)).kernels
    assert [(kn.gemm, kn.computed) for kn in back] == [((e, t, h, 2 * f), 0.5), ((e, h, 2 * f, t), 0.5)]
    alone = op_kernels("matmul", "F", shapes, 2, "megatron").kernels
    assert [(kn.gemm, kn.computed) for kn in alone] == [((e, t, f, h), 1.0)]


@pytest.mark.parametrize(
    "model, expected",
    [
        # two layers: the attention's q, k, v (grouped-query: k and v narrower), the SwiGLU's w1 and w3
        ("llama-tiny", {(Fusion.QKV, (32, 16, 16)): 6, (Fusion.GATE_UP, (80, 80)): 4}),
        # four layers' self-attention q, k, v; the two decoder layers' cross-attention k and v only
        # (its q reads the decoder); the gated-GELU's wi_0 and wi_1
        ("t5-tiny", {(Fusion.QKV, (16, 16, 16)): 12, (Fusion.QKV, (16, 16)): 4, (Fusion.GATE_UP, (64, 64)): 8}),
        # the experts' stacked products with w1 and w3, their width split by tp as the dense layers'
        ("moe-tiny", {(Fusion.QKV, (32, 16, 16)): 6, (Fusion.GATE_UP, (48, 48)): 4}),
    ],
)
def test_materialize_marks_every_fused_projection(model, expected) -> None:
    """Under tp 2 each projection that a fused GEMM computes carries its fusion and its group's
    local widths, forward and backward alike; the cross-attention's query, the output projections,
    the MLP's down projection and the router carry none."""
    from collections import Counter

    from conftest import traced
    from planlab.plan import materialize
    from planlab.search_spaces import Context, get_space

    spec, g = traced(model, 8)
    plan = get_space("megatron").build(Context(g, spec, 8, "cpu", 2, 2, 1), dict(dp=1, tp=2, pp=1, microbatch=2))
    tasks = [t for _, t in materialize(plan, g).devices[0].tasks_in_order() if t.op_kind in ("linear", "matmul")]
    for kind in (TaskKind.FORWARD, TaskKind.BACKWARD):
        marked = {(t.op, t.fusion, t.fused_widths) for t in tasks if t.kind is kind and t.fusion is not None}
        assert Counter((f, w) for _, f, w in marked) == expected
    assert len({t.op for t in tasks if t.fusion is None}) > 0


def test_fp8_keeps_the_output_projection_in_16_bits() -> None:
    """torchtitan's Float8 filter leaves the ``output`` linear out and Megatron-Core's output_layer is no
    Transformer Engine module: under FP8 the projection whose output reaches the loss is marked, priced
    with 16-bit GEMMs and no casts, and keeps its 16-bit input for the backward; the other linear
    layers run in FP8 and keep their input's cast."""
    from conftest import traced
    from planlab.costmodel.precision import Precision
    from planlab.plan.saved import cast_inputs, output_layer

    _, g = traced("llama-tiny", 8)
    marked = {op.name for op in g.operators if output_layer(op, g)}
    assert marked == {"output"}
    fp8 = Precision("fp8", 2, 2, 4, 12, "fp8", linear_input_bytes=1)
    out = g.op("output")
    assert not cast_inputs(out, g, fp8)
    other = next(op for op in g.operators if op.kind == "linear" and op.name != "output")
    assert cast_inputs(other, g, fp8)
    cost = CostModel.load("dgx-h100", precision="fp8")
    x, w, y = (2, 256, 512), (1024, 512), (2, 256, 1024)
    head = Task("o", TaskKind.FORWARD, op_kind="linear", shapes=(x, w, y), output_layer=True)
    body = Task("o", TaskKind.FORWARD, op_kind="linear", shapes=(x, w, y))
    as16 = CostModel.load("dgx-h100", precision="bf16")
    assert cost.device_and_host_s(head, "fp8") == as16.device_and_host_s(body, "bf16")
    assert cost.device_and_host_s(body, "fp8") != cost.device_and_host_s(head, "fp8")


def test_fp8_weight_cast_is_made_once_a_step_where_the_software_keeps_it() -> None:
    """Transformer Engine keeps a weight's FP8 cast (and its transpose) from a step's first micro-batch
    for the others and for recomputed forwards (Megatron-Core passes ``is_first_microbatch``): with
    ``fp8_weight_cache`` each forward of a step's M micro-batches is charged 1/M of the cast and a
    recomputed forward none; torchao's Float8 linear casts its weight in every forward."""
    from planlab.plan.program import Recompute

    x, w, y = (2, 256, 512), (1024, 512), (2, 256, 1024)
    per = 2 + 2  # a cast reads 16 bits and writes the FP8 copy and its transpose
    every = op_kernels("linear", "F", (x, w, y), 2, "megatron", True)
    quarter = op_kernels("linear", "F", (x, w, y), 2, "megatron", True, weight_casts=0.25)
    kept = op_kernels("linear", "F", (x, w, y), 2, "megatron", True, weight_casts=0.0)
    assert [k.name for k in every.kernels] == ["fp8-cast-input", "fp8-cast-weight", "gemm"]
    assert every.kernels[1].bytes == 1024 * 512 * per and quarter.kernels[1].bytes == 1024 * 512 * per / 4
    assert [k.name for k in kept.kernels] == ["fp8-cast-input", "gemm"] and kept.calls == every.calls - 1
    experts = op_kernels("matmul", "F", ((8, 64, 512), (8, 512, 256), (8, 64, 256)), 2, "megatron", True,
                         fp8_matmul=True, weight_casts=0.5)  # fmt: skip
    assert experts.kernels[1].name == "fp8-cast-weight" and experts.kernels[1].bytes == 8 * 512 * 256 * per / 2
    for name in ("megatron", "megatron-hybridep", "hai-llm"):
        assert load_software(name).fp8_weight_cache
    assert not load_software("torch").fp8_weight_cache
    mega = CostModel.load("dgx-h100", precision="fp8")
    titan = CostModel.load("dgx-h100", software="torch", precision="fp8")
    cast_s = mega.kernel_time_s(every.kernels[1], "bf16")
    base = dict(op_kind="linear", shapes=(x, w, y))
    one, four = (Task("fc", TaskKind.FORWARD, step_microbatches=n, **base) for n in (1, 4))
    redo = Task("fc", TaskKind.FORWARD, step_microbatches=4, recompute=Recompute.REDO, **base)
    t1, t4, tr = (mega.device_and_host_s(t, "fp8")[0] for t in (one, four, redo))
    assert t1 - t4 == pytest.approx(cast_s - mega.kernel_time_s(quarter.kernels[1], "bf16"), rel=1e-9)
    assert t1 - tr == pytest.approx(cast_s, rel=1e-9)
    assert (
        titan.device_and_host_s(one, "fp8")
        == titan.device_and_host_s(four, "fp8")
        == titan.device_and_host_s(redo, "fp8")
    )


def test_the_kept_fp8_weight_casts_are_static_memory_and_the_forwards_know_the_step_s_microbatches() -> None:
    """A Program under FP8 with a software that keeps the weights' casts: every forward piece of a linear
    layer carries the step's micro-batch count, and each device's static memory holds two bytes (the FP8
    copy and its transpose) per element of its pieces of the FP8 linear layers' weights, the 16-bit
    output projection's left out; none under torch or in 16 bits."""
    from conftest import traced
    from planlab.plan.layout import box_numel
    from planlab.plan.saved import output_layer
    from planlab.plan.software_passes import build_program
    from planlab.search_spaces import Context, get_space

    spec, g = traced("llama-tiny", 8)
    knobs = dict(dp=1, tp=2, pp=1, microbatch=2, zero=0, recompute="full")
    plan = get_space("megatron").build(Context(g, spec, 8, "dgx-h100", 1, 2, 8), knobs)
    weights = {op.inputs[1] for op in g.operators if op.kind == "linear" and not output_layer(op, g)}
    assert weights and g.op("output").inputs[1] not in weights
    kept = {}
    for software, precision in (("megatron", "fp8"), ("torch", "fp8"), ("megatron", "bf16")):
        cost = CostModel.load("dgx-h100", software=software, precision=precision)
        program = build_program(plan, g, cost, symmetric=False)
        dp = program.devices[0]
        kept[(software, precision)] = dp.cast_weight_bytes
        linears = [
            t for b in dp.blocks.values() for t in b.tasks if t.kind is TaskKind.FORWARD and t.op_kind == "linear"
        ]
        assert linears and {t.step_microbatches for t in linears} == {plan.microbatches} == {4}
    own = sum(box_numel(b) for p, b in dp.params if p in weights)
    assert kept == {("megatron", "fp8"): 2 * own, ("torch", "fp8"): 0, ("megatron", "bf16"): 0}
    assert dp.static_bytes == dp.param_bytes + dp.grad_bytes + dp.optimizer_bytes


def test_fp8_all_gather_moves_fp8_weights_and_the_linears_skip_their_weight_cast() -> None:
    """torchtitan's Float8 with enable_fsdp_float8_all_gather (software torch-float8-fsdp): FSDP gathers
    the Float8 linear layers' weights in FP8, one byte an element, cast on the shard; a linear layer
    reading such a weight does not cast it forward and copies it into its transposed layout backward
    (torchao's preprocess_addmm); the 16-bit output projection and the norms are gathered in bf16."""
    from conftest import traced
    from planlab.plan.program import Role
    from planlab.plan.saved import fp8_gathered_weights, output_layer
    from planlab.plan.software_passes import build_program
    from planlab.search_spaces import Context, get_space

    x, w, y = (2, 256, 512), (1024, 512), (2, 256, 1024)
    fwd = op_kernels("linear", "F", (x, w, y), 2, "torch", True, fp8_gathered=True)
    bwd = op_kernels("linear", "B", (x, w, y), 2, "torch", True, fp8_gathered=True)
    assert [k.name for k in fwd.kernels] == ["fp8-cast-input", "gemm"]
    plain = op_kernels("linear", "B", (x, w, y), 2, "torch", True)
    assert [k.name for k in bwd.kernels] == [plain.kernels[0].name, "fp8-transpose-weight"] + [
        k.name for k in plain.kernels[1:]
    ]
    assert bwd.kernels[1].bytes == 2 * 1024 * 512
    assert load_software("torch-float8-fsdp").fp8_all_gather and not load_software("torch").fp8_all_gather

    spec, g = traced("llama-tiny", 8)
    plan = get_space("megatron").build(
        Context(g, spec, 8, "dgx-h100", 1, 2, 8), dict(dp=2, tp=1, pp=1, microbatch=1, zero=3, recompute="none")
    )
    gathers, marked = {}, {}
    for software in ("torch", "torch-float8-fsdp"):
        cost = CostModel.load("dgx-h100", software=software, precision="fp8")
        dp = build_program(plan, g, cost, symmetric=False).devices[0]
        tasks = [t for b in dp.blocks.values() for t in b.tasks]
        gathers[software] = {t.name: (t.nbytes, t.writes) for t in tasks if t.role is Role.UNIT_GATHER}
        marked[software] = {t.op for t in tasks if t.fp8_gathered}
    fp8 = fp8_gathered_weights(g, load_software("torch-float8-fsdp"), cost.precision)
    linears = {op.name for op in g.operators if op.kind == "linear" and not output_layer(op, g)}
    assert fp8 == {g.op(name).inputs[1] for name in linears} and g.op("output").inputs[1] not in fp8
    assert marked == {"torch": set(), "torch-float8-fsdp": linears}
    assert gathers["torch"].keys() == gathers["torch-float8-fsdp"].keys()
    lighter = 0
    for name, (nbytes, writes) in gathers["torch"].items():
        fp8_elems = sum(math.prod(g.tensors[b.tensor].shape) for b in writes if b.tensor in fp8)
        assert nbytes - gathers["torch-float8-fsdp"][name][0] == fp8_elems  # one byte less an element
        lighter += fp8_elems
    assert lighter > 0


def test_block_scaled_fp8_runs_block_scaled_gemms_and_casts_that_write_their_scales() -> None:
    """DeepSeek-V3's FP8 recipe (software hai-llm): one fp32 scale per 1 x 128 tile of activations and
    gradients (row-wise and column-wise copies) and per 128 x 128 block of weights; its GEMMs run by the
    device's block-scaled GEMM figures, slower than per-tensor ones at large shapes (AIConfigurator's H100
    fp8_block table); Megatron-Core as the Bridge row ran it keeps per-tensor scales."""
    x, w, y = (2, 2048, 4096), (4096, 4096), (2, 2048, 4096)
    per = 2 + 2  # a cast reads 16 bits and writes the FP8 copy and its transpose
    tensor = op_kernels("linear", "F", (x, w, y), 2, "megatron", True)
    block = op_kernels("linear", "F", (x, w, y), 2, "megatron", True, fp8_block=True)
    assert [k.name for k in block.kernels] == [k.name for k in tensor.kernels]
    assert block.kernels[0].bytes == 4096 * 4096 * (per + 8 / 128)
    assert block.kernels[1].bytes == 4096 * 4096 * (per + 8 / 128**2)
    assert block.kernels[2].block and block.kernels[2].fp8 and not tensor.kernels[2].block
    back = op_kernels("linear", "B", (x, w, y), 2, "megatron", True, fp8_block=True)
    assert back.kernels[0].bytes == 4096 * 4096 * (per + 8 / 128) and all(k.block for k in back.kernels if k.gemm)
    assert load_software("hai-llm").fp8_block_scaling
    assert not load_software("megatron").fp8_block_scaling and not load_software("megatron-hybridep").fp8_block_scaling
    cost = CostModel.load("dgx-h100", precision="fp8")
    dev = cost.cluster.device
    spec = dev.gemm.fp8_block()
    assert (spec.efficiency, spec.tile_overhead_k) == (
        dev.gemm.efficiency_fp8_block,
        dev.gemm.tile_overhead_k_fp8_block,
    )
    gemm = block.kernels[2]
    hbm = dev.hbm_bytes_per_s * dev.memory_efficiency.max
    want = gemm_time_s(
        spec, batch=1, m=4096, n=4096, k=4096, elem_bytes=1, peak_flops_per_s=1979e12, hbm_bytes_per_s=hbm
    )
    assert cost.kernel_time_s(gemm, "bf16") == pytest.approx(want + dev.launch_overhead_s, rel=1e-12)
    assert cost.kernel_time_s(gemm, "bf16") > cost.kernel_time_s(tensor.kernels[2], "bf16")
    hai = CostModel.load("dgx-h100", software="hai-llm", precision="fp8")
    task = Task("fc", TaskKind.FORWARD, op_kind="linear", shapes=(x, w, y))
    blocked = op_kernels("linear", "F", (x, w, y), 2, "megatron", True, fp8_block=True)
    want = sum(hai.kernel_time_s(k, "bf16") for k in blocked.kernels)
    assert hai.device_and_host_s(task, "fp8")[0] == pytest.approx(want, rel=1e-12)
    assert cost.device_and_host_s(task, "fp8")[0] < want  # megatron's per-tensor scales
