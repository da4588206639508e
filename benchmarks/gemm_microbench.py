"""planlab's GEMM model against a measured per-shape GEMM table, and where ``gemm_tile_overhead_k``
and ``gemm_efficiency`` of the A100 come from.

The tables (``benchmarks/microbench/``, see the README there) are kernel microbenchmarks: one bf16
``x @ W.T`` per row on an A100-SXM4-80GB (``--device a100-80g`` or ``a100-40g``) or an H100 SXM5
80GB (``--device h100-80g``), m, n and k from 256 to 16,384. They are no training measurements and
no validation sets.

Prints, for the built-in device, predicted over measured time by k and by size (with ``--classes``: the signed error by GFLOP, k and m * n
class on every carried table), then with ``--fit``
the two numbers of the A100 spec as they are derived: for each per-tile overhead ``k0`` on a grid,
the efficiency at which the model reproduces the Maximum Achievable Matmul FLOPS measurement
(271.2 TFLOP/s at 1024 x 10240 x 5120, ml-engineering handbook), and the table's mean absolute log
ratio with both; the smallest is the spec's (the H100's likewise at its own MAMF shape), under the power ceiling
``gemm_power_ceiling``, which MAMF also gives: the fastest rate any shape of its search reached, the kernel's own. With ``--fp8``
(``h100-80g``): the same for FP8 GEMMs against the H100's FP8 table (TensorRT-LLM's FP8 ``Linear`` with
dynamic per-tensor scaling: each measured row quantizes its input, then runs the FP8 GEMM); the model's
FP8 GEMM plus the input's quantization as the same project measured it alone, at the same m and k, against
the row, and with ``--fit`` the grid ``gemm_tile_overhead_k_fp8`` and ``gemm_efficiency_fp8`` come from
(anchored to MAMF's FP8 measurement, 1402.6 TFLOP/s at 1024 x 9216 x 14336). With
``--flash``: fused attention against the device's measured attention tables (A100: FlashAttention-2's
forward and backward; H100: FlashAttention-2's, and FlashAttention-3's paper's FA2, cuDNN and FA3
forward and backward), per kernel the grid values ``attention_efficiency`` comes from (forward and
backward efficiency, overhead per score element) and the model's ratio to each measured bar there. With ``--whole-waves`` the device's GEMMs pay whole
waves even where its spec splits the last one (``gemm_stream_k``): the model before that field.

    .venv/bin/python benchmarks/gemm_microbench.py [--device a100-80g|h100-80g] [--fit] [--whole-waves] [--flash] [--fp8]
    .venv/bin/python benchmarks/gemm_microbench.py --classes
"""

import argparse
import dataclasses
import math
from pathlib import Path

import numpy as np
import pandas as pd

from planlab.costmodel import CostModel
from planlab.costmodel.gemm import GemmSpec, gemm_time_s
from planlab.costmodel.hardware import DeviceSpec, load_device
from planlab.costmodel.kernels import op_kernels

MICROBENCH = Path(__file__).resolve().parent / "microbench"
TABLES = {  # the measured table of each device the script knows
    "a100-80g": MICROBENCH / "a100-sxm4-80gb-gemm-bf16.csv",
    "a100-40g": MICROBENCH / "a100-sxm4-80gb-gemm-bf16.csv",
    "h100-80g": MICROBENCH / "h100-sxm5-80gb-gemm-bf16.csv",
}
# FP8 (e4m3) GEMM tables: each row the input's dynamic quantization then the GEMM, with that quantization's two
# kernels measured alone (compute_scale_ms, scale_matrix_ms; see microbench/README.md)
TABLES_FP8 = {"h100-80g": MICROBENCH / "h100-sxm5-80gb-gemm-fp8.csv"}
# block-scaled FP8 GEMM tables: each row the input's 1 x 128 quantization then the GEMM (microbench/README.md)
TABLES_FP8_BLOCK = {"h100-80g": MICROBENCH / "h100-sxm5-80gb-gemm-fp8-block.csv"}
QUANT_1X128_BYTES = 2 + 1 + 4 / 128  # per input element: bf16 read, FP8 written, one fp32 scale per 128
# Maximum Achievable Matmul FLOPS, FP8 (float8_e4m3fn, same handbook): H100 SXM, torch 2.7.0+cu126
MAMF_FP8 = {"h100-80g": ((1024, 9216, 14336), 1402.6e12)}
# Maximum Achievable Matmul FLOPS, bf16 (ml-engineering handbook, compute/accelerator/README.md): the best
# shape m x n x k of each SXM card and its flop/s there (A100: torch 2.6.0+cu126; H100: torch 2.7.0+cu126)
MAMF = {
    "a100-80g": ((1024, 10240, 5120), 271.2e12),
    "a100-40g": ((1024, 10240, 5120), 271.2e12),
    "h100-80g": ((2048, 2048, 13312), 794.5e12),
}
K0_GRID = range(0, 321, 32)
K0_GRID_FP8_BLOCK = range(0, 1025, 64)  # block-scaled: the fp32 promotion every 128 of k may add per-step cost
K0_GRID_FP8 = range(0, 641, 32)  # an FP8 k step takes half a 16-bit one's time, so the same overhead is twice the steps


def model_s(dev: DeviceSpec, spec: GemmSpec, m: int, n: int, k: int, fp8: bool = False) -> float:
    """One bf16 GEMM (``fp8``: FP8 operands, by the spec's FP8 efficiency and tile overhead) as the cost model
    prices it (its launch latency included)."""
    hbm = dev.hbm_bytes_per_s * dev.memory_efficiency.max
    peak = dev.peak_flops_per_s["fp8" if fp8 else "bf16"]
    spec, eb = (spec.fp8(), 1) if fp8 else (spec, 2)
    return gemm_time_s(spec, batch=1, m=m, n=n, k=k, elem_bytes=eb, peak_flops_per_s=peak, hbm_bytes_per_s=hbm) + (
        dev.launch_overhead_s
    )


def log_ratios(dev: DeviceSpec, spec: GemmSpec, table: pd.DataFrame, fp8: bool = False) -> pd.Series:
    """log(predicted / measured) per row of the table (``fp8``: the FP8 table, whose rows also quantize the
    input: the model's GEMM plus that quantization as measured alone)."""
    pred = [model_s(dev, spec, int(r.m), int(r.n), int(r.k), fp8) for r in table.itertuples()]
    quantize_s = (table["compute_scale_ms"] + table["scale_matrix_ms"]) * 1e-3 if fp8 else 0.0 * table["m"]
    return pd.Series(
        [math.log((p + q) / (r * 1e-3)) for p, q, r in zip(pred, quantize_s, table["latency_ms"])], index=table.index
    )


def with_fit(spec: GemmSpec, efficiency: float, k0: int, fp8: bool) -> GemmSpec:
    """``spec`` with the 16-bit (or ``fp8``) efficiency and tile overhead replaced."""
    if fp8:
        return dataclasses.replace(spec, efficiency_fp8=efficiency, tile_overhead_k_fp8=k0)
    return dataclasses.replace(spec, efficiency=efficiency, tile_overhead_k=k0)


def anchored_efficiency(dev: DeviceSpec, k0: int, name: str, fp8: bool = False) -> float:
    """The efficiency at which the model with per-tile overhead ``k0`` runs device ``name``'s MAMF shape at
    its MAMF flop/s (``fp8``: the FP8 ones)."""
    (m, n, k), flops = (MAMF_FP8 if fp8 else MAMF)[name]
    want_s = 2.0 * m * n * k / flops
    lo, hi = 0.3, 1.0
    for _ in range(60):  # bisection: time falls as the efficiency rises
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if model_s(dev, with_fit(dev.gemm, mid, k0, fp8), m, n, k, fp8) > want_s else (lo, mid)
    return (lo + hi) / 2


def mamf_ceiling(dev: DeviceSpec, name: str) -> float:
    """The power ceiling (``gemm_power_ceiling``) device ``name``'s bf16 MAMF measurement gives: the rate of the
    kernel itself (the device's launch latency taken off the measured time) as a fraction of the dense peak. MAMF
    is the fastest rate a brute-force search over shapes, run back to back, reached on the card."""
    (m, n, k), flops = MAMF[name]
    kernel_s = 2.0 * m * n * k / flops - dev.launch_overhead_s
    return 2.0 * m * n * k / kernel_s / dev.peak_flops_per_s["bf16"]


def by_group(table: pd.DataFrame, lr: pd.Series) -> None:
    """Median predicted/measured by k (m >= 2048) and by GFLOP."""
    big_m = table["m"] >= 2048
    kbin = pd.cut(table["k"], [0, 512, 1024, 2048, 4096, 8192, 16384])
    gbin = pd.cut(2 * table["m"] * table["n"] * table["k"] / 1e9, [0, 1, 4, 16, 64, 256, 1e6])
    for name, groups in (
        ("k (m >= 2048)", lr[big_m].groupby(kbin[big_m], observed=True)),
        ("GFLOP", lr.groupby(gbin, observed=True)),
    ):
        cells = [f"{b}: {math.exp(s.median()):.3f} (n={len(s)})" for b, s in groups]
        print(f"  predicted/measured by {name}: " + "; ".join(cells))


# the size classes --classes reports the signed error by: the GEMM's GFLOP, its k, and its output's m * n (in 2^20)
SIZE_CLASSES = {
    "GFLOP": [0, 1, 4, 16, 64, 256, 1024, 1e6],
    "k": [0, 512, 1024, 2048, 4096, 8192, 16384],
    "m*n (2^20)": [0, 1, 4, 16, 64, 256],
}


def size_classes(name: str, table: pd.DataFrame, lr: pd.Series) -> None:
    """The model's signed error (predicted over measured time, less 1) by size class: mean, median and mean
    absolute per class of :data:`SIZE_CLASSES` (negative: the model is too fast)."""
    err = np.exp(lr) - 1.0
    print(
        f"{name}: {len(table)} rows, mean |error| {100 * err.abs().mean():.1f}%, signed mean "
        f"{100 * err.mean():+.1f}%, median {100 * err.median():+.1f}%"
    )
    size = {
        "GFLOP": 2 * table["m"] * table["n"] * table["k"] / 1e9,
        "k": table["k"],
        "m*n (2^20)": table["m"] * table["n"] / 2**20,
    }
    for what, bins in SIZE_CLASSES.items():
        groups = err.groupby(pd.cut(size[what], bins), observed=True)
        cells = [
            f"{b}: {100 * e.mean():+.1f}/{100 * e.median():+.1f}/{100 * e.abs().mean():.1f} (n={len(e)})"
            for b, e in groups
        ]
        print(f"  by {what} (signed mean/median/mean |error| %): " + "; ".join(cells))


def every_table() -> None:
    """:func:`size_classes` of the model against every carried GEMM table (each built-in device with its own)."""
    for name in ("a100-80g", "h100-80g"):
        dev = load_device(name)
        table = pd.read_csv(TABLES[name])
        size_classes(f"{name} bf16 ({TABLES[name].name})", table, log_ratios(dev, dev.gemm, table))
        if name in TABLES_FP8:
            table = pd.read_csv(TABLES_FP8[name])
            lr = log_ratios(dev, dev.gemm, table, fp8=True)
            size_classes(f"{name} FP8 + measured quantization ({TABLES_FP8[name].name})", table, lr)
        if name in TABLES_FP8_BLOCK:
            table = pd.read_csv(TABLES_FP8_BLOCK[name])
            lr = pd.Series(block_ratios(dev, dev.gemm, table), index=table.index)
            size_classes(f"{name} block-scaled FP8 + quantization ({TABLES_FP8_BLOCK[name].name})", table, lr)


# Fused-attention speed tables per device (see microbench/README.md): each row a kernel ("flash2",
# "cudnn", "flash3"), a pass ("fwd", "bwd" or "fwd_bwd"), a sequence, the causal mask or not, a head
# dimension and TFLOP/s as FlashAttention counts them; a table without kernel or pass columns is one
# kernel's forward and backward, named here
FLASH_TABLES = {
    "a100-80g": ((MICROBENCH / "a100-sxm4-80gb-flash2-fwd-bwd.csv", "flash2"),),
    "a100-40g": ((MICROBENCH / "a100-sxm4-80gb-flash2-fwd-bwd.csv", "flash2"),),
    "h100-80g": (
        (MICROBENCH / "h100-sxm5-80gb-flash2-fwd-bwd.csv", "flash2"),
        (MICROBENCH / "h100-sxm5-80gb-fa3-paper-attention.csv", ""),
    ),
}
FLASH_TOKENS, FLASH_HIDDEN = 16384, 2048  # FlashAttention's benchmarks: batch x sequence = 16k tokens, hidden 2048
PASS_PHASES = {"fwd": "F", "bwd": "B", "fwd_bwd": "FB"}
PASS_FLOP = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}  # the backward counted as 2.5 forwards (FlashAttention-2)


def flash_parts(cost: CostModel, overhead_k: int, seq: int, causal: bool, head_dim: int, phase: str) -> np.ndarray:
    """Fused attention's forward (``phase`` "F") or backward ("B") on FlashAttention's benchmark shapes as the
    cost model prices it, in parts of its seconds: (compute at efficiency 1, memory floor, launch), so that at
    efficiency ``e`` the pass takes ``max(compute / e, memory) + launch`` (the tile model's compute time is
    inversely proportional to the efficiency)."""
    dev = cost.cluster.device
    spec = dataclasses.replace(dev.gemm, efficiency=1.0, tile_overhead_k=overhead_k)
    hbm = dev.hbm_bytes_per_s * dev.memory_efficiency.max
    shapes = ((FLASH_TOKENS // seq, FLASH_HIDDEN // head_dim, seq, head_dim),) * 4
    (kernel,) = op_kernels("attention", phase, shapes, 2, "torch", causal=causal).kernels
    b, m, n, k = kernel.gemm
    peak = dev.peak_flops_per_s["bf16"]
    compute_s = gemm_time_s(spec, batch=b, m=m, n=n, k=k, elem_bytes=2, peak_flops_per_s=peak, hbm_bytes_per_s=math.inf)
    return np.array([compute_s * kernel.computed, kernel.bytes / hbm, dev.launch_overhead_s])


def flash_rows(name: str) -> pd.DataFrame:
    """Every measured fused-attention row of device ``name``, with its table's file name and the flop
    FlashAttention counts for it."""
    frames = []
    for path, kernel in FLASH_TABLES[name]:
        t = pd.read_csv(path)
        if kernel:
            t = t.assign(kernel=kernel, **{"pass": "fwd_bwd"})
        frames.append(t.assign(table=path.name))
    t = pd.concat(frames, ignore_index=True).rename(columns={"pass": "pass_"})
    scale = t["pass_"].map(PASS_FLOP) * (1.0 - 0.5 * t["causal"])
    return t.assign(flop=4.0 * FLASH_TOKENS * t["seq"] * FLASH_HIDDEN * scale)


EFF_GRID = np.arange(300, 1001, 5) / 1000  # efficiencies tried
OVERHEAD_K_GRID = range(0, 257, 32)  # overheads per score element tried, in steps of k


def flash_fit(name: str) -> None:
    """The model's fused attention against the measured speed tables of device ``name``, and per kernel the
    grid values of its forward and backward efficiency (0.005 apart) and overhead k (32 apart) that minimize
    the mean absolute log ratio over its rows. A kernel measured only forward and backward together gets one
    efficiency for both; one measured at a single head dimension gets no overhead (the two are not told
    apart there)."""
    dev = load_device(name)
    cost = CostModel.load("dgx-a100-80g", software="torch")
    cost = dataclasses.replace(
        cost, cluster=dataclasses.replace(cost.cluster, node=dataclasses.replace(cost.cluster.node, device=dev))
    )
    rows = flash_rows(name)
    for kernel, t in rows.groupby("kernel", sort=False):
        apart = bool(set(t["pass_"]) - {"fwd_bwd"})
        overheads = OVERHEAD_K_GRID if t["head_dim"].nunique() > 1 else (0,)
        has_f = np.array(["fwd" in p for p in t["pass_"]], dtype=float)[:, None, None]
        has_b = np.array(["bwd" in p for p in t["pass_"]], dtype=float)[:, None, None]
        want = (t["flop"] / 1e12 / t["tflops"]).to_numpy()[:, None, None]  # measured seconds

        def log_ratios(k0: int) -> np.ndarray:  # rows x forward efficiency x backward efficiency
            secs = []
            for ph in "FB":
                parts = np.array(
                    [flash_parts(cost, k0, int(r.seq), bool(r.causal), int(r.head_dim), ph) for r in t.itertuples()]
                )
                secs.append(np.maximum(parts[:, :1] / EFF_GRID[None, :], parts[:, 1:2]) + parts[:, 2:3])
            model = has_f * secs[0][:, :, None] + has_b * secs[1][:, None, :]
            return np.log(want / model)  # model TFLOP/s over measured

        best = None
        for k0 in overheads:
            lr = log_ratios(k0)
            err = np.abs(lr).mean(axis=0)
            if not apart:
                err = np.where(np.eye(len(EFF_GRID), dtype=bool), err, np.inf)
            i, j = np.unravel_index(np.argmin(err), err.shape)
            if best is None or err[i, j] < best[0]:
                best = (err[i, j], k0, i, j, lr[:, i, j])
        err, k0, i, j, lr = best
        print(
            f"  {kernel} ({len(t)} rows): now {dev.gemm.attention(kernel, False)} forward, "
            f"{dev.gemm.attention(kernel, True)} backward (efficiency, overhead k); grid best forward "
            f"{EFF_GRID[i]:.3f}, backward {EFF_GRID[j]:.3f}, overhead k {k0} (mean |log ratio| {err:.4f})"
        )
        fitted = pd.Series(np.exp(lr), index=t.index)
        for (table, pass_, causal, dim), g in t.groupby(["table", "pass_", "causal", "head_dim"], sort=False):
            cells = ", ".join(f"{int(s) // 1024}k {v:.2f}" for s, v in zip(g["seq"], fitted[g.index]))
            print(f"    model/measured there, {table} {pass_} {'causal' if causal else 'full'} d{dim}: {cells}")


def block_ratios(dev: DeviceSpec, spec: GemmSpec, table: pd.DataFrame) -> np.ndarray:
    """log(predicted / measured) per row of the block-scaled FP8 table: the model's block-scaled GEMM
    (``spec.fp8_block()``) plus the input's 1 x 128 quantization, one pass of :data:`QUANT_1X128_BYTES` an
    element at the achieved bandwidth with its launch (not measured alone)."""
    hbm = dev.hbm_bytes_per_s * dev.memory_efficiency.max
    peak, block = dev.peak_flops_per_s["fp8"], spec.fp8_block()
    out = []
    for r in table.itertuples():
        m, n, k = int(r.m), int(r.n), int(r.k)
        gemm = gemm_time_s(block, batch=1, m=m, n=n, k=k, elem_bytes=1, peak_flops_per_s=peak, hbm_bytes_per_s=hbm)
        quantize = m * k * QUANT_1X128_BYTES / hbm
        out.append(math.log((gemm + quantize + 2 * dev.launch_overhead_s) / (r.latency_ms * 1e-3)))
    return np.array(out)


def block_fit(dev: DeviceSpec, table: pd.DataFrame) -> None:
    """For each tile overhead k0 of the grid, the efficiency that minimizes the block-scaled table's mean
    |log ratio| (golden-section search; no MAMF measurement of block-scaled GEMMs to anchor to)."""
    for k0 in K0_GRID_FP8_BLOCK:

        def cost(eff: float) -> float:
            spec = dataclasses.replace(dev.gemm, efficiency_fp8_block=eff, tile_overhead_k_fp8_block=k0)
            return float(np.abs(block_ratios(dev, spec, table)).mean())

        lo, hi = 0.4, 1.0
        g = (math.sqrt(5) - 1) / 2
        for _ in range(14):
            a, b = hi - g * (hi - lo), lo + g * (hi - lo)
            lo, hi = (lo, b) if cost(a) < cost(b) else (a, hi)
        eff = (lo + hi) / 2
        spec = dataclasses.replace(dev.gemm, efficiency_fp8_block=eff, tile_overhead_k_fp8_block=k0)
        lr = block_ratios(dev, spec, table)
        print(
            f"  k0 {k0:4d}: efficiency {eff:.4f}, mean |log ratio| {np.abs(lr).mean():.4f}, median {math.exp(np.median(lr)):.3f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="a100-80g", choices=sorted(TABLES), help="built-in device with a table")
    ap.add_argument("--fit", action="store_true", help="print the k0 grid the spec's two numbers come from")
    ap.add_argument("--whole-waves", action="store_true", help="no stream-K: every wave is paid in whole")
    ap.add_argument("--flash", action="store_true", help="fused attention against the measured attention tables")
    ap.add_argument("--fp8", action="store_true", help="FP8 GEMMs against the measured FP8 table")
    ap.add_argument("--fp8-block", action="store_true", help="block-scaled FP8 GEMMs against their measured table")
    ap.add_argument("--classes", action="store_true", help="the signed error by size class on every carried table")
    args = ap.parse_args()
    if args.classes:
        every_table()
        return
    if args.flash and args.device not in FLASH_TABLES:
        ap.error(f"--flash needs a measured attention table; got --device {args.device}, choose {sorted(FLASH_TABLES)}")
    if args.fp8 and args.device not in TABLES_FP8:
        ap.error(f"--fp8 needs a measured FP8 GEMM table; got --device {args.device}, choose {sorted(TABLES_FP8)}")
    dev = load_device(args.device)
    if args.fp8_block:
        if args.device not in TABLES_FP8_BLOCK:
            ap.error(
                f"--fp8-block needs a measured table; got --device {args.device}, choose {sorted(TABLES_FP8_BLOCK)}"
            )
        table = pd.read_csv(TABLES_FP8_BLOCK[args.device])
        lr = block_ratios(dev, dev.gemm, table)
        now = dev.gemm.fp8_block()
        print(
            f"{args.device} block-scaled FP8 ({now.efficiency:.4g} of the FP8 peak, tile overhead k {now.tile_overhead_k}) "
            f"on {len(table)} measured GEMMs: median predicted/measured {math.exp(np.median(lr)):.3f}, "
            f"mean |log ratio| {np.abs(lr).mean():.3f}"
        )
        by_group(table, pd.Series(lr, index=table.index))
        if args.fit:
            block_fit(dev, table)
        return
    if args.whole_waves:
        dev = dataclasses.replace(dev, gemm=dataclasses.replace(dev.gemm, stream_k=False))
    fp8 = args.fp8
    table = pd.read_csv((TABLES_FP8 if fp8 else TABLES)[args.device])
    lr = log_ratios(dev, dev.gemm, table, fp8)
    now = dev.gemm.fp8() if fp8 else dev.gemm
    print(
        f"{args.device} {'FP8' if fp8 else 'bf16'} ({now.efficiency:.4g} of peak, tile overhead k {now.tile_overhead_k}, "
        f"stream-K {now.stream_k}) on {len(table)} measured GEMMs: "
        f"median predicted/measured {math.exp(lr.median()):.3f}, mean |log ratio| {lr.abs().mean():.3f}"
    )
    by_group(table, lr)
    if args.flash:
        flash_fit(args.device)
    if args.fit and not fp8:
        print(
            f"  power ceiling from MAMF ({MAMF[args.device][1] / 1e12:.1f} TFLOP/s, launch taken off): "
            f"{mamf_ceiling(dev, args.device):.4f} of the peak (the spec's gemm_power_ceiling: {dev.gemm.power_ceiling})"
        )
    if args.fit:
        for k0 in K0_GRID_FP8 if fp8 else K0_GRID:
            eff = anchored_efficiency(dev, k0, args.device, fp8)
            lr = log_ratios(dev, with_fit(dev.gemm, eff, k0, fp8), table, fp8)
            print(
                f"  k0 {k0:3d}: efficiency {eff:.4f}, mean |log ratio| {lr.abs().mean():.4f}, median {math.exp(lr.median()):.3f}"
            )


if __name__ == "__main__":
    main()
