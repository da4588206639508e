"""Plots: the Pareto front of an exploration, the timeline and the memory of a simulated iteration."""

from __future__ import annotations

import bisect
import os
import re
import textwrap
from collections import defaultdict
from itertools import repeat
from operator import itemgetter, methodcaller
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
    fig.savefig(tmp, dpi=FIGURE_DPI, bbox_inches="tight")
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


def _points(ax, rows, prefix: str, scale: float, label: str, empty: bool = False, **style) -> None:
    """``rows`` as points of memory (the ``<prefix>_mem_gib`` or ``peak_mem_gib`` column, times
    ``scale``) against time (``<prefix>_time_s`` or ``iter_time_s``), labelled with their count;
    no rows draw nothing unless ``empty``."""
    mem, time = (f"{prefix}_mem_gib", f"{prefix}_time_s") if prefix else ("peak_mem_gib", "iter_time_s")
    if len(rows) or empty:
        ax.scatter(rows[mem] * scale, rows[time], label=f"{label} ({len(rows)})", **style)


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
        _points(ax, est, "screen", scale, "screen estimate, not simulated", s=6, color="0.75", alpha=0.6, zorder=1)
    _points(ax, ok, "", scale, "feasible", s=18, color="tab:blue", zorder=3, empty=True)
    _points(ax, bad, "", scale, "out of memory", s=18, marker="x", color="tab:gray", zorder=2)
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


FIGURE_DPI = 110  # pixels per inch of the saved figures
TIMELINE_WIDTH_IN = 11.0


def coverage(starts, ends, edges):
    """The fraction of each bin ``[edges[k], edges[k + 1])`` that the spans ``[start, end)`` cover
    (overlapping spans add up, clipped to 1): from the running integral of how many spans are
    open, by sorting and cumulative sums, in time linear in the spans after sorting."""
    import numpy as np

    s, e, x = np.sort(np.asarray(starts, float)), np.sort(np.asarray(ends, float)), np.asarray(edges, float)
    ns, ne = np.searchsorted(s, x), np.searchsorted(e, x)
    cs, ce = np.r_[0.0, np.cumsum(s)], np.r_[0.0, np.cumsum(e)]
    covered = (ns * x - cs[ns]) - (ne * x - ce[ne])  # time covered by the spans before each edge
    return np.clip(np.diff(covered) / np.diff(x), 0.0, 1.0)


def _strip(spans: dict[str, tuple[list, list]], edges):
    """One lane's stream as a row of pixels (RGBA): each colour weighted by the time it covers."""
    import numpy as np
    from matplotlib.colors import to_rgb

    rgb = np.zeros((len(edges) - 1, 3))
    total = np.zeros(len(edges) - 1)
    for color, (starts, ends) in spans.items():
        cov = coverage(starts, ends, edges)
        rgb += cov[:, None] * np.array(to_rgb(color))
        total += cov
    shown = total > 0
    rgb[shown] /= total[shown, None]
    return np.concatenate([rgb, np.minimum(total, 1.0)[:, None]], axis=1)[None, :, :]


def _event_spans(result, lanes: dict[int, int]) -> dict[float, dict[str, tuple]]:
    """Start and end times of the shown lanes' events by bar row and colour (arrays). A result's
    events are sorted by device: each lane's are found by bisection and split by colour with array
    masks, without a Python step per event."""
    import numpy as np

    events = result.events
    rows: dict[float, dict[str, tuple]] = defaultdict(dict)
    for device, lane in lanes.items():
        lo = bisect.bisect_left(events, device, key=itemgetter(0))
        hi = bisect.bisect_right(events, device, lo=lo, key=itemgetter(0))
        if lo == hi:
            continue
        mine, n = events[lo:hi], hi - lo
        streams, actions, names = (list(map(itemgetter(k), mine)) for k in (1, 2, 3))
        start, end = (np.fromiter(map(itemgetter(k), mine), float, n) for k in (4, 5))
        shown = end > start
        stream = np.fromiter(map(_STREAM_CODES.get, streams, repeat(2, n)), np.int8, n)  # 2: waits, any other
        compute, comm = (stream == 0) & shown, (stream == 1) & shown
        palette = sorted(set(PHASE_COLORS.values()) | {"tab:blue", "tab:red"})
        index = {a: palette.index(_phase_color(a)) for a in set(actions)}
        color = np.fromiter(map(index.__getitem__, actions), np.int64, n)
        color[np.fromiter(map(methodcaller("startswith", "re:"), names), bool, n)] = palette.index("tab:red")
        for k, c in enumerate(palette):
            _add_spans(rows[lane], c, start, end, compute & (color == k))
        _add_spans(rows[lane + 0.42], "tab:orange", start, end, comm)
        _add_spans(rows[lane + 0.42], "0.7", start, end, shown & ~compute & ~comm)
    return {y: spans for y, spans in rows.items() if spans}


_STREAM_CODES = {"compute": 0, "comm": 1}


def _phase_color(action: str) -> str:
    """The colour of an action's phase (``3F12``: forward), blue for an action of no phase."""
    m = _PHASE.match(action)
    return PHASE_COLORS.get(m.group(1) if m else "", "tab:blue")


def _add_spans(row: dict[str, tuple], color: str, start, end, mask) -> None:
    if mask.any():
        row[color] = (start[mask], end[mask])


def timeline_plot(result, path: str | os.PathLike, *, title: str = "", max_lanes: int = 16) -> None:
    """The timeline of a simulated iteration (``simulate(..., timeline=True)``): one lane per
    device class, its compute stream (forward, backward, update by colour) above its
    communication stream (and waits). Each stream is drawn as a row of pixels, each pixel's
    colour and opacity from the time its tasks cover (a million tasks draw in a fraction of a
    second, and sub-pixel tasks show as the share of time they take)."""
    import numpy as np

    members = _members(result)
    devices = sorted(members) if result.devices else sorted({e.device for e in result.events})
    if len(devices) > max_lanes:  # first and last classes: where a pipeline starts and drains
        devices = devices[: max_lanes // 2] + devices[-(max_lanes - max_lanes // 2) :]
    lanes = {d: i for i, d in enumerate(devices)}
    fig, ax = plt.subplots(figsize=(TIMELINE_WIDTH_IN, max(2.2, 0.9 + 0.55 * len(lanes))))
    edges = np.linspace(0.0, max(result.iter_time_s, 1e-12), int(TIMELINE_WIDTH_IN * FIGURE_DPI) + 1)
    for y, spans in _event_spans(result, lanes).items():
        ax.imshow(
            _strip(spans, edges), extent=(0.0, edges[-1], y + 0.38, y), aspect="auto", interpolation="antialiased"
        )
    ax.set_xlim(-0.02 * edges[-1], 1.02 * edges[-1])
    ax.set_ylim(len(lanes) + 0.1, -0.3)
    ax.set_yticks([i + 0.4 for i in lanes.values()], [f"device {d} (x{members.get(d, 1)})" for d in lanes])
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


def step_envelope(times_s, values, pixel_s: float):
    """A step series ``(times, values)`` (each value holds until the next time) cut to at most one
    point per ``pixel_s``: each pixel's highest value at its first time, so no peak is lost."""
    import numpy as np

    t, v = np.asarray(times_s, dtype=float), np.asarray(values, dtype=float)
    if len(t) <= 2 or pixel_s <= 0:
        return t, v
    bins = np.floor((t - t[0]) / pixel_s).astype(np.int64)
    first = np.flatnonzero(np.r_[True, bins[1:] != bins[:-1]])
    if len(first) == len(t):
        return t, v
    return t[first], np.maximum.reduceat(v, first)


def memory_plot(result, path: str | os.PathLike, *, title: str = "", max_lines: int = 8) -> None:
    """Memory over time per device class (``simulate(..., timeline=True)``), with the device's
    memory; each line keeps the highest value of every pixel."""
    fig, ax = plt.subplots(figsize=(9, 4))
    members = _members(result)
    top = max((d.peak_mem_bytes for d in result.devices), default=0) / 2**30
    unit, scale = ("MiB", 2**20) if top < 1.0 else ("GiB", 2**30)
    cap = result.device_memory_bytes / scale
    series: dict[int, tuple[list, list]] = defaultdict(lambda: ([], []))
    for dev, t, b in result.memory:
        times, values = series[dev]
        times.append(t)
        values.append(b)
    pixel_s = max(result.iter_time_s, 1e-12) / (9 * FIGURE_DPI)
    shown = sorted(series, key=lambda d: -max(series[d][1]))[:max_lines]
    for d in sorted(shown):
        t, b = step_envelope(*series[d], pixel_s)
        ax.step(t, b / scale, where="post", label=f"device {d} (x{members.get(d, 1)})")
    if top * 2**30 / scale > cap / 3:
        ax.axhline(cap, color="k", ls=":", lw=1, label=f"device memory {result.device_memory_bytes / 2**30:.0f} GiB")
    ax.set_xlabel("time (s)")
    ax.set_ylabel(f"memory ({unit})")
    ax.set_title(_title(title, "") + f"\npeak {top * 2**30 / scale:.3g} {unit}", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    _save(fig, path)
