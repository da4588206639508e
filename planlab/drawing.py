"""What the timeline and memory plots of a simulated iteration show, reduced to their pixels.

A :class:`Drawing` holds, for ``timeline.png``, one row of RGBA pixels per stream of each lane shown
(each pixel's colour and opacity from the time its tasks cover) and, for ``memory.png``, each line
shown cut to one point per pixel (its highest value there). It is computed where the simulation ran,
from a :class:`~planlab.simulator.result.SimResult` that recorded its timeline, and is small (tens
of kilobytes against the timeline's millions of events): an exploration's workers send the best
candidate's drawing to the parent, which plots it (:mod:`planlab.plotting`) without simulating again.
Needs numpy and matplotlib's colour names, not pyplot.
"""

from __future__ import annotations

import bisect
import re
from collections import defaultdict
from dataclasses import dataclass
from itertools import repeat
from operator import itemgetter, methodcaller

import numpy as np

PHASE_COLORS = {"F": "tab:blue", "B": "tab:green", "I": "tab:olive", "W": "tab:cyan", "U": "tab:purple"}
_PHASE = re.compile(r"^\d+([FBIWU])\d+$")
FIGURE_DPI = 110  # pixels per inch of the saved figures
TIMELINE_WIDTH_IN = 11.0
MEMORY_WIDTH_IN = 9.0
MAX_LANES = 16  # device classes the timeline shows (the first and the last half)
MAX_LINES = 8  # device classes the memory plot shows (the fullest)


@dataclass(frozen=True)
class Drawing:
    """The pixels of a simulated iteration's timeline and memory plots (see the module's docstring).

    ``lanes``: ``(device, members)`` of each timeline lane, top to bottom; ``strips``: ``(y, RGBA
    row of shape (1, pixels, 4))`` per stream drawn; ``lines``: ``(device, members, times_s,
    bytes)`` of each memory line, by device; ``peak_mem_bytes``: the fullest device class's peak."""

    iter_time_s: float
    lanes: tuple[tuple[int, int], ...]
    strips: tuple[tuple[float, np.ndarray], ...]
    lines: tuple[tuple[int, int, np.ndarray, np.ndarray], ...]
    peak_mem_bytes: int
    device_memory_bytes: float


def coverage(starts, ends, edges):
    """The fraction of each bin ``[edges[k], edges[k + 1])`` that the spans ``[start, end)`` cover
    (overlapping spans add up, clipped to 1): from the running integral of how many spans are
    open, by sorting and cumulative sums, in time linear in the spans after sorting."""
    s, e, x = np.sort(np.asarray(starts, float)), np.sort(np.asarray(ends, float)), np.asarray(edges, float)
    ns, ne = np.searchsorted(s, x), np.searchsorted(e, x)
    cs, ce = np.r_[0.0, np.cumsum(s)], np.r_[0.0, np.cumsum(e)]
    covered = (ns * x - cs[ns]) - (ne * x - ce[ne])  # time covered by the spans before each edge
    return np.clip(np.diff(covered) / np.diff(x), 0.0, 1.0)


def step_envelope(times_s, values, pixel_s: float):
    """A step series ``(times, values)`` (each value holds until the next time) cut to at most one
    point per ``pixel_s``: each pixel's highest value at its first time, so no peak is lost."""
    t, v = np.asarray(times_s, dtype=float), np.asarray(values, dtype=float)
    if len(t) <= 2 or pixel_s <= 0:
        return t, v
    bins = np.floor((t - t[0]) / pixel_s).astype(np.int64)
    first = np.flatnonzero(np.r_[True, bins[1:] != bins[:-1]])
    if len(first) == len(t):
        return t, v
    return t[first], np.maximum.reduceat(v, first)


def _strip(spans: dict[str, tuple], edges):
    """One lane's stream as a row of pixels (RGBA): each colour weighted by the time it covers."""
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


_STREAM_CODES = {"compute": 0, "comm": 1}


def _phase_color(action: str) -> str:
    """The colour of an action's phase (``3F12``: forward), blue for an action of no phase."""
    m = _PHASE.match(action)
    return PHASE_COLORS.get(m.group(1) if m else "", "tab:blue")


def _add_spans(row: dict[str, tuple], color: str, start, end, mask) -> None:
    if mask.any():
        row[color] = (start[mask], end[mask])


def _event_spans(result, lanes: dict[int, int]) -> dict[float, dict[str, tuple]]:
    """Start and end times of the shown lanes' events by bar row and colour (arrays). A result's
    events are sorted by device: each lane's are found by bisection and split by colour with array
    masks, without a Python step per event."""
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


def timeline_edges(iter_time_s: float):
    """The pixel edges of the timeline's rows: one pixel of the figure's width each."""
    return np.linspace(0.0, max(iter_time_s, 1e-12), int(TIMELINE_WIDTH_IN * FIGURE_DPI) + 1)


def _memory_lines(result, max_lines: int) -> tuple[tuple[int, int, np.ndarray, np.ndarray], ...]:
    """The ``max_lines`` fullest device classes' memory over time, one point per pixel, by device."""
    members = {d.device: d.members for d in result.devices}
    series: dict[int, tuple[list, list]] = defaultdict(lambda: ([], []))
    for dev, t, b in result.memory:
        times, values = series[dev]
        times.append(t)
        values.append(b)
    pixel_s = max(result.iter_time_s, 1e-12) / (MEMORY_WIDTH_IN * FIGURE_DPI)
    shown = sorted(series, key=lambda d: -max(series[d][1]))[:max_lines]
    return tuple((d, members.get(d, 1), *step_envelope(*series[d], pixel_s)) for d in sorted(shown))


def drawing_of(result, *, max_lanes: int = MAX_LANES, max_lines: int = MAX_LINES) -> Drawing:
    """The :class:`Drawing` of a result simulated with ``timeline=True``: its first and last
    ``max_lanes`` device classes' streams as pixels (where a pipeline starts and drains; 0: no
    timeline), and the memory of its ``max_lines`` fullest classes."""
    members = {d.device: d.members for d in result.devices}
    devices = sorted(members) if result.devices else sorted({e.device for e in result.events})
    if len(devices) > max_lanes:
        devices = devices[: max_lanes // 2] + devices[len(devices) - (max_lanes - max_lanes // 2) :]
    lanes = {d: i for i, d in enumerate(devices)}
    edges = timeline_edges(result.iter_time_s)
    strips = tuple((y, _strip(spans, edges)) for y, spans in _event_spans(result, lanes).items())
    return Drawing(
        iter_time_s=result.iter_time_s,
        lanes=tuple((d, members.get(d, 1)) for d in lanes),
        strips=strips,
        lines=_memory_lines(result, max_lines),
        peak_mem_bytes=max((d.peak_mem_bytes for d in result.devices), default=0),
        device_memory_bytes=result.device_memory_bytes,
    )
