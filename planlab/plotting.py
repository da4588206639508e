"""Plots: the Pareto front of an exploration, the timeline and the memory of a simulated iteration."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.patches  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from planlab.drawing import (  # noqa: E402
    FIGURE_DPI,
    MAX_LANES,
    MAX_LINES,
    MEMORY_WIDTH_IN,
    TIMELINE_WIDTH_IN,
    Drawing,
    coverage,  # noqa: F401 (re-exported)
    drawing_of,
    step_envelope,  # noqa: F401 (re-exported)
    timeline_edges,
)

PART_MARKERS = ("s", "^", "D", "v", "P", "X", "<", ">", "h", "p")


def _figure(width_in: float, height_in: float):
    """A figure and its axes, drawn by Agg at the saved resolution (not pyplot's: no figure
    manager, nothing to close, and pyplot is not imported)."""
    fig = Figure(figsize=(width_in, height_in), dpi=FIGURE_DPI)
    FigureCanvasAgg(fig)
    return fig, fig.subplots()


def _save(fig, path: str | os.PathLike) -> None:
    """``fig`` as a PNG, cropped to what it draws (a tight box, padded as savefig pads one), written
    whole. The box is found from the text and artists' extents without drawing the figure, so the
    figure is drawn once (``bbox_inches="tight"`` draws it once more to find the box)."""
    path = Path(path)
    tmp = path.with_name(path.stem + ".tmp" + path.suffix)
    box = fig.get_tightbbox(fig.canvas.get_renderer()).padded(matplotlib.rcParams["savefig.pad_inches"])
    fig.savefig(tmp, dpi=FIGURE_DPI, bbox_inches=box)
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
    fig, ax = _figure(8, 5)
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


def _drawing(result, max_lanes: int, max_lines: int) -> Drawing:
    return result if isinstance(result, Drawing) else drawing_of(result, max_lanes=max_lanes, max_lines=max_lines)


def timeline_plot(result, path: str | os.PathLike, *, title: str = "", max_lanes: int = MAX_LANES) -> None:
    """The timeline of a simulated iteration (a result of ``simulate(..., timeline=True)``, or its
    :class:`~planlab.drawing.Drawing`): one lane per device class, its compute stream (forward,
    backward, update by colour) above its communication stream (and waits). Each stream is drawn as
    a row of pixels, each pixel's colour and opacity from the time its tasks cover (a million tasks
    draw in a fraction of a second, and sub-pixel tasks show as the share of time they take)."""
    drawing = _drawing(result, max_lanes, MAX_LINES)
    lanes = drawing.lanes
    fig, ax = _figure(TIMELINE_WIDTH_IN, max(2.2, 0.9 + 0.55 * len(lanes)))
    end_s = timeline_edges(drawing.iter_time_s)[-1]
    for y, strip in drawing.strips:
        ax.imshow(strip, extent=(0.0, end_s, y + 0.38, y), aspect="auto", interpolation="antialiased")
    ax.set_xlim(-0.02 * end_s, 1.02 * end_s)
    ax.set_ylim(len(lanes) + 0.1, -0.3)
    ax.set_yticks([i + 0.4 for i in range(len(lanes))], [f"device {d} (x{m})" for d, m in lanes])
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
    ax.set_title(_title(title, f"iteration {drawing.iter_time_s * 1e3:.1f} ms"), fontsize=9)
    ax.grid(alpha=0.3, axis="x")
    _save(fig, path)


def memory_plot(result, path: str | os.PathLike, *, title: str = "", max_lines: int = MAX_LINES) -> None:
    """Memory over time per device class (a result of ``simulate(..., timeline=True)``, or its
    :class:`~planlab.drawing.Drawing`), with the device's memory; each line keeps the highest
    value of every pixel."""
    drawing = _drawing(result, 0, max_lines)  # a SimResult: its memory lines alone
    fig, ax = _figure(MEMORY_WIDTH_IN, 4)
    top = drawing.peak_mem_bytes / 2**30
    unit, scale = ("MiB", 2**20) if top < 1.0 else ("GiB", 2**30)
    cap = drawing.device_memory_bytes / scale
    for d, members, t, b in drawing.lines:
        ax.step(t, b / scale, where="post", label=f"device {d} (x{members})")
    if top * 2**30 / scale > cap / 3:
        ax.axhline(cap, color="k", ls=":", lw=1, label=f"device memory {drawing.device_memory_bytes / 2**30:.0f} GiB")
    ax.set_xlabel("time (s)")
    ax.set_ylabel(f"memory ({unit})")
    ax.set_title(_title(title, "") + f"\npeak {top * 2**30 / scale:.3g} {unit}", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    _save(fig, path)
