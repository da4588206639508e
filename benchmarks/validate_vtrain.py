"""Predicted against measured iteration time on vTrain's 1,549 measured runs.

Prints, for the single-node and the multi-node sets, the mean absolute percentage error (MAPE)
of planlab's prediction next to vTrain's own published MAPE (8.37% and 14.73%), and the worst
runs. By default every 10th single-node run and every multi-node run; --all for every run,
--every N and --multi-every M for other subsets (M = 0 skips the multi-node set).

    .venv/bin/python benchmarks/validate_vtrain.py [--all] [--every 10] [--multi-every 1] [--jobs 2] [--csv out.csv]
"""

import argparse
import time
from pathlib import Path

from planlab.costmodel import load_cluster
from planlab.validation import load_runs, mape, rank_correlation, validate

REF = Path(__file__).resolve().parents[1].parent / "shared" / "reference"
SPEC = str(Path(__file__).with_name("specs") / "vtrain-a100-eager.json")  # vtrain-a100.json + eager PyTorch's host time per operator
VTRAIN_MAPE = {"single": 8.37, "multi": 14.73}  # vTrain (MICRO 2024), reference README


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--all", action="store_true", help="every single-node run, not every 10th")
    ap.add_argument("--every", type=int, default=10, help="every N-th single-node run (default 10)")
    ap.add_argument("--multi-every", type=int, default=1, help="every M-th multi-node run (0: none)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--csv", default=None)
    ap.add_argument("--ref", default=str(REF))
    ap.add_argument("--spec", default=SPEC, help="cluster spec (default: the reference's stated machines)")
    args = ap.parse_args()
    frames = []
    for kind in ("single", "multi"):
        runs = load_runs(Path(args.ref) / f"vtrain_ground_truth_{kind}.csv")
        step = 1 if args.all else args.every if kind == "single" else args.multi_every
        if step <= 0:
            continue
        runs = runs[::step]
        per_node = load_cluster(args.spec).node.devices_per_node
        wide = [r for r in runs if r.tp > per_node]  # the megatron space keeps tensor parallelism in a node
        runs = [r for r in runs if r.tp <= per_node]
        if wide:
            print(f"{kind}-node: skipping {len(wide)} runs with tensor parallelism over {per_node} (across nodes)")
        t = time.perf_counter()
        df = validate(runs, args.spec, jobs=args.jobs)
        df["set"] = kind
        frames.append(df)
        print(f"{kind}-node: {len(df)} runs in {time.perf_counter() - t:.0f} s; planlab MAPE {mape(df):.2f}% "
              f"(vTrain's own: {VTRAIN_MAPE[kind]}%); mean signed error {df['error'].mean() * 100:+.1f}%; "
              f"Kendall tau within model sizes {rank_correlation(df):.3f}")
        worst = df.reindex(df["error"].abs().sort_values(ascending=False).index).head(5)
        print(worst[["gpus", "hidden", "layers", "global_batch", "micro_batch", "tp", "dp", "pp", "measured_s",
                     "predicted_s", "error"]].to_string(index=False))
    if args.csv:
        import pandas as pd

        pd.concat(frames).to_csv(args.csv, index=False)


if __name__ == "__main__":
    main()
