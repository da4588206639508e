"""Plots: the Pareto front of an exploration, the timeline and the memory of a simulated iteration."""

from __future__ import annotations

import os
import re
import textwrap
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.patches  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402

PART_MARKERS = ("s", "^", "D", "v", "P", "X", "<", ">", "h", "p")
PHASE_COLORS = {"F": "tab:blue", "B": "tab:green", "I": "tab:olive", "W": "tab:cyan", "U": "tab:purple"}
_PHASE = re.compile(r"^\d+([FBIWU])\d+$")


def _save(fig, path: str | os.PathLike) -> None:
    path = Path(path)
    tmp = path.with_name(path.stem + ".tmp" + path.suffix)
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    plt.close(fig)
    os.replace(tmp, path)


def _knobs_text(df, i: int) -> str:
    """The knobs that vary across the table, of row ``i``: ``tp=4 pp=8``."""
    from planlab.explore import RESULT_COLUMNS

    knobs = [c for c in df.columns if c not in RESULT_COLUMNS + ["pareto"] and df[c].nunique(dropna=False) > 1]
    return "\n    ".join(textwrap.wrap(" ".join(f"{k}={df.loc[i, k]}" for k in knobs), 60))


def shown_capacity(top_gib: float, cap_gib: float | None) -> float | None:
    """The device memory, if the Pareto plot shows it: within 3x of the highest simulated peak.
    The memory axis spans the data and the shown capacity, so points at 2.5 MiB are not squeezed
    against a 4 GiB device's line."""
    return cap_gib if cap_gib and cap_gib <= 3 * max(top_gib, 1e-9) else None


def pareto_plot(df, path: str | os.PathLike) -> None:
    """Iteration time against peak memory: simulated plans (feasible, out of memory), the screen's
    estimates of the others, the Pareto front, the device memory, the chosen plan (the fastest
    feasible) and the best plan of each part of the space (``df.attrs["part_best"]``)."""
    fig, ax = plt.subplots(figsize=(8, 5))
    sim = df["simulated"] == True if "simulated" in df else df["iter_time_s"].notna()  # noqa: E712
    ok = df[(df["feasible"] == True) & sim]  # noqa: E712
    bad = df[(df["feasible"] == False) & sim & df["iter_time_s"].notna()]  # noqa: E712
    peaks = df.loc[sim, "peak_mem_gib"].dropna()
    top = float(peaks.max()) if len(peaks) else 0.0
    unit, scale = ("MiB", 1024.0) if 0 < top < 1.0 else ("GiB", 1.0)
    if "screen_time_s" in df:
        est = df[~sim & df["screen_time_s"].notna()]
        if len(est):
            ax.scatter(
                est["screen_mem_gib"] * scale,
                est["screen_time_s"],
                s=6,
                color="0.75",
                alpha=0.6,
                label=f"screen estimate, not simulated ({len(est)})",
                zorder=1,
            )
    ax.scatter(
        ok["peak_mem_gib"] * scale, ok["iter_time_s"], s=18, label=f"feasible ({len(ok)})", color="tab:blue", zorder=3
    )
    if len(bad):
        ax.scatter(
            bad["peak_mem_gib"] * scale,
            bad["iter_time_s"],
            s=18,
            marker="x",
            color="tab:gray",
            label=f"out of memory ({len(bad)})",
            zorder=2,
        )
    front = ok[ok["pareto"] == True].sort_values("peak_mem_gib")  # noqa: E712
    if len(front):
        ax.step(
            front["peak_mem_gib"] * scale,
            front["iter_time_s"],
            where="post",
            color="tab:red",
            label="Pareto front",
            zorder=4,
        )
        ax.scatter(
            front["peak_mem_gib"] * scale, front["iter_time_s"], s=46, facecolors="none", edgecolors="tab:red", zorder=4
        )
    for k, (name, i) in enumerate(sorted((df.attrs.get("part_best") or {}).items())):
        ax.scatter(
            [df.loc[i, "peak_mem_gib"] * scale],
            [df.loc[i, "iter_time_s"]],
            s=70,
            marker=PART_MARKERS[k % len(PART_MARKERS)],
            facecolors="none",
            edgecolors="k",
            linewidths=1.2,
            label=f"best of {name}: {_knobs_text(df, i)}",
            zorder=5,
        )
    if len(ok):
        i = ok["iter_time_s"].idxmin()
        ax.scatter(
            [df.loc[i, "peak_mem_gib"] * scale],
            [df.loc[i, "iter_time_s"]],
            s=160,
            marker="*",
            color="gold",
            edgecolors="k",
            label=f"chosen: {_knobs_text(df, i)}",
            zorder=6,
        )
    cap = df.attrs.get("device_memory_gib")
    shown = shown_capacity(top, cap)
    if shown:
        ax.axvline(shown * scale, color="k", ls=":", lw=1, label=f"device memory {shown:.0f} GiB")
    times = df.loc[sim, "iter_time_s"].dropna()
    if len(times) and len(peaks):  # the simulated plans (and the device's memory when near them), not every estimate
        ax.set_xlim(0, 1.3 * max(top, shown or 0.0) * scale)
        ax.set_ylim(0, 1.5 * float(times.max()))
    ax.set_xlabel(f"peak memory per device ({unit})")
    ax.set_ylabel("iteration time (s)")
    n_sim = int(sim.sum())
    ax.set_title(f"{df.attrs.get('space', 'plans')}: {len(df)} plans, {n_sim} simulated, {len(ok)} feasible")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3)
    _save(fig, path)


def _title(title: str, default: str) -> str:
    return "\n".join(textwrap.wrap(title, 110)) if title else default


def _members(result) -> dict[int, int]:
    return {d.device: d.members for d in result.devices}


def timeline_plot(result, path: str | os.PathLike, *, title: str = "", max_lanes: int = 16) -> None:
    """The timeline of a simulated iteration (``simulate(..., timeline=True)``): one lane per
    device class, its compute stream (forward, backward, update by colour) above its
    communication stream (and waits)."""
    members = _members(result)
    devices = sorted({e.device for e in result.events}) or sorted(members)
    if len(devices) > max_lanes:  # first and last classes: where a pipeline starts and drains
        devices = devices[: max_lanes // 2] + devices[-(max_lanes - max_lanes // 2) :]
    lanes = {d: i for i, d in enumerate(devices)}
    fig, ax = plt.subplots(figsize=(11, max(2.2, 0.9 + 0.55 * len(lanes))))
    bars: dict[tuple[float, str], list] = defaultdict(list)
    for e in result.events:
        if e.device not in lanes or e.end_s <= e.start_s:
            continue
        if e.stream == "compute":
            m = _PHASE.match(e.action)
            color = "tab:red" if e.name.startswith("re:") else PHASE_COLORS.get(m.group(1) if m else "", "tab:blue")
            y = lanes[e.device]
        else:
            color = "tab:orange" if e.stream == "comm" else "0.7"
            y = lanes[e.device] + 0.42
        bars[(y, color)].append((e.start_s, e.end_s - e.start_s))
    for (y, color), spans in bars.items():
        ax.broken_barh(spans, (y, 0.38), color=color, linewidth=0)
    ax.set_yticks([i + 0.4 for i in lanes.values()], [f"device {d} (x{members.get(d, 1)})" for d in lanes])
    ax.invert_yaxis()
    handles = [
        matplotlib.patches.Patch(color=c, label=lab)
        for lab, c in (
            ("forward", "tab:blue"),
            ("backward", "tab:green"),
            ("recompute", "tab:red"),
            ("update", "tab:purple"),
            ("communication", "tab:orange"),
            ("wait", "0.7"),
        )
    ]
    ax.legend(handles=handles, fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_xlabel("time (s)")
    ax.set_title(_title(title, f"iteration {result.iter_time_s * 1e3:.1f} ms"), fontsize=9)
    ax.grid(alpha=0.3, axis="x")
    _save(fig, path)


def memory_plot(result, path: str | os.PathLike, *, title: str = "", max_lines: int = 8) -> None:
    """Memory over time per device class (``simulate(..., timeline=True)``), with the device's memory."""
    fig, ax = plt.subplots(figsize=(9, 4))
    members = _members(result)
    top = max((d.peak_mem_bytes for d in result.devices), default=0) / 2**30
    unit, scale = ("MiB", 2**20) if top < 1.0 else ("GiB", 2**30)
    cap = result.device_memory_bytes / scale
    series: dict[int, list] = defaultdict(list)
    for dev, t, b in result.memory:
        series[dev].append((t, b / scale))
    shown = sorted(series, key=lambda d: -max(b for _, b in series[d]))[:max_lines]
    for d in sorted(shown):
        pts = series[d]
        ax.step([t for t, _ in pts], [b for _, b in pts], where="post", label=f"device {d} (x{members.get(d, 1)})")
    if top * 2**30 / scale > cap / 3:
        ax.axhline(cap, color="k", ls=":", lw=1, label=f"device memory {result.device_memory_bytes / 2**30:.0f} GiB")
    ax.set_xlabel("time (s)")
    ax.set_ylabel(f"memory ({unit})")
    ax.set_title(_title(title, "") + f"\npeak {top * 2**30 / scale:.3g} {unit}", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    _save(fig, path)
