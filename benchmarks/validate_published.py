"""Predicted against published training throughput: the sets of ``benchmarks/data/``.

Each set (``benchmarks/data/NAME.json`` + ``NAME.csv``, see ``benchmarks/data/README.md``) is a
table of measured runs from one paper or page. Every row planlab can express is predicted as a
user would: the built-in cluster the run stated, the model as ``--model``/``--model-arg``, the
plan as the ``megatron`` space's knobs (``planlab explore --space megatron --set ...``), and the
training software where planlab takes it (:mod:`planlab.published_report`). Prints per set: the
mean absolute percentage error (MAPE) of the rows whose plan fits, the mean signed error, the worst
row (signed), Kendall's tau of per-GPU throughput within model sizes (and across all rows), the
order of the strategy families (tensor x pipeline, ZeRO-3 data parallelism, plain data
parallelism) where one model on one GPU count was measured with several, the rows whose plan does
not fit in predicted memory (with their time simulated anyway), and the rows skipped with why.

    .venv/bin/python benchmarks/validate_published.py [--set NAME ...] [--jobs 2] [--csv out.csv] [--rows]
"""

import argparse
import math
import time
from pathlib import Path

import pandas as pd

from planlab.published import load_sets
from planlab.published_report import predict_sets, software_input, summarize

DATA = Path(__file__).resolve().parent / "data"


def _pct(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:+.1f}%"


def report(name: str, title: str, df: pd.DataFrame, show_rows: bool) -> None:
    s = summarize(df)
    print(f"\n== {name}: {title}")
    print(
        f"   {s['rows']} rows: {s['runnable']} predicted, {s['skipped']} skipped; "
        f"{s['fit']} of {s['runnable']} fit in predicted memory"
    )
    if "mape" in s:
        print(
            f"   MAPE {s['mape']:.1f}% (rows that fit, n={s['fit']}); mean signed error {_pct(s['signed'])}; "
            f"worst {s['worst'][0]} {_pct(s['worst'][1])}"
        )
    if "mape_all" in s and s["n_all"] != s["fit"]:
        print(
            f"   with the rows that do not fit (their time simulated anyway): MAPE {s['mape_all']:.1f}%, "
            f"signed {_pct(s['signed_all'])} (n={s['n_all']})"
        )
    tau = "n/a (no model size with two rows that fit)" if not s["tau_groups"] else f"{s['tau']:.3f}"
    print(f"   Kendall tau within model sizes: {tau}; across all rows (FLOP/s per GPU): {s['tau_all']:.3f}")
    for f in s["families"]:
        print(
            f"   family order {f['model']} on {f['gpus']} GPUs: measured {' > '.join(f['measured'])} "
            f"({f['measured_ratio']:.2f}x), predicted {' > '.join(f['predicted'])} ({f['predicted_ratio']:.2f}x): "
            f"{'preserved' if f['preserved'] else 'NOT preserved'}"
        )
    if not s["families"]:
        print("   family order: no model measured with two families on one GPU count")
    for row, peak, dev, why in s["unfit"]:
        print(f"   does not fit: {row}: {why}")
    for row, why in s["failed"]:
        print(f"   refused by planlab: {row}: {why}")
    skipped = df[df["skip_reason"] != ""]
    for _, r in skipped.iterrows():
        print(f"   skipped: {r['row']}: {r['skip_reason']}")
    if show_rows:
        cols = ["row", "family", "gpus", "measured_s", "predicted_s", "error", "unfit_time_s", "peak_mem_gib"]
        run = df[df["skip_reason"] == ""][cols]
        print(run.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
        for _, r in df[df["skip_reason"] == ""].iterrows():
            print(f"   {r['row']}: {r['command']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--set", action="append", default=None, metavar="NAME", help="a set of benchmarks/data (repeatable)"
    )
    ap.add_argument("--jobs", type=int, default=2, help="rows predicted in parallel")
    ap.add_argument("--csv", default=None, metavar="OUT", help="write every row with its prediction there")
    ap.add_argument("--rows", action="store_true", help="print every predicted row and its planlab explore command")
    ap.add_argument("--data", default=str(DATA), help="the folder of the sets")
    args = ap.parse_args()
    sets = load_sets(args.data, args.set)
    print(
        f"{len(sets)} sets, {sum(len(s.rows) for s in sets)} rows; training software as an input: "
        f"{'yes (each row passes its own)' if software_input() else 'no (this planlab has no software input yet)'}"
    )
    t0 = time.perf_counter()
    df = predict_sets(sets, jobs=args.jobs)
    for s in sets:
        report(s.name, s.title, df[df["set"] == s.name], args.rows)
    if args.csv:
        df.to_csv(args.csv, index=False)
    print(
        f"\n({len(df[df['skip_reason'] == ''])} rows predicted in {time.perf_counter() - t0:.0f} s, {args.jobs} jobs)"
    )


if __name__ == "__main__":
    main()
