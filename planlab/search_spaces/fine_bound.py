"""A bound over a whole grid on what the fine-grained space can win, in its integer program's model.

For every grid point the fine space would lay out (planlab/search_spaces/fine.py), the least
objective any layout of that point reaches is at least its program's LP relaxation, which is at
least the solver-free ``balanced_bound_s``. So the least LP relaxation over the points bounds, from
below, every layout of every point: :func:`grid_bound` finds it exactly while solving few LPs (the
points in increasing order of their balanced bound, until that bound reaches the least LP found).
:func:`grid_plan_cost` prices a plan of the grid itself in the same model (its own layers per
stage, its recomputation and offloading), so their ratio is the largest speedup the fine space
could find over that plan as its program sees it. The program's model is the screen's; the
simulator judges the plans, so a caller states the gap between the two at the plan it prices.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass


from planlab.search_spaces.builtin import LAYER_MODULE
from planlab.errors import ConfigError
from planlab.search_spaces.fine import (
    FINE_SCHEDULES,
    PROGRAM,
    NODE_LIMIT,
    FineStages,
    fine_cost_model,
    milp_args,
    balanced_bound_s,
    point_costs,
)
from planlab.search_spaces.fine_costs import StageCosts
from planlab.search_spaces.fine_paths import chains_program, path_bound_s, solve_walked, ties_s, walked_bound_s
from planlab.search_spaces.fine_walk import walk_s
from planlab.search_spaces.space import Context, Draft, Space
from planlab.search_spaces.stages import StageLayout

NO_MEMORY_BYTES = 1e30  # a device memory no plan reaches: the program's time without its memory rows
PROGRAM_TIME_S = 120.0  # grid_bound's walked integer program stops here (wall s), keeping HiGHS' proven bound


@dataclass(frozen=True)
class Point:
    """What a grid point's program is made of: the per-layer costs and the pipeline's shape."""

    costs: StageCosts
    layers: int
    stages: int
    microbatches: int
    schedule: str
    chunks: int
    group: int = 0  # interleaved 1F1B's micro-batches a chunk in a row (Llama 3's N; 0: the device groups)
    walked: bool = True  # the pipeline walked action by action (fine_paths.py); False: fine.py's closed form

    @classmethod
    def of(cls, draft: Draft, offload: bool, walked: bool = True) -> Point:
        """The program of ``draft``'s grid point (the costs from the graph's memo)."""
        return cls(
            point_costs(draft, offload),
            draft.ctx.layers,
            draft.num_stages,
            draft.microbatches,
            draft.schedule,
            draft.chunks,
            draft.group,
            walked,
        )

    def milp_args(self, cap_bytes: float, layout: StageLayout | None = None):
        """HiGHS' arguments for this point's program (``fine.milp_args``)."""
        program = (self.costs, self.layers, self.stages, self.microbatches, cap_bytes, self.schedule, self.chunks)
        return milp_args(*program, self.group, layout=layout, walked=self.walked)

    def walk_s(self, layout: StageLayout) -> float:
        """``layout``'s iteration time with its pipeline walked action by action (fine_walk.py)."""
        return walk_s(self.costs, layout, self.microbatches, self.schedule, self.chunks, self.group)

    def balanced_s(self) -> float:
        """The solver-free lower bound (``fine.balanced_bound_s``, or ``fine_paths.walked_bound_s``)."""
        bound = walked_bound_s if self.walked else balanced_bound_s
        return bound(self.costs, self.layers, self.stages, self.microbatches, self.chunks)

    def chains_s(self) -> float:
        """A lower bound from a few chains of the walked program and an LP over the layers alone
        (``fine_paths.path_bound_s``): never above :meth:`relaxed_s`, at a fraction of its cost, and
        above :meth:`balanced_s` where the pipeline's fill and drain matter; the closed form's, its
        balanced bound."""
        if not self.walked:
            return self.balanced_s()
        return path_bound_s(
            self.costs, self.layers, self.stages, self.microbatches, self.schedule, self.chunks, self.group
        )

    def chains_program(self, cap_bytes: float, bar_s: float, integral: bool) -> tuple[float, float]:
        """The program over the layers, recomputation, offloading and memory rows alone, ``W`` held
        above chains of the walk (``fine_paths.chains_program``): a lower bound on every layout's
        objective (inf: none fits), never above :meth:`relaxed_s` (``integral`` False) or the
        integer program's optimum (True), and the walked objective of the best layout it found
        (inf: none). Walked points only (the closed form's: its balanced bound)."""
        if not self.walked:
            return self.balanced_s(), math.inf
        p = self
        program = (p.costs, p.layers, p.stages, p.microbatches, cap_bytes, p.schedule, p.chunks, p.group)
        least_s, _, found_s = chains_program(program, bar_s, integral)
        return least_s, found_s

    def relaxed_s(self, cap_bytes: float) -> float:
        """The LP relaxation's objective: no layout of this point has a smaller one (inf: none fits)."""
        return _solved_s(self, cap_bytes, None)

    def layout_s(self, cap_bytes: float, layout: StageLayout) -> float:
        """The program's objective at ``layout`` (inf: it breaks the program's memory rows); walked,
        the walk's time and the ties."""
        got = _solved_s(self, cap_bytes, layout)
        if not self.walked or not math.isfinite(got):
            return got
        return self.walk_s(layout) + ties_s(self.costs, layout)

    def integer(
        self, cap_bytes: float, bar_s: float = math.inf, time_limit_s: float | None = None
    ) -> tuple[float, float]:
        """The program solved (HiGHS, ``fine.NODE_LIMIT`` nodes; walked, fine_paths.solve_walked's,
        stopped after ``time_limit_s`` if given): its best layout's objective (inf: none found, or
        walked and its proven bound reached ``bar_s``) and a proven lower bound on every layout's
        (inf: none fits), HiGHS' own bound when it stopped short."""
        from scipy.optimize import milp

        if self.walked:
            p = self
            program = (p.costs, p.layers, p.stages, p.microbatches, cap_bytes, p.schedule, p.chunks, p.group)
            got = solve_walked(program, bar_s, False, time_limit_s)
            return (got[1] if got[0] is not None else math.inf), got[2]
        cost, args, integ, _ = self.milp_args(cap_bytes)
        res = milp(cost, integrality=integ, options={"node_limit": NODE_LIMIT}, **args)
        if res.status == 2:  # HiGHS: infeasible
            return math.inf, math.inf
        found = math.inf if res.x is None else float(res.fun)
        dual = float(getattr(res, "mip_dual_bound", None) or -math.inf)
        return found, min(found, dual if not math.isnan(dual) else -math.inf)


def _solved_s(p: Point, cap_bytes: float, layout: StageLayout | None) -> float:
    """The LP of ``p``'s program, with its integers fixed at ``layout`` (None: relaxed); its objective."""
    from scipy.optimize import milp  # on first use: scipy takes a second to import

    cost, args, _, _ = p.milp_args(cap_bytes, layout)
    res = milp(cost, **args)
    return math.inf if res.x is None else float(res.fun)


@dataclass(frozen=True)
class GridBound:
    """What every fine layout of every point of a grid reaches at best in the program's model:
    ``least_s``, a proven lower bound (inf: no point fits); ``best_s``, the best layout found
    (equal to ``least_s`` up to HiGHS' gap when every program it solved finished), at the point
    ``knobs`` (empty: the incumbent given, which no layout found beats); ``least_lp_s``, the least
    LP relaxation solved (a weaker bound, for reference); how many
    points were bounded, LP relaxations and integer programs solved, and how many of these
    stopped at the node limit before proving their optimum; ``chains``, how many points were
    bounded by their chains (``Point.chains_s``), of which the others needed their LP relaxation;
    ``chain_lps`` and ``chain_programs``, how many points' chains programs (``Point.chains_program``)
    were solved, relaxed and integer, before their walked program's relaxation (``lps``) and
    integer program (``programs``)."""

    least_s: float
    best_s: float
    knobs: dict
    least_lp_s: float
    points: int
    lps: int
    programs: int
    node_limited: int
    chains: int = 0
    chain_lps: int = 0
    chain_programs: int = 0


def fine_points(ctx: Context, grid: Space, fixed: dict | None = None) -> Iterator[tuple[dict, Draft]]:
    """The grid points ``grid * fine`` lays out with ``fine_layout=program`` (offloading allowed
    where the cluster has a host side), each with the grid's draft of it (no program solved), one
    at a time (a draft holds a stage per operator)."""
    fine = FineStages()
    offload = fine_cost_model(ctx).cluster.node.host is not None
    pinned = {**(fixed or {}), "fine_layout": PROGRAM, "fine_offload": offload}
    mine = {k.name for k in grid.all_knobs()}
    for a in (grid * fine).assignments(ctx, pinned):
        knobs = {k: v for k, v in a.items() if k in mine}
        draft = grid.draft(ctx, knobs)
        if not (draft.vshape or draft.mirror or draft.spread or draft.recycles > 1):
            yield knobs, draft


def grid_bound(
    ctx: Context, grid: Space, fixed: dict | None = None, incumbent_s: float = math.inf, enough_s: float = math.inf
) -> GridBound:
    """The best any fine layout of any of ``grid``'s points can reach in the program's model (the
    module docstring), solving few programs: the points in increasing order of their balanced
    bound; each point's LP relaxation, and its integer program where that relaxation is under the
    best layout found so far; until the next balanced bound is at least that best layout (no later
    point can beat it). Before a point's LP relaxation come cheaper bounds, each a relaxation of
    it or of its integer program: its chains' bound (``Point.chains_s``), then its chains program
    (``Point.chains_program``) relaxed and integer, the layouts it finds walked as incumbents; each
    next step is taken only where the bounds so far are under the best so far (or ``enough_s``),
    and the walked integer program stops after PROGRAM_TIME_S with HiGHS' proven bound. ``least_lp_s``
    is the least LP bound solved (the chains program's relaxation or the walked one's): a weaker
    bound, for reference (every point not relaxed has a bound of at least the best layout). ``incumbent_s``: the objective of a layout known beforehand (the grid best's own,
    ``grid_plan_cost``), the best so far from the start: the points that cannot beat it are pruned
    from the first, and ``knobs`` stays empty when no layout found beats it. ``enough_s``: a bound that is
    enough (the incumbent over a target speedup): a point whose bound reaches it is solved no
    further, and the points are taken only until their balanced bound does, so ``least_s`` is the
    exact bound or, when that is over ``enough_s``, at least ``enough_s``."""
    cap = fine_cost_model(ctx).device_memory_bytes
    offload = fine_cost_model(ctx).cluster.node.host is not None
    ranked = []
    for i, (knobs, draft) in enumerate(fine_points(ctx, grid, fixed)):
        p = Point.of(draft, offload)
        ranked.append((p.balanced_s(), i, knobs, p))
    ranked.sort(key=lambda t: (t[0], t[1]))
    best, least, least_lp, where = incumbent_s, math.inf, math.inf, {}
    lps = programs = limited = chained = chain_lps = chain_programs = 0
    for balanced, _, knobs, p in ranked:
        if balanced >= min(best, enough_s):
            break
        # each step a proven lower bound on this point's layouts, each dearer than the last and taken only
        # while the bounds so far are under the bar (the best so far, or enough): the chains' LP over the
        # layers alone, the chains program's LP and integer program (the memory rows and recomputation
        # too), then the walked program's relaxation and its integer program, stopped at PROGRAM_TIME_S
        chained += 1
        lower = p.chains_s()
        if lower < min(best, enough_s):
            chain_lps += 1
            lower = max(lower, p.chains_program(cap, min(best, enough_s), False)[0])
            least_lp = min(least_lp, lower)
        if lower < min(best, enough_s):
            chain_programs += 1
            proven, found = p.chains_program(cap, min(best, enough_s), True)
            lower = max(lower, proven)
            if found < best:
                best, where = found, knobs
            if found <= lower * (1 + 2e-3):  # solved within HiGHS' gap: no further bound needed
                least = min(least, lower)
                continue
        if lower < min(best, enough_s):
            lps += 1
            relaxed = p.relaxed_s(cap)
            least_lp = min(least_lp, relaxed)
            lower = max(lower, relaxed)
        if lower >= min(best, enough_s):
            least = min(least, lower)
            continue
        programs += 1
        # pruned (inf found) once proven at least the best so far
        found, proven = p.integer(cap, min(best, enough_s), PROGRAM_TIME_S)
        proven = max(proven, lower)  # both bound the point's layouts from below
        limited += math.isfinite(found) and found > proven * (1 + 2e-3)
        least = min(least, proven)
        if found < best:
            best, where = found, knobs
    # every point not reached has a balanced bound of at least best (or enough): least stays a bound for them
    return GridBound(
        min(least, best, enough_s),
        best,
        where,
        least_lp,
        len(ranked),
        lps,
        programs,
        limited,
        chained,
        chain_lps,
        chain_programs,
    )


def draft_layout(draft: Draft, recompute_all: bool, offload: bool) -> StageLayout:
    """``draft``'s own layout: its layers per stage (model chunk), all of them recomputed in full
    or none, its optimizer offloaded on every device group or none."""
    per = [set() for _ in range(draft.num_stages)]
    for op in draft.ctx.graph.operators:
        m = LAYER_MODULE.search(op.module)
        if m:
            per[draft.stages.get(op.name, 0)].add(int(m.group(2)))
    layers = tuple(len(s) for s in per)
    return StageLayout(layers, layers if recompute_all else (), (offload,) * draft.groups)


def grid_plan_cost(ctx: Context, grid: Space, knobs: dict, walked: bool = True) -> tuple[float, bool, StageLayout]:
    """A plan of ``grid`` (its knobs) in the fine program's model: its objective, whether it fits
    the program's memory rows (if not, the objective is taken without them), and its layout. Its
    point is the one the fine space would lay out: ``recompute=full`` is the base ``none`` with
    every layer recomputed, ``offload_optimizer`` every device group offloading, and its layers
    per stage are the plan's."""
    own = grid.draft(ctx, grid.with_defaults(knobs))
    full, offload = knobs.get("recompute") == "full", bool(knobs.get("offload_optimizer"))
    if own.schedule not in FINE_SCHEDULES:
        raise ConfigError(f"schedule {own.schedule!r}: the fine program lays out {', '.join(FINE_SCHEDULES)} only")
    # the probe is priced from the mesh, the micro-batches, ZeRO and the base recomputation, not the stages
    point = {**knobs, "offload_optimizer": False} | ({"recompute": "none"} if full else {})
    draft = grid.draft(ctx, grid.with_defaults(point))
    layout = draft_layout(own, full, offload)
    host = fine_cost_model(ctx).cluster.node.host is not None
    p = Point.of(draft, host, walked)
    got = p.layout_s(fine_cost_model(ctx).device_memory_bytes, layout)
    if math.isfinite(got):
        return got, True, layout
    return p.layout_s(NO_MEMORY_BYTES, layout), False, layout
