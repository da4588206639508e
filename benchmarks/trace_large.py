"""Trace time and peak memory of the largest presets on meta tensors, each in a fresh process.

Targets (issue 3): under 30 s and under 2 GiB of peak resident memory per model on this
machine. Prints one line per model; asserts nothing.
Run: .venv/bin/python benchmarks/trace_large.py [MODEL ...] [--batch N]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

MODELS = ("gpt3-175b", "llama3-405b")

_CHILD = r"""
import json, resource, sys, time, warnings
t0 = time.perf_counter()
from planlab.graph import trace
from planlab.models import ModelSpec, build_model
t1 = time.perf_counter()
spec = ModelSpec(sys.argv[1])
model, inputs = build_model(spec, batch=int(sys.argv[2]))
t2 = time.perf_counter()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    g = trace(model, inputs)
t3 = time.perf_counter()
print(json.dumps(dict(import_s=t1 - t0, build_s=t2 - t1, trace_s=t3 - t2, ops=len(g.operators),
                      params=g.num_params, unknown=list(g.unknown),
                      peak_rss_kib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)))
"""


def measure(model: str, batch: int) -> dict:
    """Build and trace ``model`` in a fresh interpreter; its timings and peak RSS (ru_maxrss, KiB on Linux)."""
    out = subprocess.run([sys.executable, "-c", _CHILD, model, str(batch)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="*", default=list(MODELS))
    p.add_argument("--batch", type=int, default=8, help="global batch of the example inputs")
    args = p.parse_args()
    for m in args.models:
        r = measure(m, args.batch)
        rss_gib = r["peak_rss_kib"] / 2**20
        print(
            f"{m:12s} trace {r['trace_s']:6.2f} s (build {r['build_s']:.2f} s, import {r['import_s']:.2f} s), "
            f"peak RSS {rss_gib:.2f} GiB, {r['ops']} operators, {r['params'] / 1e9:.2f}B parameters"
            f"{', kept whole: ' + ', '.join(r['unknown']) if r['unknown'] else ''}  "
            f"[targets: < 30 s: {'met' if r['build_s'] + r['trace_s'] < 30 else 'MISSED'}, "
            f"< 2 GiB: {'met' if rss_gib < 2 else 'MISSED'}]"
        )


if __name__ == "__main__":
    main()
