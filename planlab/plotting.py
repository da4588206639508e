"""Plots: the Pareto front of an exploration, timelines and memory of a simulation."""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _save(fig, path: str | os.PathLike) -> None:
    path = Path(path)
    tmp = path.with_name(path.stem + ".tmp" + path.suffix)
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    plt.close(fig)
    os.replace(tmp, path)


def pareto_plot(df, path: str | os.PathLike) -> None:
    """Iteration time against peak memory; feasible plans, infeasible ones, the Pareto front."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ok = df[df["feasible"] == True]  # noqa: E712
    bad = df[(df["feasible"] == False) & df["iter_time_s"].notna()]  # noqa: E712
    top = float(df["peak_mem_gib"].max()) if len(df) else 0.0
    unit, scale = ("MiB", 1024.0) if top < 1.0 else ("GiB", 1.0)
    ax.scatter(ok["peak_mem_gib"] * scale, ok["iter_time_s"], s=18, label="feasible", color="tab:blue")
    if len(bad):
        ax.scatter(bad["peak_mem_gib"] * scale, bad["iter_time_s"], s=18, marker="x", color="tab:gray",
                   label="out of memory")
    front = ok[ok["pareto"] == True].sort_values("peak_mem_gib")  # noqa: E712
    if len(front):
        ax.step(front["peak_mem_gib"] * scale, front["iter_time_s"], where="post", color="tab:red",
                label="Pareto front")
        ax.scatter(front["peak_mem_gib"] * scale, front["iter_time_s"], s=40, facecolors="none",
                   edgecolors="tab:red")
    cap = df.attrs.get("device_memory_gib")
    if cap and cap <= 3 * top:
        ax.axvline(cap * scale, color="k", ls=":", lw=1, label=f"device memory {cap:.0f} GiB")
    ax.set_xlabel(f"peak memory per device ({unit})")
    ax.set_ylabel("iteration time (s)")
    ax.set_title(f"{df.attrs.get('space', 'plans')}: {len(df)} plans, {len(ok)} feasible")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    _save(fig, path)


def timeline_plot(result, path: str | os.PathLike) -> None:
    """Gantt chart of a simulated iteration (needs ``simulate(..., timeline=True)``)."""
    fig, ax = plt.subplots(figsize=(10, 0.5 + 0.4 * len(result.devices)))
    colors = {"compute": "tab:blue", "comm": "tab:orange", "wait": "tab:gray"}
    ys = {d.device: i for i, d in enumerate(result.devices)}
    for e in result.events:
        y = ys[e.device] + {"compute": 0.0, "comm": 0.3, "wait": 0.3}[e.stream]
        ax.broken_barh([(e.start_s, e.end_s - e.start_s)], (y, 0.28), color=colors[e.stream])
    ax.set_yticks([i + 0.3 for i in ys.values()], [f"device {d}" for d in ys])
    ax.set_xlabel("time (s)")
    _save(fig, path)


def memory_plot(result, path: str | os.PathLike) -> None:
    """Memory over time per device class (needs ``simulate(..., timeline=True)``)."""
    fig, ax = plt.subplots(figsize=(9, 4))
    cap = result.device_memory_bytes / 2**30
    for d in result.devices:
        pts = [(t, b / 2**30) for dev, t, b in result.memory if dev == d.device]
        if pts:
            ax.step([t for t, _ in pts], [b for _, b in pts], where="post", label=f"device {d.device} (x{d.members})")
    if max((d.peak_mem_bytes for d in result.devices), default=0) / 2**30 > cap / 3:
        ax.axhline(cap, color="k", ls=":", lw=1, label="device memory")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("memory (GiB)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    _save(fig, path)
