"""nnScaler's evaluation (Lin et al., OSDI 2024) in simulation: its eleven workloads on DGX-2 V100 nodes.

The workloads are the ``nnscaler-*`` presets (planlab/models/nnscaler.py): Swin and T5 on 4, 8, 16 and
32 GPUs with the shapes of the artifact's scripts (microsoft/nnscaler, branch osdi24ae,
cupilot/evaluation/{swin,t5}_{4,8,16,32}gpus.sh), and AlphaFold2's Evoformer at three shapes with two
recycling passes. Every run: global batch 256, micro-batch 1 (``--mbs 1 --gbs 256`` in every script).

Per workload the script explores, with ``planlab.explore`` as a user calls it:

(a) the paper's baselines as the artifact configures them:
    - ``alpa``: the ``alpa`` space (per-operator splits by an integer program) restricted to one
      stage (``--policy alpa --max-pp 1``), with full recomputation (``--recompute``):
      ``alpa*recompute`` with ``pp=1, recompute=full``;
    - ``deepspeed``: tensor parallelism with ZeRO-3, CPU offload and recomputed blocks (train_ds.py:
      ``--tp T --offload cpu`` sets ``zero_optimization.stage`` 3 with ``offload_optimizer.device``
      and ``offload_param.device`` ``cpu``, fp16, ``overlap_comm`` false, ``deepspeed.checkpointing``
      per block), priced with the ``deepspeed`` software: ``dp*tp*recompute*offload`` with ``zero=3,
      recompute=full, offload_optimizer=True`` and the script's ``tp`` (Swin: 2, 4, 4, 8). The
      artifact runs DeepSpeed only for Swin; for T5 and the Evoformer ``tp`` is explored (T5's own
      ``cupilot/examples/t5/train_ds.py``, which no script runs, also fixes stage 3 and checkpoints
      every layer; its ``--offload-opt`` defaults to none, but no ZeRO-3 plan of T5 fits from 8 GPUs
      without it, so the optimizer is offloaded there too). The
      optimizer's offload (ZeRO-Offload: states and Adam on the host, gradients and weights over
      PCIe) is priced; the parameters' offload (``offload_param``: ZeRO-3's shards fetched from host
      memory before each gather) is not, so this baseline is faster than the artifact's run and
      keeps the weight shards in device memory. The 16- and 32-GPU Swin scripts run alpa and
      DeepSpeed at ``GBS=16``; every run here takes global batch 256, which spreads the baselines'
      once-an-iteration costs (optimizer step, gradient reduction) over 16 times the samples;
    - ``megatron``: the ``megatron`` space with full recomputation; for T5 on 4 GPUs the script fixes
      ``--policy megatron --max-pp 2`` (pp 2, tp = 4 / 2); elsewhere the artifact does not run it and
      the grid's data, tensor and pipeline degrees are explored;
(b) ``grid``: planlab's full Megatron grid (``megatron``: every knob but the micro-batch explored);
(c) the composed spaces of the workload: co-sharding for Swin (``dp*tp*recompute*coshard`` and, in
    product with the grid, ``megatron*coshard``), the interlaced pipeline for T5 (``interlaced``, which
    already carries the grid's data, tensor, ZeRO and recomputation knobs; and, with the optimizer
    offloaded as the DeepSpeed baseline does, ``interlaced*offload`` and ``megatron*offload``: from 8
    GPUs on no plan of the grid fits T5's states without it), 3F1B and co-sharding for
    the Evoformer (``3f1b``, ``3f1b*coshard``, ``dp*tp*recompute*coshard``, ``megatron*coshard``).

It prints, per workload, each space's best simulated plan (knobs, iteration time, peak memory) and
its speedup over each baseline and over the grid. The paper's per-workload speedups are not quoted:
the artifact has no results, and the paper's figures were not found in a source we could cite (its
abstract's "up to 3.5x" over DeepSpeed, Megatron-LM and Alpa is the only figure, issue 18).

The 4- and 8-GPU runs use part of a DGX-2 (the artifact runs them on one server with
``--nproc_per_node=4`` / ``8``): planlab's ``dgx-2-v100`` has 16 GPUs a node, so the script writes a
spec file that is the built-in one with ``devices_per_node`` 4 or 8 (``--specs``), as a user would.
Every figure is the simulator's prediction with the cluster's specification (no GPU is used).

The workloads run in the order given (all: by GPU count), each line printed as its space finishes.

Run: .venv/bin/python benchmarks/nnscaler_eval.py [--workloads swin-4,t5-4,...] [--jobs 2] [--out DIR]
A plan is simulated once per workload: the spaces share one ``planlab.memo.SimulationMemo`` (``explore``'s
``memo=``), so the ``megatron`` baseline's plans, which are the grid's, and a product space's plans that
its factors simulated take the rows simulated first (``--no-reuse``: simulate them again; no row changes).
(``--candidates N``: simulate N plans per space, ``planlab explore --candidates``; default explore's own,
a smaller N is a partial measurement and the table says so.)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path

GLOBAL_BATCH = 256
MICROBATCH = 1
BASELINES = ("alpa", "deepspeed", "megatron")


@dataclass(frozen=True)
class Run:
    """One space to explore: its label, the space expression, pinned knobs and the software."""

    label: str
    space: str
    fixed: dict = field(default_factory=dict)
    kind: str = "composed"  # baseline, grid or composed
    software: str | None = None


@dataclass(frozen=True)
class Workload:
    """One of the eleven: a short key, the preset, the GPU count and the spaces to explore."""

    key: str
    preset: str
    gpus: int
    runs: tuple[Run, ...]


def _baselines(ds_tp: int | None = None, megatron: dict | None = None) -> tuple[Run, ...]:
    full = {"recompute": "full"}
    ds = {"zero": 3, **full, "offload_optimizer": True, **({"tp": ds_tp} if ds_tp else {})}
    return (
        Run("alpa", "alpa*recompute", {"pp": 1, **full}, "baseline"),
        Run("deepspeed", "dp*tp*recompute*offload", ds, "baseline", "deepspeed"),
        Run("megatron", "megatron", {**full, **(megatron or {})}, "baseline"),
        Run("grid", "megatron", {}, "grid"),
    )


SWIN_COMPOSED = (Run("coshard", "dp*tp*recompute*coshard"), Run("grid*coshard", "megatron*coshard"))
# with the optimizer offloaded to host memory as well (ZeRO-Offload, as the DeepSpeed baseline): from 8 GPUs
# on, T5's weights, gradients and Adam states do not fit a 32 GB V100 in any plan of the grid without it
T5_COMPOSED = (
    Run("interlaced", "interlaced"),
    Run("interlaced*offload", "interlaced*offload"),
    Run("grid*offload", "megatron*offload"),
)
EVOFORMER_COMPOSED = (
    Run("3f1b", "3f1b"),
    Run("3f1b*coshard", "3f1b*coshard"),
    Run("coshard", "dp*tp*recompute*coshard"),
    Run("grid*coshard", "megatron*coshard"),
)
# DeepSpeed's --tp of cupilot/evaluation/swin_{4,8,16,32}gpus.sh
SWIN_DS_TP = {4: 2, 8: 4, 16: 4, 32: 8}
WORKLOADS = (
    *(
        Workload(f"swin-{n}", f"nnscaler-swin-{n}gpu", n, _baselines(SWIN_DS_TP[n]) + SWIN_COMPOSED)
        for n in (4, 8, 16, 32)
    ),
    Workload("t5-4", "nnscaler-t5-4gpu", 4, _baselines(megatron={"pp": 2, "tp": 2, "dp": 1}) + T5_COMPOSED),
    *(Workload(f"t5-{n}", f"nnscaler-t5-{n}gpu", n, _baselines() + T5_COMPOSED) for n in (8, 16, 32)),
    *(
        Workload(f"evoformer-{s}", f"nnscaler-evoformer-{s}", n, _baselines() + EVOFORMER_COMPOSED)
        for s, n in (("128x256", 4), ("512x256", 8), ("512x384", 16))
    ),
)

LABELS = tuple(dict.fromkeys(r.label for w in WORKLOADS for r in w.runs))


def cluster_for(gpus: int, folder: Path) -> tuple[str, int]:
    """The cluster (a built-in name or a spec file written to ``folder``) and node count for ``gpus``
    V100s: whole DGX-2 nodes of 16, or the part of one node the 4- and 8-GPU runs use."""
    if gpus % 16 == 0:
        return "dgx-2-v100", gpus // 16
    spec = json.loads((files("planlab.costmodel") / "specs" / "dgx-2-v100.json").read_text())
    spec["name"] = f"dgx-2-v100-{gpus}gpu"
    spec["description"] = f"{gpus} of a DGX-2's 16 V100 SXM3 32GB, NVLink 2 through NVSwitch"
    spec["devices_per_node"] = gpus
    spec["source"]["devices_per_node"] = (
        f"{gpus} GPUs of one DGX-2 (nnScaler's {gpus}-GPU runs: torchrun --nproc_per_node={gpus} on one server); "
        "each keeps its NVSwitch port"
    )
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"dgx-2-v100-{gpus}gpu.json"
    path.write_text(json.dumps(spec, indent=2) + "\n")
    return os.fspath(path), 1


def knob_names(space: str) -> list[str]:
    """The knobs of a space expression, in the space's order."""
    from planlab.search_spaces import get_space

    return list(dict.fromkeys(k.name for k in get_space(space).all_knobs()))


def describe(row, names: list[str]) -> str:
    """``dp=2 tp=2 ...``: the plan's knobs that have a value."""
    out = []
    for k in names:
        v = row.get(k)
        if v is None or (isinstance(v, float) and math.isnan(v)):
            continue
        out.append(f"{k}={int(v) if isinstance(v, float) and v.is_integer() else v}")
    return " ".join(out)


@dataclass(frozen=True)
class Best:
    """A space's best simulated plan (time None: no plan fits or none was simulated)."""

    run: Run
    time_s: float | None
    mem_gib: float | None
    knobs: str
    plans: int
    took_s: float
    note: str = ""
    cpu_s: float = 0.0  # CPU seconds of this process and its finished workers
    phases: str = ""  # explore's phases (trace, screen, simulate, ...) and counts


def explore_run(
    w: Workload, r: Run, cluster: str, nodes: int, jobs: int, out: Path | None, candidates: int | None = None, memo=None
) -> Best:
    """Explore one space for one workload and keep its best feasible simulated plan (with ``out``,
    explore's files for it go to ``out/<workload>/<space label>``; ``memo``: the workload's
    :class:`planlab.memo.SimulationMemo`, so that a plan another space simulated is not simulated again)."""
    import planlab
    from planlab.errors import PlanlabError

    t0, c0 = time.perf_counter(), cpu_seconds()
    try:
        df = planlab.explore(
            w.preset,
            cluster=cluster,
            nodes=nodes,
            space=r.space,
            fixed={"microbatch": MICROBATCH, **r.fixed},
            global_batch=GLOBAL_BATCH,
            jobs=jobs,
            **({} if candidates is None else {"candidates": candidates}),
            software=r.software,
            memo=memo,
            out=None if out is None else out / w.key / r.label.replace("*", "x"),
        )
    except PlanlabError as e:
        return Best(r, None, None, "", 0, time.perf_counter() - t0, f"not explored: {e}", cpu_seconds() - c0)
    took, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    ok = df[df["feasible"].astype(bool) & df["simulated"].astype(bool)]
    how = phases_of(df)
    if ok.empty:
        return Best(r, None, None, "", len(df), took, f"none fits ({least_memory_reason(df)})", cpu, how)
    row = ok.sort_values("iter_time_s").iloc[0]
    knobs = describe(row, knob_names(r.space))
    return Best(r, float(row["iter_time_s"]), float(row["peak_mem_gib"]), knobs, len(df), took, "", cpu, how)


def least_memory_reason(df) -> str:
    """Why the plan needing the least memory does not fit (its simulated peak, else the screen's
    estimate, orders the rows): the one a reader needs to see how far the space is from fitting."""
    if df.empty:
        return "no plan"
    need = df["peak_mem_gib"].astype(float)
    if "screen_mem_gib" in df:
        need = need.fillna(df["screen_mem_gib"].astype(float))
    order = need.fillna(math.inf).sort_values(kind="stable").index
    reason = df.loc[order[0], "reason"]
    return str(reason) if isinstance(reason, str) and reason else "no plan"


def cpu_seconds() -> float:
    """User and system CPU seconds of this process and of its children that have ended (explore's
    ``--jobs`` workers are joined before it returns)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


PHASE_NAMES = ("trace", "enumerate", "screen", "simulate")


def phases_of(df) -> str:
    """``trace 3 s, screen 10 s, simulate 40 s, rank 0 s; CPU 2 s, 0 s, 19 s, 75 s (16 of 72 simulated)``:
    where an exploration's time went, wall then CPU (this process's and its workers', per phase)."""
    ph, cpu, counts = df.attrs.get("phases", {}), df.attrs.get("phases_cpu", {}), df.attrs.get("counts", {})
    parts = [f"{n} {ph[n + '_s']:.0f} s" for n in PHASE_NAMES if n + "_s" in ph]
    rest = ph.get("total_s", 0.0) - sum(ph.get(n + "_s", 0.0) for n in PHASE_NAMES)
    parts.append(f"rank {rest:.0f} s")
    if cpu:
        parts[-1] += "; CPU " + ", ".join(f"{n} {cpu[n + '_s']:.0f} s" for n in PHASE_NAMES if n + "_s" in cpu)
    reused = f", {counts['reused']} of them reused from earlier spaces" if counts.get("reused") else ""
    return ", ".join(parts) + f" ({counts.get('simulated', 0)} of {counts.get('plans', len(df))} simulated{reused})"


def speedups(b: Best, bests: dict[str, Best]) -> list[str]:
    """``b``'s speedup over each baseline and the grid ('-' where either has no plan)."""
    out = []
    for ref in (*BASELINES, "grid"):
        o = bests.get(ref)
        ok = b.time_s is not None and o is not None and o.time_s is not None
        out.append(f"{o.time_s / b.time_s:.2f}x" if ok else "-")
    return out


def run_workload(
    w: Workload,
    *,
    jobs: int,
    specs: Path,
    out: Path | None,
    labels: tuple[str, ...] = (),
    candidates: int | None = None,
    reuse: bool = True,
) -> dict[str, Best]:
    """Explore every space of ``w`` (with ``labels``, those only), printing one line per space as it finishes;
    with ``reuse``, a plan is simulated once for all the spaces (one :class:`planlab.memo.SimulationMemo`)."""
    from planlab.memo import SimulationMemo

    memo = SimulationMemo() if reuse else None
    cluster, nodes = cluster_for(w.gpus, specs)
    part = "" if candidates is None else f", only {candidates} plans simulated per space (a partial measurement)"
    print(f"\n== {w.key}: {w.preset} on {w.gpus} V100 ({cluster}, {nodes} node(s)), global batch {GLOBAL_BATCH}{part}")
    bests: dict[str, Best] = {}
    t0, c0 = time.perf_counter(), cpu_seconds()
    for r in w.runs:
        if labels and r.label not in labels:
            continue
        b = explore_run(w, r, cluster, nodes, jobs, out, candidates, memo)
        bests[r.label] = b
        fig = f"{b.time_s:.3f} s, {b.mem_gib:.1f} GiB  {b.knobs}" if b.time_s is not None else b.note
        print(f"  {r.label:<13} {b.plans:>4} plans, {b.took_s:5.0f} s ({b.cpu_s:.0f} s CPU): {fig}", flush=True)
        if b.phases:
            print(f"  {'':<13} {b.phases}", flush=True)
    load = os.getloadavg()[0]
    print(f"  ({w.key}: {time.perf_counter() - t0:.0f} s wall, {cpu_seconds() - c0:.0f} s CPU, load {load:.1f})")
    return bests


def print_table(results: dict[str, dict[str, Best]]) -> None:
    """One Markdown table: per workload each space's best plan and its speedups."""
    heads = ["workload", "space", "kind", "time (s)", "memory (GiB)", *(f"vs {b}" for b in BASELINES)]
    print("\n| " + " | ".join([*heads, "vs grid", "best plan"]) + " |")
    print("|" + "---|" * (len(heads) + 2))
    for key, bests in results.items():
        for label, b in bests.items():
            t = f"{b.time_s:.3f}" if b.time_s is not None else "-"
            m = f"{b.mem_gib:.1f}" if b.mem_gib is not None else "-"
            plan = b.knobs or b.note
            print(f"| {key} | {label} | {b.run.kind} | {t} | {m} | " + " | ".join(speedups(b, bests)) + f" | {plan} |")


def summary(results: dict[str, dict[str, Best]]) -> None:
    """Per workload: the best composed plan against the best baseline and the grid."""
    print("\nworkload          best composed           vs best baseline   vs grid")
    for key, bests in results.items():
        comp = [b for b in bests.values() if b.run.kind == "composed" and b.time_s is not None]
        base = [b for b in bests.values() if b.run.kind == "baseline" and b.time_s is not None]
        grid = bests.get("grid")
        if not comp:
            print(f"{key:<17} no composed plan fits")
            continue
        c = min(comp, key=lambda b: b.time_s)
        vb = f"{min(b.time_s for b in base) / c.time_s:.2f}x" if base else "no baseline fits"
        vg = f"{grid.time_s / c.time_s:.2f}x" if grid and grid.time_s else "-"
        print(f"{key:<17} {c.run.label:<14} {c.time_s:8.3f} s   {vb:>16}   {vg:>7}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="", help="comma-separated keys: " + ",".join(w.key for w in WORKLOADS))
    ap.add_argument(
        "--spaces", default="", help="comma-separated labels to explore (default: all): " + ",".join(LABELS)
    )
    ap.add_argument("--jobs", type=int, default=2, help="plans simulated in parallel")
    ap.add_argument("--candidates", type=int, help="plans simulated per space (default: explore's)")
    ap.add_argument(
        "--no-reuse", action="store_true", help="simulate a plan again in each space that holds it (no memo)"
    )
    ap.add_argument("--specs", default="out/nnscaler_specs", help="folder for the 4- and 8-GPU cluster spec files")
    ap.add_argument("--out", help="folder for each exploration's results.csv, best_plan.json and plots")
    a = ap.parse_args()
    keys = [k for k in a.workloads.split(",") if k] or [w.key for w in sorted(WORKLOADS, key=lambda w: w.gpus)]
    unknown = sorted(set(keys) - {w.key for w in WORKLOADS})
    if unknown:
        print(f"unknown workload(s) {unknown}; expected some of {[w.key for w in WORKLOADS]}", file=sys.stderr)
        return 2
    labels = tuple(x for x in a.spaces.split(",") if x)
    if set(labels) - set(LABELS):
        print(f"unknown space label(s) {sorted(set(labels) - set(LABELS))}; expected some of {LABELS}", file=sys.stderr)
        return 2
    if a.jobs < 1:
        print(f"--jobs {a.jobs}: expected an integer >= 1", file=sys.stderr)
        return 2
    if a.candidates is not None and a.candidates < 1:
        print(f"--candidates {a.candidates}: expected an integer >= 1", file=sys.stderr)
        return 2
    t0, c0 = time.perf_counter(), cpu_seconds()
    by_key = {w.key: w for w in WORKLOADS}
    out = None if a.out is None else Path(a.out)
    results = {
        k: run_workload(
            by_key[k],
            jobs=a.jobs,
            specs=Path(a.specs),
            out=out,
            labels=labels,
            candidates=a.candidates,
            reuse=not a.no_reuse,
        )
        for k in keys
    }
    print_table(results)
    summary(results)
    load = os.getloadavg()
    wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    print(f"\n(total {wall:.0f} s wall, {cpu:.0f} s CPU; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
