"""planlab's price of an unfused attention core (Megatron's ``baddbmm``, softmax, dropout, ``bmm`` and their
backward) against measured ones on the A100, and where the A100's ``attention_efficiency.unfused`` comes from.

Two kernel microbenchmarks (``benchmarks/microbench/``, see the README there), no training measurements:

* FlashAttention-2's figure 4 (A100 80GB SXM4): its ``Pytorch`` bars, the standard attention of the
  repository's ``benchmarks/benchmark_flash_attention.py`` (``torch.baddbmm`` into the scores, a causal
  mask added, ``torch.softmax``, dropout 0, ``torch.einsum`` with the values), forward and backward together,
  16k tokens a batch, hidden dimension 2048, head dimension 64 and 128, fp16;
* FlashAttention's appendix E.6, tables 9 to 20 (A100 40GB): the ``Megatron`` and ``PyTorch Attention`` rows,
  forward, backward and both, with and without dropout 0.1 and a padding mask, batch 16, 8 heads of dimension
  64, fp16.

The model prices the Megatron rows with the kernels planlab gives Megatron's attention
(:mod:`planlab.costmodel.kernels`; without the dropout kernels where the row has none) and the FA2 rows with
that benchmark's own kernels: the same GEMMs and softmax, the copies of its ``rearrange`` and ``einsum``
layouts, and the causal mask's addition (one pass over the scores, broadcasting a ``T x T`` mask). Both on the
built-in A100s (``a100-80g`` and ``a100-40g``) and the ``megatron`` software.

With ``--fit``: the grid of efficiency (0.005 apart) and per-tile overhead k (32 apart) for the core's batched
GEMMs that minimizes the mean absolute log ratio over the FA2 rows without the causal mask (its own figure's
kernels, measured on the A100 80GB; the causal rows add a broadcasting pass whose price is not the GEMMs'), the
value ``attention_efficiency.unfused`` of the A100s takes; every other row is a check.

    .venv/bin/python benchmarks/unfused_attention.py [--fit] [--rows]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

import numpy as np
import pandas as pd

from planlab.costmodel import CostModel
from planlab.costmodel.hardware import UNFUSED_ATTENTION, load_device
from planlab.costmodel.kernels import Kernel, op_kernels

MICROBENCH = Path(__file__).resolve().parent / "microbench"
FA2_PYTORCH = MICROBENCH / "a100-sxm4-80gb-flash2-pytorch-attention.csv"
FA1_TABLES = MICROBENCH / "a100-sxm4-40gb-flash1-paper-standard-attention.csv"
FA2_TOKENS, FA2_HIDDEN = 16 * 1024, 2048  # FlashAttention-2's benchmark: batch x sequence, heads x head dimension
FA1_BATCH, FA1_HEADS, FA1_HEAD_DIM = 16, 8, 64  # FlashAttention's appendix E.6 setup
ELEM_BYTES = 2  # fp16
EFF_GRID = np.arange(100, 1001, 5) / 1000
OVERHEAD_K_GRID = range(0, 513, 32)


def cost_on(device: str, unfused: tuple[float, int] | None | bool = True) -> CostModel:
    """The ``megatron`` cost model on built-in ``device``: with ``unfused`` True as built in, None without the
    device's ``attention_efficiency.unfused`` (the core's GEMMs at the GEMMs' own efficiency and tile overhead),
    or (efficiency, overhead k) in its place."""
    dev = load_device(device)
    if unfused is not True:
        kept = tuple(a for a in dev.gemm.attention_efficiency if a[0] != UNFUSED_ATTENTION)
        if unfused is not None:
            kept = (*kept, (UNFUSED_ATTENTION, unfused[0], unfused[0], unfused[1]))
        dev = dataclasses.replace(dev, gemm=dataclasses.replace(dev.gemm, attention_efficiency=kept))
    cost = CostModel.load("dgx-a100-80g", software="megatron")
    return dataclasses.replace(
        cost, cluster=dataclasses.replace(cost.cluster, node=dataclasses.replace(cost.cluster.node, device=dev))
    )


def megatron_kernels(phase: str, b: int, h: int, t: int, d: int, dropout: bool) -> tuple[Kernel, ...]:
    """The kernels planlab gives Megatron's attention core on ``b x h x t x d`` queries, keys and values in
    ``phase`` ("F" or "B"), without attention dropout's unless ``dropout``."""
    shapes = ((b, h, t, d),) * 4
    found = op_kernels("attention", phase, shapes, ELEM_BYTES, "megatron")
    return tuple(k for k in found.kernels if dropout or "dropout" not in k.name)


def pytorch_kernels(phase: str, b: int, h: int, t: int, d: int, causal: bool) -> tuple[Kernel, ...]:
    """FlashAttention-2's ``attention_pytorch`` (benchmarks/benchmark_flash_attention.py at 60499abc): Megatron's
    GEMMs over the scores, ``torch.softmax`` in fp16 (reading and writing the scores; backward reading the
    probabilities and their gradient, writing one), dropout 0 (no kernel), no context permute; the
    layout copies of its ``rearrange`` of q and k and of ``einsum``'s v (forward), of the output gradient and the
    gradients of q, k, v back into the packed qkv (backward), each reading and writing ``b t h d`` elements; and
    with ``causal`` the mask's addition, reading and writing the scores (its gradient passes through)."""
    n = b * t * h * d * ELEM_BYTES
    scores = b * h * t * t * ELEM_BYTES
    gemms = tuple(k for k in megatron_kernels(phase, b, h, t, d, False) if k.gemm is not None)
    if phase == "F":
        extra = [Kernel("layout-copy", bytes=2.0 * n) for _ in range(3)]
        if causal:
            extra.append(Kernel("causal-mask-add", bytes=2.0 * scores))
        return (*extra, *gemms, Kernel("softmax", bytes=2.0 * scores))
    return (
        *gemms,
        Kernel("softmax-bwd", bytes=3.0 * scores),
        *(Kernel("layout-copy", bytes=2.0 * n) for _ in range(5)),
    )


def seconds(cost: CostModel, kernels: tuple[Kernel, ...]) -> float:
    """The device time of ``kernels`` in fp16, launches included."""
    return sum(cost.kernel_time_s(k, "fp16") for k in kernels)


def fa2_rows() -> pd.DataFrame:
    """The FA2 figure's Pytorch bars with their measured milliseconds (flop as FlashAttention counts them: 3.5
    forwards, half under the causal mask)."""
    t = pd.read_csv(FA2_PYTORCH)
    flop = 3.5 * 4.0 * FA2_TOKENS * t["seq"] * FA2_HIDDEN * (1.0 - 0.5 * t["causal"])
    return t.assign(ms=flop / (t["tflops"] * 1e12) * 1e3)


def fa2_model_ms(cost: CostModel, r) -> float:
    b, h = FA2_TOKENS // int(r.seq), FA2_HIDDEN // int(r.head_dim)
    return 1e3 * sum(seconds(cost, pytorch_kernels(p, b, h, int(r.seq), int(r.head_dim), bool(r.causal))) for p in "FB")


def fa1_model_ms(cost: CostModel, r) -> float:
    phases = {"fwd": "F", "bwd": "B", "fwd_bwd": "FB"}[r.pass_]
    kernels = (megatron_kernels(p, FA1_BATCH, FA1_HEADS, int(r.seq), FA1_HEAD_DIM, bool(r.dropout)) for p in phases)
    return 1e3 * sum(seconds(cost, ks) for ks in kernels)


def fa1_rows() -> pd.DataFrame:
    """FlashAttention's appendix rows the model prices: sequences from 512 (below, the host's calls weigh in the
    measured time); Megatron's, and PyTorch's without the padding mask up to 4096 (its masking code is not
    Megatron's, and past 4096 Megatron's fused softmax is not available while PyTorch's runs)."""
    t = pd.read_csv(FA1_TABLES).rename(columns={"pass": "pass_"})
    kept = (t["seq"] >= 512) & ((t["impl"] == "megatron") | ((t["masking"] == 0) & (t["seq"] <= 4096)))
    return t[kept].reset_index(drop=True)


def report(label: str, rows: pd.DataFrame, model_ms, cost: CostModel, show_rows: bool) -> None:
    ratio = pd.Series([model_ms(cost, r) / r.ms for r in rows.itertuples()], index=rows.index)
    lr = np.log(ratio)
    print(
        f"  {label} ({len(rows)} rows): median model/measured {math.exp(lr.median()):.3f}, "
        f"mean |log ratio| {lr.abs().mean():.3f}"
    )
    if show_rows:
        for r, v in zip(rows.itertuples(), ratio):
            keys = {k: getattr(r, k) for k in rows.columns if k not in ("ms", "tflops")}
            print(f"    {keys}: measured {r.ms:.2f} ms, model {v * r.ms:.2f} ms ({v:.2f})")


def fit() -> tuple[float, int]:
    """The grid (efficiency, overhead k) minimizing the mean absolute log ratio over the FA2 rows without the mask."""
    rows = fa2_rows()
    rows = rows[rows["causal"] == 0]
    want = rows["ms"].to_numpy()
    best = (math.inf, 0.0, 0)
    for k0 in OVERHEAD_K_GRID:
        for eff in EFF_GRID:
            cost = cost_on("a100-80g", (float(eff), k0))
            model = np.array([fa2_model_ms(cost, r) for r in rows.itertuples()])
            err = float(np.abs(np.log(model / want)).mean())
            if err < best[0]:
                best = (err, float(eff), k0)
        print(f"  overhead k {k0:3d}: best so far efficiency {best[1]:.3f}, overhead k {best[2]}, |log| {best[0]:.4f}")
    return best[1], best[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", action="store_true", help="the grid the A100s' attention_efficiency.unfused comes from")
    ap.add_argument("--rows", action="store_true", help="print every row, measured against the model")
    args = ap.parse_args()
    variants: list[tuple[str, tuple[float, int] | None | bool]] = [
        ("as built in", True),
        ("without attention_efficiency.unfused (the GEMMs' own efficiency and tile overhead)", None),
    ]
    if args.fit:
        eff, k0 = fit()
        variants.append((f"grid best: efficiency {eff:.3f}, overhead k {k0}", (eff, k0)))
    fa1, fa2 = fa1_rows(), fa2_rows()
    for label, unfused in variants:
        c80, c40 = cost_on("a100-80g", unfused), cost_on("a100-40g", unfused)
        print(f"{label}:")
        report("FA2 Pytorch, A100 80GB, no mask", fa2[fa2["causal"] == 0], fa2_model_ms, c80, args.rows)
        report("FA2 Pytorch, A100 80GB, causal", fa2[fa2["causal"] == 1], fa2_model_ms, c80, args.rows)
        report("FA1 Megatron, A100 40GB", fa1[fa1["impl"] == "megatron"], fa1_model_ms, c40, args.rows)
        report(
            "FA1 PyTorch, no mask, A100 40GB (Megatron's kernels)",
            fa1[fa1["impl"] == "pytorch"],
            fa1_model_ms,
            c40,
            args.rows,
        )


if __name__ == "__main__":
    main()
