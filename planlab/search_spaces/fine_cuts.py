"""The fine-grained program with the pipeline walked: its objective is the walked time, found by
adding critical paths as rows (a cutting-plane loop over planlab/search_spaces/fine_walk.py).

A pipeline's actions run in an order fixed by the schedule, whatever the layout; only their
durations depend on it, linearly in each stage's layers ``n_s`` and recomputed layers ``k_s`` and
each device's offloading ``o_d``. So the walked time of any layout is at least the length of any
chain of actions (each device's own actions in order, or the critical path of another layout's
walk), a linear function of the layout: a row ``W >= chain`` is valid for every layout, and the
program minimizing ``W`` over some of them bounds the walked time from below. :func:`solve_walked`
solves it, walks the layout it finds, and adds that walk's critical path, until the layout's walked
time meets the program's bound (that layout is then the walked best, up to HiGHS' gap) or
``CUT_LIMIT`` rounds pass (the best walked layout so far, and the proven bound). The memory rows
are the program's (planlab/search_spaces/fine.py).
"""

from __future__ import annotations

import math

import numpy as np

from planlab.search_spaces.fine_costs import StageCosts
from planlab.search_spaces.fine_walk import Walk, walk
from planlab.search_spaces.stages import StageLayout

CUT_LIMIT = 40  # walks (critical paths added) per program before it stops with the best walked layout
GAP = 1e-3  # relative: a walked time this close to the program's bound is taken as its optimum (0.1%)


def _ties_coefs(lp, c: StageCosts) -> np.ndarray:
    """The tie-breaking terms of the walked objective (fine.TIE times a layer's time, its recomputation,
    its sync and offloading's change of it): no needless recomputation or offloading."""
    from planlab.search_spaces.fine import TIE

    cost = np.zeros(lp.nv)
    cost[lp.n : lp.n + lp.stages] = TIE * (c.layer_s + c.sync_s)
    cost[lp.k : lp.k + lp.stages] = TIE * c.recompute_s
    cost[lp.z : lp.z + lp.G] = TIE * (c.offload_sync_s - c.sync_s)
    return cost


def chain_row(lp, c: StageCosts, w: Walk) -> None:
    """``W >=`` the length of ``w``'s chain: its forwards and backwards per stage, its transfers, and
    its device's sync (fine_walk.py's module docstring prices each)."""
    from planlab.search_spaces.fine import stage_extras

    S, G, share = lp.stages, lp.G, c.forward_share
    coefs, const = {lp.W: 1.0}, 0.0
    for s in range(S):
        f, b = w.forwards[s], w.backwards[s]
        busy = f * share + b * (1 - share)  # times the stage's e_s + n_s l
        const += busy * stage_extras(c, s, S).time_s
        coefs[lp.n + s] = -busy * c.layer_s
        coefs[lp.k + s] = -b * c.recompute_s
    const += w.hops * (c.p2p_s / 2 if G > 1 else 0.0)
    d = w.device
    const += c.unit_sync_s + sum(stage_extras(c, s, S).sync_s for s in range(d, S, G))
    for s in range(d, S, G):
        coefs[lp.n + s] -= c.sync_s
    coefs[lp.z + d] = -(c.offload_sync_s - c.sync_s)
    lp.add(coefs, const, np.inf)


def device_chains(stages: int, groups: int, m: int, d: int) -> tuple[Walk, ...]:
    """Chains through device ``d``'s own actions, one after the other (every micro-batch's forward and
    backward on each of its stages): then its sync; and, since its first action is the first
    micro-batch's forward on its first stage and its last the last one's backward there (1F1B,
    GPipe and interleaved 1F1B alike), after that micro-batch's forwards on the stages before it and
    before the last one's backwards there, then the first device's sync."""
    mine = tuple(m if s % groups == d else 0 for s in range(stages))
    own = Walk(math.nan, mine, mine, 0, d)
    if d == 0:
        return (own,)
    through = tuple(n + (1 if s < d else 0) for s, n in enumerate(mine))
    return own, Walk(math.nan, through, through, 2 * d, 0)


def walked_objective(lp, c: StageCosts, m: int, cuts: tuple[Walk, ...]) -> np.ndarray:
    """Add the rows of each device's chains and of ``cuts`` to ``lp``; the objective ``W`` + ties."""
    for d in range(lp.G):
        for w in device_chains(lp.stages, lp.G, m, d):
            chain_row(lp, c, w)
    for w in cuts:
        chain_row(lp, c, w)
    cost = _ties_coefs(lp, c)
    cost[lp.W] = 1.0
    return cost


def ties_s(c: StageCosts, layout: StageLayout) -> float:
    """The tie-breaking terms of the walked objective at ``layout``."""
    from planlab.search_spaces.fine import TIE

    n, k, G = sum(layout.layers), sum(layout.recompute or (0,)), len(layout.offload)
    z = sum(layout.layers[s] for s in range(len(layout.layers)) if G and layout.offloads(s % G))
    return TIE * (n * (c.layer_s + c.sync_s) + k * c.recompute_s + z * (c.offload_sync_s - c.sync_s))


def walked_bound_s(c: StageCosts, layers: int, stages: int, m: int, chunks: int = 1) -> float:
    """A lower bound on the walked program's objective from its rows alone, without a solver: the
    device chains' average (every layer's time over the device groups, nothing recomputed, the sync
    at least 0) and the least ties."""
    from planlab.search_spaces.fine import TIE, stage_extras

    G = stages // chunks
    work_s = layers * c.layer_s + sum(stage_extras(c, s, stages).time_s for s in range(stages))
    return m * work_s / G + TIE * layers * (c.layer_s + c.sync_s + min(0.0, c.offload_sync_s - c.sync_s))


def _chain(w: Walk) -> tuple:
    """What makes ``w`` a row: its actions, transfers and sync (not the time it was walked at)."""
    return w.forwards, w.backwards, w.hops, w.device


def solve_walked(program: tuple, bar_s: float, relax_first: bool, start: tuple[Walk, ...] = ()):
    """The walked program of ``program``, fine.program_arrays' arguments (per-layer costs, layers,
    stages, micro-batches, the device's memory, schedule, chunks and pipeline_group), solved by
    adding critical paths (module docstring): ``(layout, its walked
    objective, the proven lower bound on every layout's, status, the chains its rows held)``; status
    ``optimal``, ``cut limit`` or ``node limit`` (a layout that may not be the best), ``infeasible``
    (no layout fits the memory rows) or ``pruned`` (the bound reached ``bar_s``: no layout of this
    point beats it). ``relax_first``: solve the LP relaxation first and prune on it. ``start``: chains
    to begin with, walked at any program of the same pipeline shape (stages, micro-batches, schedule,
    chunks and group: the order of actions, so the chains, are the same; their rows are priced with
    this program's costs), which saves the rounds that would find them again."""
    from scipy.optimize import milp  # on first use: scipy takes a second to import

    from planlab.search_spaces.fine import NODE_LIMIT, milp_args

    c, _, stages, m, _, schedule, chunks, group = program
    cuts: list[Walk] = list(start)
    best, best_s, least_s, status = None, math.inf, -math.inf, "cut limit"
    if relax_first:
        cost, args, _, _ = milp_args(*program, walked=True, cuts=tuple(cuts))
        relaxed = milp(cost, **args)
        if relaxed.x is None:
            return None, math.inf, math.inf, "infeasible", tuple(cuts)
        least_s = float(relaxed.fun)
        if least_s >= bar_s:
            return None, least_s, least_s, "pruned", tuple(cuts)
    for _ in range(CUT_LIMIT):
        cost, args, integ, lp = milp_args(*program, walked=True, cuts=tuple(cuts))
        res = milp(cost, integrality=integ, options={"node_limit": NODE_LIMIT}, **args)
        if res.status == 2 or res.x is None:  # infeasible, or the node limit before any layout
            if best is None:
                return (
                    None,
                    math.inf,
                    (math.inf if res.status == 2 else least_s),
                    ("infeasible" if res.status == 2 else "node limit"),
                    tuple(cuts),
                )
            status = "node limit"
            break
        limited = res.status == 1
        dual = getattr(res, "mip_dual_bound", None)
        proven = float(dual) if limited and dual is not None and not math.isnan(dual) else float(res.fun)
        least_s = max(least_s, proven)
        x = np.round(res.x).astype(int)
        layout = StageLayout(
            layers=tuple(int(v) for v in x[lp.n : lp.n + stages]),
            recompute=tuple(int(v) for v in x[lp.k : lp.k + stages]),
            offload=tuple(bool(v) for v in x[lp.o : lp.o + lp.G]),
        )
        # the critical path only: every device's chain as a row each made HiGHS' programs slower (1.3x)
        walked = walk(c, layout, m, schedule, chunks, group)
        got_s = walked.time_s + ties_s(c, layout)
        if got_s < best_s:
            best, best_s = layout, got_s
        if least_s >= bar_s:
            return None, least_s, least_s, "pruned", tuple(cuts)
        if best_s <= least_s * (1 + GAP):
            status = "node limit" if limited else "optimal"
            break
        if all(_chain(w) != _chain(walked) for w in cuts):  # a start chain may be this layout's critical path
            cuts.append(walked)
    least_s = min(least_s, best_s)
    proven = status == "optimal"
    return StageLayout(best.layers, best.recompute, best.offload, proven), best_s, least_s, status, tuple(cuts)
