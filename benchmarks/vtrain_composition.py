"""How vTrain's measured iteration times hang together, from the times alone (no simulation).

Independent end-to-end measurements of one configuration at several global batches scatter around
a straight line in the number of micro-batches by at least the run-to-run noise of a GPU (tenths of a
percent); so do the per-step costs of one configuration run at several data-parallel degrees, and the
per-step costs of models that differ only in their number of layers. A set assembled from parts (a
per-step time times the number of steps, plus a fixed time) lies on those lines exactly. This script
prints, per set:

1. per configuration (hidden, layers, tp, dp, pp, micro-batch) measured at three or more global
   batches, the largest distance of its times from the least-squares line in the number of
   micro-batches ``m``;
2. the per-step cost (that line's slope) over the data-parallel degrees of one configuration: its
   largest spread;
3. the per-step cost over the layer counts of one (hidden, tp, pp, micro-batch): its largest distance
   from a line in layers;
4. with ``--lut DIR`` (vTrain's ``trace/a100`` folder of all-reduce tables, ``AR_GPU{n}_1M_1024M_LUT``):
   the line's intercept less the all-reduce time that table gives for the fp16 weights of vTrain's own
   model on the first pipeline stage (``ParamInfo`` lists of vTrain's ``src/predictor.py``: a
   vocabulary of 50,257 split over tp without padding, learned positions, per layer two layer norms
   with bias, the QKV, projection and two MLP weights with biases, and an untied output layer on the
   last stage): its largest spread over the data-parallel degrees of one configuration.

    .venv/bin/python benchmarks/vtrain_composition.py [--ref DIR] [--lut DIR]
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pandas as pd

from validate_vtrain import _reference

from planlab.validation import GPT2_VOCAB, MeasuredRun, load_runs

CONFIG = ["hidden", "layers", "tp", "dp", "pp", "micro_batch"]


def runs_frame(runs: list[MeasuredRun]) -> pd.DataFrame:
    """The runs as a frame with their number of micro-batches ``m`` and the measured time in ms."""
    df = pd.DataFrame([asdict(r) for r in runs])
    return df.assign(m=df["global_batch"] // (df["dp"] * df["micro_batch"]), measured_ms=df["measured_s"] * 1e3)


def lines(df: pd.DataFrame, column: str = "measured_ms") -> pd.DataFrame:
    """Per configuration at two or more ``m``: the least-squares ``column = intercept + m x slope``
    (ms) and, at three or more, the largest distance of its points from that line (``residual_ms``)."""
    rows = []
    for key, g in df.groupby(CONFIG):
        if g["m"].nunique() < 2:
            continue
        slope, intercept = np.polyfit(g["m"], g[column], 1)
        resid = (g[column] - (intercept + slope * g["m"])).abs().max() if g["m"].nunique() > 2 else np.nan
        rows.append(dict(zip(CONFIG, key)) | dict(intercept_ms=intercept, slope_ms=slope, residual_ms=resid))
    return pd.DataFrame(rows)


def spread(fits: pd.DataFrame, over: str, value: str) -> pd.Series:
    """Per group of ``fits`` that differs only in ``over`` (two or more values): max - min of ``value``."""
    keys = [c for c in CONFIG if c != over]
    g = fits.groupby(keys)
    sizes = g[over].nunique()
    return (g[value].max() - g[value].min())[sizes > 1]


def layer_line_distance(fits: pd.DataFrame) -> pd.Series:
    """Per (hidden, tp, dp, pp, micro-batch) at three or more layer counts: the largest distance of the
    per-step cost from its least-squares line in the number of layers (ms)."""
    out = {}
    for key, g in fits.groupby([c for c in CONFIG if c != "layers"]):
        if g["layers"].nunique() < 3:
            continue
        a, b = np.polyfit(g["layers"], g["slope_ms"], 1)
        out[key] = (g["slope_ms"] - (a * g["layers"] + b)).abs().max()
    return pd.Series(out, dtype=float)


def vtrain_stage_bytes(hidden: int, layers: int, tp: int, pp: int, seq: int, vocab: int = GPT2_VOCAB) -> int:
    """fp16 bytes of the weights of vTrain's model on the first pipeline stage (``--lut``'s message):
    embeddings, ``layers / pp`` layers, and the output layer when there is one stage."""
    h, per_tp = hidden, hidden // tp
    attention = 3 * h * per_tp + 3 * h // tp + h * per_tp + h  # QKV and projection, weights and biases
    mlp = h * (4 * h // tp) + 4 * h // tp + 4 * h * per_tp + h
    layer = 2 * h + attention + 2 * h + mlp  # two layer norms, weight and bias each
    embed = (vocab // tp) * h + seq * h
    output = (vocab // tp) * h if pp == 1 else 0
    return 2 * (embed + layers // pp * layer + output)


def read_lut(folder: Path, ranks: int) -> dict[int, tuple[float, float]]:
    """vTrain's all-reduce table over ``ranks`` GPUs: MiB -> (in-place time in ms, in-place bus GB/s),
    the last two columns of ``AR_GPU{ranks}_1M_1024M_LUT`` (nccl-tests' output, one row per MiB)."""
    path = folder / f"AR_GPU{ranks}_1M_1024M_LUT"
    table = {}
    try:
        with path.open() as fh:
            next(fh, None)
            for line in fh:
                cells = line.strip().split(",")
                table[int(cells[0]) // 2**20] = (int(cells[-2]) / 1e6, float(cells[-1]))
    except OSError as e:
        raise SystemExit(f"--lut: cannot read {str(path)!r} ({e.strerror}); expected vTrain's trace/a100 folder")
    except (ValueError, IndexError):
        raise SystemExit(f"--lut: {str(path)!r} line {len(table) + 2} is not 'bytes,...,time(ns),busbw' as vTrain's")
    if not table:
        raise SystemExit(f"--lut: {str(path)!r} has no rows; expected vTrain's all-reduce table")
    return table


def lut_allreduce_ms(tables: dict[int, dict], nbytes: int, ranks: int) -> float:
    """The time vTrain's tables give an all-reduce of ``nbytes`` over ``ranks`` GPUs: the row of the
    size rounded to MiB, or past the largest row (1 GiB) that size at the largest row's bus bandwidth."""
    if ranks == 1:
        return 0.0
    mib = round(nbytes / 2**20)
    table = tables[ranks]
    if mib in table:
        return table[mib][0]
    return mib / (table[max(table)][1] * 1024) * 1e3


def report(df: pd.DataFrame, name: str, lut: Path | None) -> None:
    fits = lines(df)
    print(f"{name}: {len(df)} runs")
    if fits.empty:
        print("  no configuration measured at two or more global batches")
        return
    three = fits["residual_ms"].dropna()
    print(
        f"  {len(fits)} configurations at two or more global batches, {len(three)} at three or more: their times' "
        f"largest distance from a line in the number of micro-batches {three.max():.2e} ms "
        f"(the times {df['measured_ms'].min():.0f}-{df['measured_ms'].max():.0f} ms)"
    )
    dp = spread(fits, "dp", "slope_ms")
    if len(dp):
        print(f"  per-step cost over dp ({len(dp)} configurations at two or more dp): largest spread {dp.max():.2e} ms")
    lay = layer_line_distance(fits)
    if len(lay):
        print(
            f"  per-step cost over layers ({len(lay)} configurations at three or more layer counts): "
            f"largest distance from a line in layers {lay.max():.2e} ms"
        )
    if lut is not None:
        tables = {n: read_lut(lut, n) for n in sorted(set(df["dp"])) if n > 1}
        seq = int(df["seq"].iloc[0])
        fits["allreduce_ms"] = [
            lut_allreduce_ms(tables, vtrain_stage_bytes(r.hidden, r.layers, r.tp, r.pp, seq), r.dp)
            for r in fits.itertuples()
        ]
        fits["rest_ms"] = fits["intercept_ms"] - fits["allreduce_ms"]
        rest = spread(fits, "dp", "rest_ms")
        raw = spread(fits, "dp", "intercept_ms")
        print(
            f"  intercept over dp ({len(rest)} configurations): largest spread {raw.max():.3f} ms; less vTrain's "
            f"table's all-reduce of its fp16 weights: {rest.max():.2e} ms"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", default=str(_reference()), help="the folder of vtrain_ground_truth_*.csv")
    ap.add_argument("--lut", default=None, help="vTrain's trace/a100 folder of all-reduce tables (optional)")
    args = ap.parse_args()
    for kind in ("single", "multi"):
        runs = load_runs(Path(args.ref) / f"vtrain_ground_truth_{kind}.csv")
        report(runs_frame(runs), f"{kind}-node", Path(args.lut) if args.lut and kind == "single" else None)


if __name__ == "__main__":
    main()
