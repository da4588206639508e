"""Choosing what to simulate after the screen, and reading a results table by part of a space.

``candidates`` picks, among the plans the screen estimated, the ``k`` fastest that fit in memory
by the screen's estimate, the ``k`` fastest that fit within the screen's known memory error (so that
an overestimated peak does not drop a fast plan that fits), every plan near the screen's Pareto front
(time against memory), and the fastest of each part of the space by both memory cuts; ``pareto_mask`` marks the front of simulated plans;
``part_masks`` says which rows belong to which part of a union or product (for the plots).
"""

from __future__ import annotations

from typing import Sequence

import pandas as pd

from planlab.search_spaces.space import Space

MEMORY_SLACK = 0.05  # the screen's memory estimate may be this far above the device's and still be simulated
# How far the screen's memory estimate is known to run over the simulated peak: 17% on the plans a product
# space lost in nnScaler's Swin runs of 2026-11-27 (swin-32's dp 4, tp 8, ZeRO-3 plan: 29.4 GiB estimated,
# 25.1 simulated; swin-16's co-sharded dp 8, tp 2 plan: 26.6 against 22.7); over 187 simulated Swin plans
# 0.80 to 1.25, one above 1.20 (docs/validation.md, "A product space keeps its factors' best"). It widens
# which plans are simulated only: every figure reported is the simulator's.
SCREEN_MEMORY_ERROR = 0.20
NEAR_FRONT = 0.02  # plans within 2% of the screen's Pareto front (in time) are near it


def front(points: Sequence[tuple[float, float] | None], tol: float = 0.0) -> list[bool]:
    """True for points that no other point beats in time at no more memory (by more than ``tol``,
    a fraction of the time; with ``tol=0``, Pareto dominance: no other point is at least as good in
    both and better in one). ``points[i]`` is ``(time, memory)`` or None (left out)."""
    order = sorted((p[1], p[0], i) for i, p in enumerate(points) if p is not None)
    out = [False] * len(points)
    below = float("inf")  # fastest time among points with strictly less memory
    k = 0
    while k < len(order):
        j = k
        while j < len(order) and order[j][0] == order[k][0]:
            j += 1
        here = min(t for _, t, _ in order[k:j])  # fastest at this memory
        for _, t, i in order[k:j]:
            out[i] = t <= here * (1.0 + tol) and (t < below if tol == 0 else t <= below * (1.0 + tol))
        below = min(below, here)
        k = j
    return out


def candidates(
    est: Sequence[tuple[float, float] | None],
    *,
    k: int | None,
    memory_bytes: float,
    parts: dict[str, Sequence[bool]] | None = None,
    tol: float = NEAR_FRONT,
) -> list[int]:
    """Indices to simulate, fastest estimate first: with ``k`` None every estimated plan; else the
    ``k`` fastest whose estimated memory fits (with :data:`MEMORY_SLACK`; topped up with the
    smallest if fewer fit), the ``k`` fastest whose estimate is within :data:`SCREEN_MEMORY_ERROR`
    of the device's memory (the screen may overestimate their peak), up to ``k`` plans within ``tol`` of the screen's Pareto front (spread
    along it, from the fastest to the smallest), and the fastest of each part that fits and that is
    within the screen's memory error. ``est[i]`` is
    ``(time_s, mem_bytes)``, or None to leave the plan out."""
    known = [i for i, e in enumerate(est) if e is not None]
    if k is None:
        chosen = set(known)
    else:
        cap = memory_bytes * (1.0 + MEMORY_SLACK)
        fits = [i for i in known if est[i][1] <= cap]
        chosen = set(sorted(fits, key=lambda i: est[i][0])[:k])
        if len(chosen) < k:
            rest = sorted((i for i in known if i not in chosen), key=lambda i: est[i][1])
            chosen.update(rest[: k - len(chosen)])
        maybe = [i for i in known if est[i][1] <= memory_bytes * (1.0 + SCREEN_MEMORY_ERROR)]
        chosen.update(sorted(maybe, key=lambda i: est[i][0])[:k])
        fit = set(fits)
        near = front([est[i] if i in fit else None for i in range(len(est))], tol)
        on = sorted((i for i, n in enumerate(near) if n), key=lambda i: est[i][0])
        step = max(1.0, (len(on) - 1) / max(1, k - 1))
        chosen.update(on[min(len(on) - 1, round(j * step))] for j in range(min(k, len(on))))
        # each part's fastest by both memory cuts above: a part's best found through the screen's
        # memory error (as the part alone would find it) is not crowded out by the other parts' plans
        for mask in (parts or {}).values():
            for pool in (fits, maybe):
                mine = [i for i in pool if mask[i]]
                if mine:
                    chosen.add(min(mine, key=lambda i: est[i][0]))
    return sorted(chosen, key=lambda i: est[i][0])


def pareto_mask(df: pd.DataFrame) -> list[bool]:
    """True for feasible plans that no other feasible plan beats in both time and memory."""
    return front([(r.iter_time_s, r.peak_mem_gib) if bool(r.feasible) else None for r in df.itertuples()])


def factor_masks(space: Space, df: pd.DataFrame) -> dict[str, list[bool]]:
    """:func:`part_masks`, and for a product also its factors as it was composed of them
    (``megatron*coshard``'s grid: every coshard knob at its default), whose fastest plans
    :func:`candidates` keeps, so that a product simulates its factors' own best."""
    out = part_masks(space, df)
    factors = space.factors()
    if len(factors) < 2 or len(space.alternatives()) > 1:
        return out
    knobs = space.all_knobs()
    for f in factors:
        if f.name in out:
            continue
        mine = {k.name for k in f.all_knobs()}
        mask = pd.Series(True, index=df.index)
        for k in knobs:
            if k.name not in mine and k.default is not None and k.name in df:
                mask &= df[k.name] == k.default
        out[f.name] = list(mask)
    return out


def part_masks(space: Space, df: pd.DataFrame) -> dict[str, list[bool]]:
    """Rows that belong to each part: a union's alternatives by the ``space`` column; a product's
    parts where every knob of the other parts is at its default (off). One part: empty."""
    alts = space.alternatives()
    if len(alts) > 1:
        col = df["space"] if "space" in df else pd.Series([space.name] * len(df))
        return {a.name: list(col == a.name) for a in alts}
    parts = space.parts()
    if len(parts) < 2:
        return {}
    out = {}
    knobs = space.all_knobs()
    for p in parts:
        mine = {k.name for k in p.all_knobs()}
        others = [k for k in knobs if k.name not in mine and k.default is not None and k.name in df]
        mask = pd.Series(True, index=df.index)
        for k in others:
            mask &= df[k.name] == k.default
        out[p.name] = list(mask)
    return out
