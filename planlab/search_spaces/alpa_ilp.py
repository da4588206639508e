"""The integer programs of the ``alpa`` space: Alpa's intra-operator pass and its stage slicing.

:func:`solve_strategies` picks one strategy per node of a graph (an operator's split over the
stage's mesh) minimising the nodes' costs (compute, gradient synchronisation) plus the edges'
costs (the resharding between a producer's strategy and a consumer's), under a memory bound, as
Alpa (Zheng et al., OSDI 2022, section 4.2) does: binaries ``x[v, s]`` (node ``v`` takes strategy
``s``, one per node) and, per edge ``(u, v)``, variables ``e[u, v, s, t]`` linearising the
product ``x[u, s] x[v, t]`` by ``sum_t e = x[u, s]`` and ``sum_s e = x[v, t]`` (with ``x``
binary, ``e`` is then 0/1 without being declared integer). It is solved by
``scipy.optimize.milp`` (HiGHS).

:func:`slice_stages` is the inter-operator pass: a dynamic program cutting a sequence of layers
into contiguous pipeline stages minimising ``sum_s t_s + (M - 1) max_s t_s`` (the pipeline's
latency with ``M`` micro-batches), over every candidate bound on ``max_s t_s``, as Alpa's
section 5.2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from planlab.errors import InfeasiblePlan, InternalError


@dataclass(frozen=True)
class Edge:
    """Costs between node ``src``'s strategies (rows) and node ``dst``'s (columns)."""

    src: int
    dst: int
    cost: np.ndarray  # shape (strategies of src, strategies of dst)


@dataclass(frozen=True)
class Solution:
    """One strategy per node, the objective and the memory the chosen strategies use."""

    choice: tuple[int, ...]
    objective: float
    memory: float


def solve_strategies(
    node_cost: Sequence[np.ndarray],
    edges: Sequence[Edge],
    *,
    node_memory: Sequence[np.ndarray] | None = None,
    memory_bound: float = math.inf,
    time_limit_s: float = 10.0,
) -> Solution | None:
    """The strategy per node minimising node and edge costs with ``sum memory <= memory_bound``;
    None when no choice fits the bound. ``node_cost[v][s]``: node ``v`` under strategy ``s``."""
    from scipy.optimize import Bounds, LinearConstraint, milp  # on first use: scipy takes a second to import
    from scipy.sparse import coo_matrix

    n_nodes = len(node_cost)
    offs = np.cumsum([0] + [len(c) for c in node_cost])
    nx = int(offs[-1])
    # self edges (a node feeding itself, e.g. one layer's operator feeding the same operator of
    # the next layer) are linear: their diagonal goes to the node's cost
    costs = [np.asarray(c, dtype=float).copy() for c in node_cost]
    pair_edges: dict[tuple[int, int], np.ndarray] = {}
    for e in edges:
        m = np.asarray(e.cost, dtype=float)
        if m.shape != (len(costs[e.src]), len(costs[e.dst])):
            raise InternalError(
                f"edge {e.src}->{e.dst}: cost shape {m.shape}, expected {(len(costs[e.src]), len(costs[e.dst]))}"
            )
        if e.src == e.dst:
            costs[e.src] += np.diag(m)
            continue
        key = (e.src, e.dst)
        pair_edges[key] = pair_edges[key] + m if key in pair_edges else m
    # an edge whose cost does not depend on the pair adds nothing to choose: fold constant rows
    e_offs, ne = [], nx
    kept = []
    for (u, v), m in pair_edges.items():
        if m.size and np.ptp(m) == 0:
            costs[u] += float(m.flat[0])
            continue
        kept.append((u, v, m))
        e_offs.append(ne)
        ne += m.size
    c = np.concatenate([costs[v] for v in range(n_nodes)] + [m.ravel() for _, _, m in kept]) if ne else np.zeros(0)
    rows, cols, vals, lo, hi = [], [], [], [], []
    r = 0
    for v in range(n_nodes):  # one strategy per node
        for s in range(len(costs[v])):
            rows.append(r), cols.append(offs[v] + s), vals.append(1.0)
        lo.append(1.0), hi.append(1.0)
        r += 1
    for (u, v, m), base in zip(kept, e_offs):
        nu, nv = m.shape
        # sum_t e[s, t] = x[u, s] for every s, then sum_s e[s, t] = x[v, t] for every t
        for own, other, x0, at in (
            (nu, nv, offs[u], lambda i, j: i * nv + j),
            (nv, nu, offs[v], lambda i, j: j * nv + i),
        ):
            for i in range(own):
                for j in range(other):
                    rows.append(r), cols.append(base + at(i, j)), vals.append(1.0)
                rows.append(r), cols.append(x0 + i), vals.append(-1.0)
                lo.append(0.0), hi.append(0.0)
                r += 1
    mem = None
    if node_memory is not None:
        mem = np.concatenate([np.asarray(m, dtype=float) for m in node_memory])
        if math.isfinite(memory_bound):
            for j in range(nx):
                rows.append(r), cols.append(j), vals.append(float(mem[j]))
            lo.append(-np.inf), hi.append(float(memory_bound))
            r += 1
    a = coo_matrix((vals, (rows, cols)), shape=(r, ne)).tocsr()
    integrality = np.zeros(ne)
    integrality[:nx] = 1
    res = milp(
        c,
        constraints=LinearConstraint(a, lo, hi),
        integrality=integrality,
        bounds=Bounds(0, 1),
        options={"time_limit": time_limit_s, "disp": False},
    )
    if res.x is None:
        return None
    x = res.x[:nx]
    choice = tuple(int(np.argmax(x[offs[v] : offs[v + 1]])) for v in range(n_nodes))
    used = float(sum(node_memory[v][s] for v, s in enumerate(choice))) if node_memory is not None else 0.0
    return Solution(choice, float(res.fun), used)


def evaluate(choice: Sequence[int], node_cost: Sequence[np.ndarray], edges: Sequence[Edge]) -> float:
    """The objective of one choice (to check a solution by hand)."""
    return float(
        sum(node_cost[v][s] for v, s in enumerate(choice)) + sum(e.cost[choice[e.src], choice[e.dst]] for e in edges)
    )


@dataclass(frozen=True)
class Slicing:
    """Layers ``[bounds[s], bounds[s + 1])`` form stage ``s``; ``times_s`` per stage and the
    pipeline's latency ``sum + (M - 1) max``."""

    bounds: tuple[int, ...]
    times_s: tuple[float, ...]
    latency_s: float


def slice_stages(
    stage_time_s: Callable[[int, int, int], float], layers: int, stages: int, microbatches: int
) -> Slicing:
    """Contiguous layer ranges, one per stage (each at least one layer), minimising
    ``sum_s t_s + (microbatches - 1) max_s t_s``; ``stage_time_s(first, stop, stage)`` is the
    time of layers ``[first, stop)`` as stage ``stage`` per micro-batch (``inf``: infeasible,
    e.g. out of memory). InfeasiblePlan when no slicing is feasible."""
    if not 1 <= stages <= layers:
        raise InfeasiblePlan(f"{stages} pipeline stages cannot hold {layers} layers (each stage needs one)")
    t = np.full((stages, layers + 1, layers + 1), np.inf)
    for s in range(stages):  # the first stage starts at layer 0, the last ends at the last layer
        for a in range(s, layers - (stages - s) + 1) if s else (0,):
            for b in range(a + 1, layers - (stages - s - 1) + 1) if s < stages - 1 else (layers,):
                t[s, a, b] = stage_time_s(a, b, s)
    bounds_all = np.unique(t[np.isfinite(t)])
    best: tuple[float, tuple[int, ...]] | None = None
    for tmax in bounds_all:  # ascending: stop once the bubble term alone exceeds the best
        if best is not None and (microbatches - 1) * tmax >= best[0]:
            break
        tt = np.where(t <= tmax, t, np.inf)
        f = np.full((stages + 1, layers + 1), np.inf)  # f[s, i]: s stages over the first i layers
        arg = np.zeros((stages + 1, layers + 1), dtype=int)
        f[0, 0] = 0.0
        for s in range(1, stages + 1):
            for i in range(s, layers + 1):
                cand = f[s - 1, :i] + tt[s - 1, :i, i]
                j = int(np.argmin(cand))
                f[s, i], arg[s, i] = cand[j], j
        if not np.isfinite(f[stages, layers]):
            continue
        total = float(f[stages, layers] + (microbatches - 1) * tmax)
        if best is None or total < best[0] - 1e-15:
            cuts, i = [layers], layers
            for s in range(stages, 0, -1):
                i = int(arg[s, i])
                cuts.append(i)
            best = (total, tuple(reversed(cuts)))
    if best is None:
        raise InfeasiblePlan(f"no slicing of {layers} layers into {stages} stages fits (every stage is out of memory)")
    b = best[1]
    times = tuple(float(t[s, b[s], b[s + 1]]) for s in range(stages))
    return Slicing(b, times, sum(times) + (microbatches - 1) * max(times))
