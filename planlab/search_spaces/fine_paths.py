"""The fine-grained program with the pipeline walked: its objective is the walked time of
planlab/search_spaces/fine_walk.py, exactly, as a longest path over the schedule's actions.

A pipeline's actions run in an order fixed by the schedule, whatever the layout; only their
durations depend on it, linearly in each stage's layers ``n_s`` and recomputed layers ``k_s`` and
each device's offloading ``o_d``. The walk ends each action at the later of its device's previous
action and what it waits for (the previous stage's forward, plus a transfer; the next stage's
backward, plus a transfer; its own forward), plus its own duration; the iteration ends at the last
device's sync. That is the longest path through a graph whose shape the schedule fixes, so with one
continuous variable ``e_a`` per action (its end) the rows

    e_a >= e_(device's previous action) + dur_a        e_a >= e_(what a waits for) + hop + dur_a
    W   >= e_(device d's last action) + sync_d         for every device d

hold ``W`` at or above the walked time, and minimizing ``W`` meets it: at any fixed layout the LP
gives the walk (tests/test_fine.py). So the program's LP relaxation is at least as strong as every
chain of actions added as a row (fine11's cutting planes, which one critical path a round did not
converge on 48-chunk interleaved pipelines), and one HiGHS program solves the walked layout, up to
its node limit: :func:`solve_walked`. The memory rows are the program's (planlab/search_spaces/fine.py).
"""

from __future__ import annotations

import math

import numpy as np

from planlab.search_spaces.fine_costs import StageCosts
from planlab.search_spaces.fine_walk import orders_of, walk_paths, walk_s
from planlab.search_spaces.stages import StageLayout

GAP = 1e-3  # relative: HiGHS stops once its layout is this close to its bound (0.1%)
PATH_ROUNDS = 6  # path_bound_s' LPs at most, each after the walk's chains at the last one's layers
PATH_GAIN = 1e-3  # relative: path_bound_s stops once a round lifts its bound less than this
NODE_LIMIT = 200  # branch-and-bound nodes per walked program (deterministic): a node's LP has two rows per action


def actions_of(stages: int, m: int, schedule: str, chunks: int, group: int) -> dict[tuple, int]:
    """Each action of the schedule, ``(stage, phase, micro-batch)``, numbered device by device in the
    order each runs them (fine_walk.orders_of): its end's variable is the program's ``a`` + that number."""
    orders = orders_of(stages, m, schedule, chunks, group)
    return {(x.stage, x.phase, x.microbatch): i for i, x in enumerate(x for o in orders for x in o)}


def _ties_coefs(lp, c: StageCosts) -> np.ndarray:
    """The tie-breaking terms of the walked objective (fine.TIE times a layer's time, its recomputation,
    its sync and offloading's change of it): no needless recomputation or offloading."""
    from planlab.search_spaces.fine import TIE

    cost = np.zeros(lp.nv)
    cost[lp.n : lp.n + lp.stages] = TIE * (c.layer_s + c.sync_s)
    cost[lp.k : lp.k + lp.stages] = TIE * c.recompute_s
    cost[lp.z : lp.z + lp.G] = TIE * (c.offload_sync_s - c.sync_s)
    return cost


def _after(lp, c: StageCosts, stage: int, phase: str, coefs: dict[int, float]) -> float:
    """Take an action's duration (fine_walk.stage_times_s) from ``coefs``' layout terms; its constant."""
    from planlab.search_spaces.fine import stage_extras

    share = c.forward_share if phase == "F" else 1 - c.forward_share
    coefs[lp.n + stage] = coefs.get(lp.n + stage, 0.0) - share * c.layer_s
    if phase == "B":
        coefs[lp.k + stage] = coefs.get(lp.k + stage, 0.0) - c.recompute_s
    return share * stage_extras(c, stage, lp.stages).time_s


def walked_objective(lp, c: StageCosts, m: int, schedule: str, chunks: int, group: int) -> np.ndarray:
    """Add the rows of every action's end and of ``W`` (module docstring) to ``lp``, whose variables
    from ``lp.a`` on are the actions' ends (:func:`actions_of`); the objective ``W`` + ties."""
    from planlab.search_spaces.fine import stage_extras

    S, G = lp.stages, lp.G
    hop_s = c.p2p_s / 2 if G > 1 else 0.0
    index = actions_of(S, m, schedule, chunks, group)
    for d, order in enumerate(orders_of(S, m, schedule, chunks, group)):
        prev = None
        for x in order:
            me = lp.a + index[(x.stage, x.phase, x.microbatch)]
            if x.phase == "F":
                dep = (x.stage - 1, "F", x.microbatch) if x.stage > 0 else None
            else:
                dep = (x.stage + 1, "B", x.microbatch) if x.stage < S - 1 else (x.stage, "F", x.microbatch)
            waits = ([(prev, 0.0)] if prev is not None else []) + (
                [(lp.a + index[dep], hop_s if dep[0] != x.stage else 0.0)] if dep is not None else []
            )
            for before, wait_s in waits or [(None, 0.0)]:  # the first action of all waits for nothing
                coefs = {me: 1.0} | ({before: -1.0} if before is not None else {})
                lp.add(coefs, wait_s + _after(lp, c, x.stage, x.phase, coefs), np.inf)
            prev = me
        mine = range(d, S, G)
        sync = {lp.W: 1.0, prev: -1.0, lp.z + d: -(c.offload_sync_s - c.sync_s)} | {lp.n + s: -c.sync_s for s in mine}
        lp.add(sync, c.unit_sync_s + sum(stage_extras(c, s, S).sync_s for s in mine), np.inf)
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
    """A lower bound on the walked program's objective from its rows alone, without a solver: a
    device's own actions' average (every layer's time over the device groups, nothing recomputed,
    the sync at least 0) and the least ties."""
    from planlab.search_spaces.fine import TIE, stage_extras

    G = stages // chunks
    work_s = layers * c.layer_s + sum(stage_extras(c, s, stages).time_s for s in range(stages))
    return m * work_s / G + TIE * layers * (c.layer_s + c.sync_s + min(0.0, c.offload_sync_s - c.sync_s))


def solve_walked(program: tuple, bar_s: float, relax_first: bool, time_limit_s: float | None = None):
    """The walked program of ``program``, fine.program_arrays' arguments (per-layer costs, layers,
    stages, micro-batches, the device's memory, schedule, chunks and pipeline_group), solved by HiGHS
    (module docstring): ``(layout, its walked objective, the proven lower bound on every layout's,
    status)``; status ``optimal`` (within GAP), ``node limit`` (a layout that may not be the best, and
    HiGHS' bound), ``infeasible`` (no layout fits the memory rows) or ``pruned`` (the LP relaxation
    reached ``bar_s``: no layout of this point beats it). ``relax_first``: solve the LP relaxation
    first and prune on it. ``time_limit_s``: HiGHS' time limit per program besides its node limit
    (wall seconds, so not deterministic: for bounds, where a program stopped early still gives its
    proven bound, never above its optimum; None: the node limit alone)."""
    from scipy.optimize import milp  # on first use: scipy takes a second to import

    from planlab.search_spaces.fine import milp_args

    c, _, stages, m, _, schedule, chunks, group = program
    cost, args, integ, lp = milp_args(*program, walked=True)
    least_s = -math.inf
    if relax_first:
        relaxed = milp(cost, **args)
        if relaxed.x is None:
            return None, math.inf, math.inf, "infeasible"
        least_s = float(relaxed.fun)
        if least_s >= bar_s:
            return None, least_s, least_s, "pruned"
    # the program with only the device groups' totals and offloading integer (each chunk's layers and
    # recomputed layers relaxed): a lower bound that HiGHS proves in few nodes, where the whole program's
    # branch and bound splits each total over the chunks in every way before it lifts its own bound
    limits = {"node_limit": NODE_LIMIT, "mip_rel_gap": GAP} | ({"time_limit": time_limit_s} if time_limit_s else {})
    totals = integ.copy()
    totals[lp.n : lp.n + 2 * stages] = 0
    low = milp(cost, integrality=totals, options=limits, **args)
    if low.status == 2:
        return None, math.inf, math.inf, "infeasible"
    least_s = max(least_s, _proven_s(low))
    if least_s >= bar_s:
        return None, least_s, least_s, "pruned"
    res = milp(cost, integrality=integ, options=limits, **args)
    if res.status == 2:
        return None, math.inf, math.inf, "infeasible"
    least_s = max(least_s, _proven_s(res))
    if res.x is None:
        return None, math.inf, least_s, "node limit"
    x = np.round(res.x).astype(int)
    best = StageLayout(
        layers=tuple(int(v) for v in x[lp.n : lp.n + stages]),
        recompute=tuple(int(v) for v in x[lp.k : lp.k + stages]),
        offload=tuple(bool(v) for v in x[lp.o : lp.o + lp.G]),
    )
    best_s = walk_s(c, best, m, schedule, chunks, group) + ties_s(c, best)  # the LP's W at it, exactly
    least_s = min(least_s, best_s)
    if least_s >= bar_s:
        return None, least_s, least_s, "pruned"
    done = best_s <= least_s * (1 + GAP)
    status = "optimal" if done else "node limit"
    return StageLayout(best.layers, best.recompute, best.offload, done), best_s, least_s, status


def _proven_s(res) -> float:
    """The lower bound HiGHS proved on a program's objective (its dual bound; -inf: none)."""
    dual = getattr(res, "mip_dual_bound", None)
    if dual is not None and not math.isnan(dual):
        return float(dual)
    return float(res.fun) if res.status == 0 and res.x is not None else -math.inf


def first_chains(S: int, m: int, schedule: str, chunks: int, group: int) -> list[tuple]:
    """Per device group, two chains of the walked program's action graph (:func:`path_bound_s`),
    each as ``(forwards per stage, backwards per stage, transfers, the device whose sync ends it)``:
    the forward of the first micro-batch through the stages before the device's first action, the
    device's own actions in order, then either its own sync, or the actions that wait in turn for
    its last one, the rest of the device they reach and that device's sync."""
    G = S // chunks
    orders = [[(x.stage, x.phase, x.microbatch) for x in o] for o in orders_of(S, m, schedule, chunks, group)]
    where = {a: (d, i) for d, o in enumerate(orders) for i, a in enumerate(o)}

    def dep(a: tuple) -> tuple | None:  # what action ``a`` waits for besides its device (walked_objective's)
        s, phase, mb = a
        if phase == "F":
            return (s - 1, "F", mb) if s > 0 else None
        return (s + 1, "B", mb) if s < S - 1 else (s, "F", mb)

    def counts(steps: list[tuple], device: int) -> tuple:
        forwards, backwards, hops = [0] * S, [0] * S, 0
        for i, (s, phase, _) in enumerate(steps):
            (forwards if phase == "F" else backwards)[s] += 1
            hops += G > 1 and i > 0 and dep(steps[i]) == steps[i - 1] and steps[i - 1][0] != s
        return forwards, backwards, hops, device

    waiter = {dep(a): a for a in where if dep(a) is not None}  # each action's one waiter on another's result
    chains = []
    for d, order in enumerate(orders):
        prefix, a = [], dep(order[0])
        while a is not None:
            prefix.insert(0, a)
            a = dep(a)
        chains.append(counts(prefix + order, d))
        suffix, a = [], order[-1]
        while a in waiter:
            a = waiter[a]
            suffix.append(a)
        if suffix:
            e, i = where[suffix[-1]]
            chains.append(counts(prefix + order + suffix + orders[e][i + 1 :], e))
    return chains


def path_bound_s(c: StageCosts, layers: int, stages: int, m: int, schedule: str, chunks: int, group: int = 0) -> float:
    """A lower bound on the walked program's objective, from a few of its chains and a small LP
    (a variable per stage's layers, a row per chain), far cheaper than the program's relaxation
    (a variable per action) and above :func:`walked_bound_s` where the pipeline's fill and drain
    matter. Per device group, two chains of the action graph (module docstring): the forward of
    the first micro-batch through the stages before the device's first action, the device's own
    actions in order, then either its own sync, or the actions that wait in turn for its last
    one (each previous stage's backward of that micro-batch), the rest of the device they reach
    and that device's sync. Each chain is a sum of the program's rows, nothing recomputed (``k``
    >= 0) and the cheaper sync per layer (offloaded or not); the memory rows are dropped. So the
    LP over the layers alone (the program's bounds on them, their sum the model's layers), least
    ``t`` at or above every chain, relaxes the program's LP relaxation and is never above it
    (tests/test_fine.py). inf: no split of the layers meets the bounds."""
    from scipy.optimize import linprog  # on first use: scipy takes a second to import

    from planlab.search_spaces.fine import TIE, stage_extras

    S, G = stages, stages // chunks
    hop_s = c.p2p_s / 2 if G > 1 else 0.0
    extras = [stage_extras(c, s, S) for s in range(S)]
    per_sync_s = min(c.sync_s, c.offload_sync_s)

    def chain_row(forwards, backwards, hops: int, device: int) -> tuple[np.ndarray, float]:
        """A chain's length, linear in the layers per stage: its actions, its transfers, ``device``'s sync."""
        passes = np.array([c.forward_share * f + (1 - c.forward_share) * b for f, b in zip(forwards, backwards)])
        coefs = passes * c.layer_s
        const = hops * hop_s + float(passes @ [e.time_s for e in extras]) + c.unit_sync_s
        for s in range(device, S, G):
            coefs[s] += per_sync_s
            const += extras[s].sync_s
        return coefs, const

    rows = [chain_row(*w) for w in first_chains(S, m, schedule, chunks, group)]
    lower = [1.0] * S
    if chunks > 1:  # the program's bounds (fine.program_arrays): an interleaved end chunk may hold no layer
        lower[0] = lower[-1] = 0.0
    best_s = -math.inf
    for _ in range(PATH_ROUNDS):
        coefs = np.array([list(r) + [-1.0] for r, _ in rows])
        got = linprog(
            np.eye(S + 1)[S],
            A_ub=coefs,
            b_ub=[-const for _, const in rows],
            A_eq=[[1.0] * S + [0.0]],
            b_eq=[layers],
            bounds=[(lo, layers) for lo in lower] + [(0, None)],
            method="highs",
        )
        if got.status == 2:  # infeasible
            return math.inf
        if got.fun <= best_s * (1 + PATH_GAIN):
            break
        best_s = float(got.fun)
        # the chains that set the walk at the LP's (fractional) layers: rows for every layout, as they order
        # the same actions; the next LP moves the layers off them
        at = StageLayout(tuple(float(n) for n in got.x[:S]), (), ())
        rows += [
            chain_row(w.forwards, w.backwards, w.hops, w.device) for w in walk_paths(c, at, m, schedule, chunks, group)
        ]
    return best_s + TIE * layers * (c.layer_s + c.sync_s + min(0.0, c.offload_sync_s - c.sync_s))


CHAIN_ROUNDS = 16  # chains_program's rounds at most: each adds the walk's chains at the last solution


def chains_program(program: tuple, bar_s: float, integral: bool, node_limit: int = NODE_LIMIT):
    """A lower bound on the walked program of ``program`` (solve_walked's), from its own variables
    and rows but the actions': the layers, recomputed layers and offloading per stage and device,
    the memory rows at every peak, and ``W`` held at or above a few chains of the action graph
    (:func:`first_chains`, then each round the walk's chains at the last solution), each chain's
    length the sum of its actions' rows, recomputation and offloading included. Every chain is
    a path the walked program's rows hold ``W`` above, whatever the layout, so this program
    relaxes the walked one and its LP relaxation the walked one's (tests/test_fine.py), at a
    fraction of their size: a row per chain where the walked program has two per action.
    ``integral``: the layers, recomputation and offloading integer (HiGHS, ``node_limit`` nodes,
    its proven bound), and each round's layout walked exactly. Stops once the bound reaches
    ``bar_s``, the rounds run out, or (``integral``) a layout
    walks within GAP of the bound (not: the walk at the LP's point within GAP of its ``W``, the
    walked program's relaxation reached). Returns ``(bound, layout, its walked objective)``: the bound
    inf when no layout fits the memory rows; the layout None (and inf) when none was found."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import csr_array, vstack

    from planlab.search_spaces.fine import program_arrays, stage_extras

    c, layers, S, m, cap_bytes, schedule, chunks, group = program
    _, rows, lower, upper, integ, lp = program_arrays(c, layers, S, m, cap_bytes, schedule, chunks, group)
    G, hop_s = lp.G, (c.p2p_s / 2 if lp.G > 1 else 0.0)
    extras = [stage_extras(c, s, S) for s in range(S)]
    cost = _ties_coefs(lp, c)
    cost[lp.W] = 1.0

    def chain_row(forwards, backwards, hops: int, device: int) -> tuple[np.ndarray, float]:
        """``W`` - the chain's length >= its constant: walked_objective's rows summed along the chain."""
        row = np.zeros(lp.nv)
        passes = np.array([c.forward_share * f + (1 - c.forward_share) * b for f, b in zip(forwards, backwards)])
        row[lp.W] = 1.0
        row[lp.n : lp.n + S] = -passes * c.layer_s
        row[lp.k : lp.k + S] = -np.array(backwards, dtype=float) * c.recompute_s
        row[lp.z + device] = -(c.offload_sync_s - c.sync_s)
        const = hops * hop_s + float(passes @ [e.time_s for e in extras]) + c.unit_sync_s
        for s in range(device, S, G):
            row[lp.n + s] -= c.sync_s
            const += extras[s].sync_s
        return row, const

    chains = [chain_row(*w) for w in first_chains(S, m, schedule, chunks, group)]
    least_s, best, best_s = -math.inf, None, math.inf
    options = {"node_limit": node_limit, "mip_rel_gap": GAP} if integral else {}
    for _ in range(CHAIN_ROUNDS):
        matrix = vstack([rows, csr_array(np.array([r for r, _ in chains]))])
        lo = np.concatenate([lp.lo, [b for _, b in chains]])
        hi = np.concatenate([lp.hi, [np.inf] * len(chains)])
        res = milp(
            cost,
            constraints=LinearConstraint(matrix, lo, hi),
            bounds=Bounds(lower, upper),
            integrality=integ if integral else None,
            options=options,
        )
        if res.status == 2:  # infeasible: no layout fits the memory rows
            return math.inf, None, math.inf
        least_s = max(least_s, _proven_s(res))  # each round's program relaxes the walked one: every bound holds
        if least_s >= bar_s or res.x is None:
            break
        x = np.round(res.x) if integral else res.x
        at = StageLayout(
            tuple(float(v) for v in x[lp.n : lp.n + S]),
            tuple(float(v) for v in x[lp.k : lp.k + S]),
            tuple(bool(v > 0.5) for v in x[lp.o : lp.o + G]),
        )
        paths = walk_paths(c, at, m, schedule, chunks, group)
        if integral:
            layout = StageLayout(
                tuple(int(v) for v in at.layers), tuple(int(v) for v in at.recompute), at.offload, False
            )
            walked_s = max(p.time_s for p in paths) + ties_s(c, layout)
            if walked_s < best_s:
                best, best_s = layout, walked_s
            if best_s <= least_s * (1 + GAP):
                break
        elif max(p.time_s for p in paths) + ties_s(c, at) <= res.fun * (1 + GAP):
            break  # the walk at the LP's point is its W: the walked program's relaxation is reached
        chains += [chain_row(w.forwards, w.backwards, w.hops, w.device) for w in paths]
    least_s = min(least_s, best_s)  # a layout walked is a bound of its own (HiGHS' tolerances aside)
    if best is not None:
        best = StageLayout(best.layers, best.recompute, best.offload, best_s <= least_s * (1 + GAP))
    return least_s, best, best_s
