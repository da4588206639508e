"""Fit the vTrain cluster's software overheads on half of vTrain's single-node runs, test on the rest.

Two parameters of the device are fitted: a factor on the time of every kernel (the efficiency
the software reaches) and the fixed cost per operator (launch and framework overhead). Kernel
efficiencies stay at most 1. The fit linearises the simulator around the base spec (three simulations per training run), searches
the two parameters for the least mean absolute percentage error, writes
``benchmarks/specs/vtrain-a100-fitted.json``, then simulates the held-out runs (and the
multi-node set, which the fit never sees) with it.

    .venv/bin/python benchmarks/fit_vtrain.py [--jobs 2]
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from planlab.validation import load_runs, mape, validate

HERE = Path(__file__).resolve().parent
REF = HERE.parents[0].parent / "shared" / "reference"
BASE = HERE / "specs" / "vtrain-a100.json"
OUT = HERE / "specs" / "vtrain-a100-fitted.json"
DEVICES = HERE.parent / "planlab" / "costmodel" / "specs" / "devices.json"
STEP_US = 20.0


def spec_with(scale: float, overhead_us: float, path: Path) -> Path:
    """The base node spec with its device inline: kernel efficiencies divided by ``scale``."""
    node = json.loads(BASE.read_text())
    dev = dict(json.loads(DEVICES.read_text())[node["device"]])
    dev["name"] = node["device"] + "-fitted"
    for key in ("compute_efficiency", "memory_efficiency"):
        dev[key] = dict(dev[key], max=min(1.0, dev[key]["max"] / scale))
    dev["launch_overhead_us"] = overhead_us
    dev["source"] = dict(dev.get("source", {}), fitted=f"benchmarks/fit_vtrain.py: time factor {scale:.3f}, "
                         f"{overhead_us:.1f} us per operator, on every 10th of vTrain's single-node runs")
    node["device"] = dev
    node["name"] = node["name"] + "-fitted"
    path.write_text(json.dumps(node, indent=1))
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    runs = load_runs(REF / "vtrain_ground_truth_single.csv")
    train, test = runs[0::10], runs[5::10]
    base_us = json.loads(DEVICES.read_text())["a100-40g"]["launch_overhead_us"]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base = validate(train, str(spec_with(1.0, base_us, tmp / "a.json")), jobs=args.jobs)
        slow = validate(train, str(spec_with(2.0, base_us, tmp / "b.json")), jobs=args.jobs)
        over = validate(train, str(spec_with(1.0, base_us + STEP_US, tmp / "c.json")), jobs=args.jobs)
    key = ["gpus", "global_batch", "micro_batch", "hidden", "layers", "tp", "dp", "pp"]
    base, slow, over = (d.sort_values(key).reset_index(drop=True) for d in (base, slow, over))
    t, m = base["predicted_s"].to_numpy(), base["measured_s"].to_numpy()
    ds, dl = slow["predicted_s"].to_numpy() - t, (over["predicted_s"].to_numpy() - t) / STEP_US
    best = (np.inf, 1.0, base_us)
    lowest = json.loads(DEVICES.read_text())["a100-40g"]["compute_efficiency"]["max"]  # efficiency stays <= 1
    for s in np.arange(lowest, 3.0, 0.01):
        for us in np.arange(0.0, 200.0, 0.5):
            pred = t + (s - 1.0) * ds + (us - base_us) * dl
            err = float(np.mean(np.abs(pred / m - 1.0)))
            if err < best[0]:
                best = (err, float(s), float(us))
    print(f"fit on {len(train)} single-node runs ({time.perf_counter() - t0:.0f} s): time factor {best[1]:.2f}, "
          f"{best[2]:.1f} us per operator; linearised training MAPE {best[0] * 100:.2f}% "
          f"(before: {mape(base):.2f}%)")
    spec_with(best[1], best[2], OUT)
    print(f"wrote {OUT.relative_to(HERE.parent)}")
    for name, rs in (("held-out single-node", test), ("multi-node (not fitted)", load_runs(REF / "vtrain_ground_truth_multi.csv"))):
        df = validate(rs, str(OUT), jobs=args.jobs)
        print(f"{name}: {len(df)} runs, MAPE {mape(df):.2f}%, mean signed error {df['error'].mean() * 100:+.1f}% "
              f"(vTrain's own: 8.37% single, 14.73% multi)")


if __name__ == "__main__":
    main()
