"""Walks of the pipeline schedules that the explorer's screen (and the fine-grained space) read
without building a plan: how many forward/backward pairs a device group runs, and how many
micro-batches it keeps in flight per model chunk at each point of its schedule. Each is a pure
function of the schedule's shape; the screen keeps each walk it made (``Screen.walked``)."""

from __future__ import annotations

import numpy as np

from planlab.search_spaces.recycling_passes import recycling_actions
from planlab.search_spaces.schedules import SCHEDULES, interleaved_1f1b, one_f_one_b
from planlab.search_spaces.schedules_v import V_SCHEDULES


def paired_actions(schedule: str, r: int, groups: int, m: int) -> int:
    """How many forward/backward pairs (``Action.overlaps``) group ``r`` of a V-shaped schedule runs."""
    return sum(a.overlaps for a in V_SCHEDULES[schedule](r, groups, m))


def paired_interleaved(r: int, groups: int, m: int, chunks: int, group: int) -> int:
    """How many forward/backward pairs group ``r`` of a paired interleaved schedule runs."""
    return sum(a.overlaps for a in interleaved_1f1b(r, groups, m, chunks, group, paired=True))


def in_flight(schedule: str, r: int, groups: int, m: int, chunks: int) -> int:
    """Micro-batch units (one chunk's activations each) device group ``r`` keeps at its peak."""
    if schedule == "interleaved":
        return min(m * chunks, 2 * (groups - r - 1) + (chunks - 1) * groups + 1)
    if schedule == "1f1b":
        return min(m, groups - r)
    if schedule == "gpipe":
        return m
    return min(m, groups - r) * chunks  # another schedule: as 1F1B


def zb_counts(r: int, groups: int, m: int) -> np.ndarray:
    """ZB-H1 on group ``r``: the distinct (micro-batches past F before their I, micro-batches past
    I before their W) after each action of its schedule (read-only)."""
    kept = pending = 0
    rows = [(0, 0)]
    for a in SCHEDULES["zb-h1"](r, groups, m):
        if a.phase == "F":
            kept += 1
        elif a.phase == "I":
            kept, pending = kept - 1, pending + 1
        elif a.phase == "W":
            pending -= 1
        elif a.phase == "B":
            kept -= 1
        rows.append((kept, pending))
    got = np.unique(np.array(rows, dtype=np.int32), axis=0)
    got.flags.writeable = False
    return got


def flight_counts(
    schedule: str, r: int, groups: int, m: int, chunks: int, group: int = 0, paired: bool = False
) -> np.ndarray:
    """The distinct vectors of micro-batches in flight per model chunk of device group ``r`` (one
    row after each forward of its schedule; forwards add one, full or weight backwards take one
    away), walking the schedule the plan will run (``paired``: the interleaved schedule's paired
    forwards and backwards, one more warm-up forward). The activation peak for per-chunk bytes ``w``
    is ``max(rows @ w)`` (read-only; the screen keeps each it walked, :meth:`Screen.walked`)."""
    if schedule.startswith("recycled:"):
        actions = recycling_actions(schedule.split(":", 1)[1], r, groups, m, chunks)
    elif schedule in V_SCHEDULES:  # chunk 1 is the way back
        actions = V_SCHEDULES[schedule](r, groups, m)
    elif chunks > 1:
        actions = interleaved_1f1b(r, groups, m, chunks, group, paired)
    elif schedule in SCHEDULES:
        actions = SCHEDULES[schedule](r, groups, m)
    else:
        actions = one_f_one_b(r, groups, m)
    steps = np.zeros((len(actions), chunks), dtype=np.int32)
    fwd = np.zeros(len(actions), dtype=bool)
    for k, a in enumerate(actions):
        c = a.stage // groups
        if a.phase == "F":
            steps[k, c] = 1
            fwd[k] = True
        elif a.phase in ("B", "W"):
            steps[k, c] = -1
    rows = np.cumsum(steps, axis=0)[fwd] if len(actions) else np.zeros((1, chunks), dtype=np.int32)
    got = np.unique(rows, axis=0)
    got.flags.writeable = False
    return got
