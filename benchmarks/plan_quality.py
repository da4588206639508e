"""Plan quality: composed spaces against the hand-made ones, on nnScaler's three workloads.

nnScaler (Lin et al., OSDI 2024) reports its wins on SwinV2 at large image sizes (coshard), on
GPT with a very large vocabulary (the interlaced pipeline) and on AlphaFold2 with recycling
(3F1B). For each of those workloads, on a cluster of nnScaler's sizes, this script explores

- the hand-made spaces: ``megatron`` (Megatron-LM's and DeepSpeed's whole grid: data x tensor x
  pipeline parallelism, ZeRO, sequence parallelism, schedules, recomputation), DeepSpeed-style
  ZeRO data parallelism (``dp*recompute`` with ZeRO 1 to 3) and the Alpa-style automatic search
  (``alpa``: per-operator splits by an integer program inside a dynamic program over stages);
- the composed spaces built from the primitives for that workload (``megatron*coshard`` for
  Swin, ``interlaced`` for the large-vocabulary GPT, ``3f1b``, ``3f1b*coshard`` and
  ``dp*recompute*coshard`` for the Evoformer).

The Evoformer workload is AlphaFold2's trunk (48 blocks) at N_seq = 128 MSA sequences and N_res = 256
residues, the first training shape of nnScaler's AlphaFold2 example (msrasys/nnscaler,
examples/alphafold2/README.md, "Evoformer Stack, s, r = 128, 256"; the ``alphafold2`` preset), with
R = 3 recycling passes (``recycles=3``: two without gradients, then one with, the "3F1B" of nnScaler's
paper); ``alphafold2-finetune`` (N_seq 512, N_res 384) is that README's largest training shape.
``evoformer-long`` takes it to N_res = 1024 residues, where one sample's block no longer fits a
GPU with data parallelism and full recomputation (92 GiB): the memory regime co-sharding is for
(``coshard_outputs=recompute`` remakes the co-sharded attentions inside each recomputed block).

The script prints the best simulated plan of each (iteration time, peak memory, knobs), then the
speedup of the best composed plan over the best hand-made one. Every figure is the simulator's
prediction with the cluster's specification (no GPU is used); a space that is not installed, or
whose every plan is out of memory, is reported as such.

Each space gets ``--budget`` seconds (900 by default): the Alpa-style search simulates some of the
43B GPT's plans for minutes each (pipelines of 2 stages of 8 devices), and the best plan simulated
by then counts, the line saying how many candidates the budget left.

Run: .venv/bin/python benchmarks/plan_quality.py [--jobs 2] [--only swin,gpt,evoformer] [--budget 900]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Run:
    """One space to explore for a workload: a label, the space expression and pinned knobs."""

    label: str
    space: str
    fixed: dict = field(default_factory=dict)
    composed: bool = False


@dataclass(frozen=True)
class Workload:
    """A model at one shape on one cluster, with the spaces to compare."""

    key: str
    title: str
    model: str
    model_args: tuple
    cluster: str
    nodes: int
    global_batch: int
    runs: tuple[Run, ...]


def _hand_made(zero_fixed: dict | None = None) -> tuple[Run, ...]:
    return (
        Run("megatron", "megatron"),
        Run("zero (deepspeed)", "dp*recompute", dict(zero_fixed or {})),
        Run("alpa", "alpa"),
    )


WORKLOADS = (
    Workload(
        "swin",
        "SwinV2-G, 1536x1536 images, 48x48 windows",
        "swin-g",
        (("image", 1536), ("window", 48)),
        "dgx-a100-40g",
        4,
        32,
        _hand_made() + (Run("megatron*coshard", "megatron*coshard", {"coshard_blocks": "attention"}, True),),
    ),
    Workload(
        "gpt",
        "GPT with a 256k vocabulary (48 x 8192, 43B parameters), Megatron-LM's vocabulary-parallel embedding and loss",
        "gpt",
        (("layers", 48), ("hidden", 8192), ("heads", 64), ("seq", 2048), ("vocab", 256000), ("vocab_parallel", 1)),
        "dgx-a100-80g",
        4,
        256,
        _hand_made() + (Run("interlaced", "interlaced", {}, True),),
    ),
    Workload(
        "evoformer",
        "AlphaFold2 Evoformer, 3 recycling passes",
        "alphafold2",
        (("recycles", 3),),
        "dgx-a100-80g",
        1,
        16,
        _hand_made()
        + (
            Run("3f1b", "3f1b", {}, True),
            Run("3f1b*coshard", "3f1b*coshard", {"coshard_blocks": "attention"}, True),
            Run("dp*coshard", "dp*recompute*coshard", {"coshard_blocks": "attention"}, True),
        ),
    ),
    Workload(
        "evoformer-long",
        "AlphaFold2 Evoformer at N_seq 512, N_res 1024, 3 recycling passes",
        "alphafold2-finetune",
        (("recycles", 3), ("n_res", 1024)),
        "dgx-a100-80g",
        1,
        16,
        _hand_made()
        + (Run("3f1b*coshard", "3f1b*coshard", {}, True), Run("dp*coshard", "dp*recompute*coshard", {}, True)),
    ),
)


def _best(df):
    ok = df[df["feasible"].astype(bool)]
    return None if ok.empty else ok.sort_values("iter_time_s").iloc[0]


def _knobs(row, names) -> str:
    out = []
    for k in names:
        if k in row.index and row[k] is not None and not (isinstance(row[k], float) and math.isnan(row[k])):
            out.append(f"{k}={row[k]}")
    return " ".join(out)


KNOBS = (
    "dp",
    "tp",
    "pp",
    "microbatch",
    "schedule",
    "virtual_stages",
    "zero",
    "sequence_parallel",
    "recompute",
    "coshard",
    "coshard_blocks",
    "coshard_outputs",
    "coshard_remade_percent",
    "embed_layout",
    "head_layout",
)


def run_workload(w: Workload, *, jobs: int, candidates: int | None, budget_s: float | None = None) -> dict:
    import planlab
    from planlab.errors import PlanlabError
    from planlab.explore import BUDGET_REASON
    from planlab.models import ModelSpec

    spec = ModelSpec(w.model, w.model_args)
    print(f"\n== {w.title}: {w.nodes} x {w.cluster}, global batch {w.global_batch}", flush=True)
    best: dict[str, tuple] = {}
    for r in w.runs:
        t0 = time.perf_counter()
        try:
            df = planlab.explore(
                spec,
                cluster=w.cluster,
                nodes=w.nodes,
                space=r.space,
                fixed=r.fixed,
                global_batch=w.global_batch,
                jobs=jobs,
                candidates=candidates,
                budget=budget_s,
            )
        except PlanlabError as e:
            print(f"  {r.label:<18} not explored: {e}", flush=True)
            continue
        row = _best(df)
        took = time.perf_counter() - t0
        n_sim = f"{int(df['simulated'].sum()) if 'simulated' in df else len(df)} simulated"
        cut = int(df["reason"].astype(str).str.startswith(BUDGET_REASON).sum()) if "reason" in df else 0
        if cut:  # the budget stopped the simulations: the best of those simulated (the screen's fastest first)
            n_sim += f", {cut} candidates left by the {budget_s:.0f} s budget"
        if row is None:
            print(f"  {r.label:<18} {len(df)} plans ({n_sim}, {took:.0f} s): none fits", flush=True)
            continue
        best[r.label] = (row, r.composed)
        print(
            f"  {r.label:<18} {len(df)} plans ({n_sim}, {took:.0f} s): {row['iter_time_s']:.3f} s, "
            f"{row['peak_mem_gib']:.1f} GiB  {_knobs(row, KNOBS)}",
            flush=True,
        )
    hand = [(row["iter_time_s"], k) for k, (row, c) in best.items() if not c]
    comp = [(row["iter_time_s"], k) for k, (row, c) in best.items() if c]
    result = {"workload": w.key, "hand": min(hand) if hand else None, "composed": min(comp) if comp else None}
    if hand and comp:
        (th, kh), (tc, kc) = min(hand), min(comp)
        print(f"  best hand-made: {kh} {th:.3f} s; best composed: {kc} {tc:.3f} s; speedup {th / tc:.2f}x", flush=True)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--only", default="", help="comma-separated workloads: " + ",".join(w.key for w in WORKLOADS))
    ap.add_argument("--candidates", type=int, default=32, help="plans simulated per space beyond the screen's front")
    ap.add_argument(
        "--budget",
        type=float,
        default=900.0,
        help="seconds per space (planlab.explore's budget): the simulations stop there and the best so "
        "far counts, the line saying how many candidates were left (0: no budget)",
    )
    a = ap.parse_args()
    keys = [k for k in a.only.split(",") if k] or [w.key for w in WORKLOADS]
    unknown = set(keys) - {w.key for w in WORKLOADS}
    if unknown:
        print(f"unknown workload(s) {sorted(unknown)}; expected some of {[w.key for w in WORKLOADS]}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    results = [
        run_workload(w, jobs=a.jobs, candidates=a.candidates, budget_s=a.budget or None)
        for w in WORKLOADS
        if w.key in keys
    ]
    print(f"\n{'workload':<10} {'best hand-made':>24} {'best composed':>24} {'speedup':>8}")
    for r in results:
        h, c = r["hand"], r["composed"]
        hs = f"{h[1]} {h[0]:.3f} s" if h else "none fits"
        cs = f"{c[1]} {c[0]:.3f} s" if c else "none fits"
        sp = f"{h[0] / c[0]:.2f}x" if h and c else "-"
        print(f"{r['workload']:<10} {hs:>24} {cs:>24} {sp:>8}")
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
