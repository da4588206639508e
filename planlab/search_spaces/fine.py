"""The fine-grained space ``fine``: per pipeline stage its own layer count, its own number of
recomputed layers and its own choice of offloading the optimizer, chosen by an integer program.

Mist (Zhu et al., EuroSys'25) and Aceso (Liu et al., EuroSys'24) beat Megatron-LM's grid by
tuning per stage what the grid fixes for all. Composed with the grid (``megatron*fine``), for
each point of it (tp, pp, dp, micro-batch, schedule, ZeRO, the base recomputation) this space
reads per-layer costs from the screen (planlab/search_spaces/fine_costs.py) and solves, with
``scipy.optimize.milp`` (HiGHS), for ``n_s`` layers, ``k_s`` of them recomputed in full (the
stage's first ones: Megatron-LM's block method per stage) and ``o_s`` (ZeRO-Offload) per stage:

    minimize   (M - 1) T + sum_s t_s + S           (1F1B's M max_s t_s + the bubble, and the sync)
    t_s = e_s + n_s l + k_s r                     T >= t_s,  S >= sync_s(n_s, o_s)
    static_s + f_s activations_s + work_s <= the device's memory, f_s = micro-batches in flight
    sum_s n_s = layers,  1 <= n_s,  0 <= k_s <= n_s

(``e_s``: the first stage's embedding and the last stage's output layer and loss).

With interleaved 1F1B (``virtual_stages`` v > 1; stage ``s`` is model chunk ``s // G`` of device
group ``s % G``) each chunk gets its own ``n_s`` and ``k_s`` (the first and the last chunk may hold
no layer: Llama 3's balanced interleaved pipeline, Dubey et al. 2024, section 3.3.2), each device
group its ``o_d``, and the program follows Megatron-LM's model of that schedule:

    minimize   M T + (G - 1) C + S                T >= sum of device d's chunks' t_s,  C >= t_s
    static_d + max over the schedule's peaks of sum_c f_c activations_c + work_d <= memory

(``f_c``: micro-batches in flight on chunk ``c`` at a peak, walked from the schedule the plan
runs, planlab/search_spaces/schedule_walks.py's ``flight_counts``). The grid decides which (pp, v) it
offers: pp x v divides the layers, or uneven end stages. The V schedules (ZB-V, DualPipe) are
left out: their weight-gradient passes fill the bubble, which the per-layer costs here (one 1F1B
backward each) do not separate. The plan the solution describes is then simulated like any other:
the simulator judges, not the program.
"""

from __future__ import annotations

import heapq
import logging
import math
import threading
from dataclasses import dataclass

import numpy as np

from planlab.costmodel import CostModel
from planlab.errors import ConfigError, InfeasiblePlan
from planlab.search_spaces.builtin import pipeline_stages, recompute_groups
from planlab.search_spaces.fine_costs import StageCosts, probe_key, stage_costs
from planlab.search_spaces.registry import register_space
from planlab.search_spaces.schedule_walks import flight_counts
from planlab.search_spaces.screen import GroupCost, Screen
from planlab.search_spaces.space import Constraint, Context, Draft, Knob, Space
from planlab.search_spaces.stages import FIRST, LAST, StageLayout, layout_problem

log = logging.getLogger(__name__)  # one debug record per program solved: its Solved.status (counted by the benchmark)
FINE_SCHEDULES = ("1f1b", "gpipe", "interleaved")
TIE = 1e-3  # the weight of the stages' own sync in the objective, which breaks ties


def in_flight(schedule: str, stage: int, stages: int, m: int) -> int:
    """Micro-batches whose activations ``stage`` keeps at its peak (1F1B: ``stages - stage``; GPipe: all)."""
    return m if schedule == "gpipe" else min(m, stages - stage)


def flight_rows(schedule: str, rank: int, groups: int, m: int, chunks: int, group: int = 0) -> np.ndarray:
    """Per model chunk of device group ``rank``, the micro-batches in flight at each of its schedule's
    possible peaks (rows; the activation peak for per-chunk bytes ``w`` is ``max(rows @ w)``):
    1F1B's and GPipe's one count, or interleaved 1F1B's rows that no other row covers (``group``
    micro-batches a chunk in a row, Llama 3's N; 0: the device groups)."""
    if chunks == 1:
        return np.array([[in_flight(schedule, rank, groups, m)]])
    rows = flight_counts("interleaved", rank, groups, m, chunks, group)
    keep = [r for r in rows if not any((o >= r).all() and (o > r).any() for o in rows)]
    return np.array(keep)


class _Program:
    """The integer program under construction: its variables' positions (per stage ``n`` layers and
    ``k`` recomputed, per device group ``o`` offloads, ``z`` = n o, ``r`` whether it recomputes at
    all, ``N`` and ``K`` its layers and recomputed layers over its chunks, then ``T`` the slowest
    device, ``S`` the slowest sync, ``C`` the slowest chunk) and its rows (HiGHS' LinearConstraint).

    ``N`` and ``K`` only name sums of other integers, but as integer variables of their own they
    let HiGHS branch on a device's total (the pipeline's time depends on the chunks only through
    it): without them an interleaved program's branch and bound splits the same total across
    chunks in every way before it proves a bound."""

    def __init__(self, stages: int, chunks: int, actions: int = 0) -> None:
        self.stages, self.G = stages, stages // chunks
        self.n, self.k, self.o, self.z = 0, stages, 2 * stages, 2 * stages + self.G
        self.r, self.N, self.K = (self.z + self.G * i for i in (1, 2, 3))
        self.T, self.S, self.C, self.W = (self.K + self.G + i for i in range(4))  # W: the walked time (fine_paths.py)
        self.a = self.W + 1  # walked: the ``actions`` schedule actions' ends (fine_paths.actions_of)
        self.nv = self.a + actions
        self.cols: list[list[int]] = []
        self.vals: list[list[float]] = []
        self.lo: list[float] = []
        self.hi: list[float] = []

    def add(self, coefs: dict[int, float], low: float, high: float) -> None:
        self.cols.append(list(coefs))
        self.vals.append(list(coefs.values()))
        self.lo.append(low)
        self.hi.append(high)

    def matrix(self):
        """The rows as a sparse matrix (a walked program has two rows per action of the schedule)."""
        from scipy.sparse import csr_array

        ptr = np.cumsum([0] + [len(c) for c in self.cols])
        cols = np.fromiter((i for c in self.cols for i in c), dtype=np.int64, count=ptr[-1])
        vals = np.fromiter((v for r in self.vals for v in r), dtype=float, count=ptr[-1])
        return csr_array((vals, cols, ptr), shape=(len(self.lo), self.nv))


def _device_rows(
    lp: _Program, c: StageCosts, d: int, m: int, cap_bytes: float, schedule: str, layers: int, group: int
) -> None:
    """Device group ``d``'s rows: its time, its sync, its memory at each peak, its offloaded layers."""
    n, k, o, z, G, v = lp.n, lp.k, lp.o, lp.z, lp.G, lp.stages // lp.G
    mine = [cc * G + d for cc in range(v)]
    ex = [stage_extras(c, s, lp.stages) for s in mine]
    fixed_s = sum(e.time_s + (c.p2p_s if s else 0.0) for e, s in zip(ex, mine))
    lp.add({lp.N + d: 1.0, **{n + s: -1.0 for s in mine}}, 0.0, 0.0)
    lp.add({lp.K + d: 1.0, **{k + s: -1.0 for s in mine}}, 0.0, 0.0)
    lp.add({lp.T: 1.0, lp.N + d: -c.layer_s, lp.K + d: -c.recompute_s}, fixed_s, np.inf)
    sync = {lp.S: 1.0, **{n + s: -c.sync_s for s in mine}, z + d: c.sync_s - c.offload_sync_s}
    lp.add(sync, c.unit_sync_s + sum(e.sync_s for e in ex), np.inf)
    work = c.unit_static_bytes + c.work_bytes + max(0.0, *(e.work_bytes for e in ex))
    static = {n + s: c.static_bytes for s in mine} | {z + d: c.offload_static_bytes - c.static_bytes}
    # a device that recomputes a layer runs its forward again before its backward: that layer's working
    # set. Under 1F1B a binary r_d says whether it does (k_s <= L r_d); interleaved, every device pays it
    # (with the binary, one interleaved HiGHS program took 177 s of CPU, against 3 s without the charge)
    regrow = max(0.0, c.recompute_work_bytes - c.work_bytes)
    if v == 1:
        static[lp.r + d] = regrow
        lp.add({k + mine[0]: 1.0, lp.r + d: -layers}, -np.inf, 0.0)
    else:
        work += regrow
    for f in flight_rows(schedule, d, G, m, v, group):
        mem = dict(static)
        for fc, s in zip(f, mine):
            mem[n + s] += fc * c.saved_bytes
            mem[k + s] = fc * (c.recompute_saved_bytes - c.saved_bytes)
        room = cap_bytes - work - sum(e.static_bytes + fc * e.saved_bytes for e, fc in zip(ex, f))
        lp.add({i: val / cap_bytes for i, val in mem.items()}, -np.inf, room / cap_bytes)
    # z = n o (the device's offloaded layers): z <= L o, z <= n, z >= n - L (1 - o)
    lp.add({z + d: 1.0, o + d: -layers}, -np.inf, 0.0)
    lp.add({z + d: 1.0, **{n + s: -1.0 for s in mine}}, -np.inf, 0.0)
    lp.add({z + d: 1.0, **{n + s: -1.0 for s in mine}, o + d: -layers}, -layers, np.inf)


NODE_LIMIT = 5_000  # HiGHS' branch-and-bound nodes per program (deterministic, unlike a time limit); see Solved
PRUNE_KEEP = 32  # a grid point's program is solved unless its LP bound cannot enter the best this many (see Incumbents)


@dataclass(frozen=True)
class Solved:
    """How one grid point's program ended: ``layout`` (None: no layout fits, or pruned), its
    objective ``objective_s`` (the program's iteration time; for ``pruned``, the LP bound that no
    layout of this point can beat) and ``status``: ``optimal`` (HiGHS proved it within its default
    gap), ``node limit`` (HiGHS stopped at NODE_LIMIT nodes: a feasible layout that may not be the
    program's best, or None when it had found none), ``infeasible`` or ``pruned``."""

    layout: StageLayout | None
    objective_s: float
    status: str


def solve_program(
    c: StageCosts,
    layers: int,
    stages: int,
    m: int,
    cap_bytes: float,
    schedule: str = "1f1b",
    chunks: int = 1,
    bar_s: float = math.inf,
    group: int = 0,
    walked: bool = False,
) -> Solved:
    """Solve the program of :func:`solve_layout`; when ``bar_s`` is finite, first a proven lower
    bound on every layout's objective (:func:`balanced_bound_s`, then the LP relaxation): if it is
    ``bar_s`` or more, no layout of this point can beat ``bar_s`` and the integer program is not
    solved (``pruned``). ``group``: interleaved 1F1B's micro-batches a chunk in a row (0: the device groups).
    ``walked``: the objective is the pipeline walked action by action (planlab/search_spaces/fine_paths.py)."""
    from scipy.optimize import milp  # on first use: scipy takes a second to import

    if walked:
        from planlab.search_spaces.fine_paths import solve_walked, walked_bound_s

        if math.isfinite(bar_s):
            bound_s = walked_bound_s(c, layers, stages, m, chunks)
            if bound_s > bar_s + BOUND_MARGIN * abs(bar_s):
                return Solved(None, bound_s, "pruned")
        got = solve_walked((c, layers, stages, m, cap_bytes, schedule, chunks, group), bar_s, math.isfinite(bar_s))
        return Solved(got[0], got[1] if got[0] is not None else got[2], got[3])

    if math.isfinite(bar_s):
        bound_s = balanced_bound_s(c, layers, stages, m, chunks)
        # strictly above the bar by more than HiGHS' tolerances: the LP relaxation would prune it too
        if bound_s > bar_s + BOUND_MARGIN * abs(bar_s):
            return Solved(None, bound_s, "pruned")
    cost, args, integ, lp = milp_args(c, layers, stages, m, cap_bytes, schedule, chunks, group)
    if math.isfinite(bar_s):
        relaxed = milp(cost, **args)  # no integrality: the LP relaxation
        if relaxed.x is None:
            return Solved(None, math.inf, "infeasible")
        if relaxed.fun >= bar_s:
            return Solved(None, float(relaxed.fun), "pruned")
    res = milp(cost, integrality=integ, options={"node_limit": NODE_LIMIT}, **args)
    limited = res.status == 1  # HiGHS' "iteration or time limit reached": here the node limit
    if res.x is None:
        return Solved(None, math.inf, "node limit" if limited else "infeasible")
    x = np.round(res.x).astype(int)
    layout = StageLayout(
        layers=tuple(int(val) for val in x[lp.n : lp.n + stages]),
        recompute=tuple(int(val) for val in x[lp.k : lp.k + stages]),
        offload=tuple(bool(val) for val in x[lp.o : lp.o + lp.G]),
        proven=not limited,
    )
    return Solved(layout, float(res.fun), "node limit" if limited else "optimal")


BOUND_MARGIN = 1e-6  # relative: a balanced bound this far above the bar prunes without the LP relaxation


def balanced_bound_s(c: StageCosts, layers: int, stages: int, m: int, chunks: int = 1) -> float:
    """A lower bound on the program's objective (:func:`program_arrays`) from its rows alone, without a
    solver: the slowest device is at least the average of the work over the devices, the slowest
    chunk at least the average over the chunks (no layer recomputed, no memory limit), the sync at
    least 0, and offloading at most every layer's difference in the tie-breaking terms.
    A relaxation of the LP relaxation, so never above it (tests/test_fine.py)."""
    G = stages // chunks
    work_s = layers * c.layer_s + sum(
        stage_extras(c, s, stages).time_s + (c.p2p_s if s else 0.0) for s in range(stages)
    )
    ties_s = TIE * layers * (c.sync_s + min(0.0, c.offload_sync_s - c.sync_s))
    if chunks == 1:  # (M - 1) T + the layers' own time in the sum over stages (module docstring)
        return (m - 1) * work_s / stages + layers * c.layer_s + ties_s
    return m * work_s / G + (G - 1) * work_s / stages + TIE * layers * c.layer_s + ties_s


def solve_layout(
    c: StageCosts, layers: int, stages: int, m: int, cap_bytes: float, schedule: str = "1f1b", chunks: int = 1
) -> StageLayout | None:
    """The :class:`StageLayout` minimizing the pipeline's time under ``cap_bytes`` per device
    (HiGHS), or None when no layout fits. With ``chunks`` > 1 (interleaved 1F1B) ``stages`` counts
    the model chunks (stage ``s`` on device ``s % (stages / chunks)``); each chunk gets its own
    layers (the first and the last may hold none: Llama 3's balanced pipeline) and recomputation,
    each device its offloading, and the memory limit holds at every peak of the schedule."""
    return solve_program(c, layers, stages, m, cap_bytes, schedule, chunks).layout


def milp_args(*program, layout: StageLayout | None = None, **walked):
    """HiGHS' arguments for the program of :func:`program_arrays` (``program`` and ``walked``, its
    arguments): its objective, ``constraints`` and ``bounds`` as ``scipy.optimize.milp`` keywords,
    its integrality and its _Program; with ``layout``, its integers fixed there (the LP then prices
    that layout)."""
    from scipy.optimize import Bounds, LinearConstraint

    cost, rows, lower, upper, integ, lp = program_arrays(*program, **walked)
    if layout is not None:
        lower, upper = lower.astype(float), upper.astype(float)
        n, k = np.array(layout.layers), np.array(layout.recompute or (0,) * lp.stages)
        offload = np.array([float(x) for x in (layout.offload or (False,) * lp.G)])
        for at, vals in ((lp.n, n), (lp.k, k), (lp.o, offload)):
            lower[at : at + len(vals)] = upper[at : at + len(vals)] = vals
        if lp.G == lp.stages:  # 1F1B: r_d, whether device d recomputes at all (its working set regrown)
            lower[lp.r : lp.r + lp.G] = upper[lp.r : lp.r + lp.G] = (k > 0).astype(float)
    return cost, dict(constraints=LinearConstraint(rows, lp.lo, lp.hi), bounds=Bounds(lower, upper)), integ, lp


def program_arrays(
    c: StageCosts,
    layers: int,
    stages: int,
    m: int,
    cap_bytes: float,
    schedule: str,
    chunks: int,
    group: int = 0,
    walked: bool = False,
):
    """The program's objective, rows (sparse), bounds and integrality (module docstring), and its
    _Program. ``walked``: the objective is instead ``W``, the pipeline's time walked action by action,
    held at the longest path through the schedule's actions by a variable per action's end
    (planlab/search_spaces/fine_paths.py)."""
    from planlab.search_spaces.fine_paths import actions_of, walked_objective

    lp = _Program(stages, chunks, len(actions_of(stages, m, schedule, chunks, group)) if walked else 0)
    n, k, z, G, v = lp.n, lp.k, lp.z, lp.G, chunks
    for d in range(G):
        _device_rows(lp, c, d, m, cap_bytes, schedule, layers, group)
    for s in range(stages):
        lp.add({k + s: 1.0, n + s: -1.0}, -np.inf, 0.0)
        fixed_s = stage_extras(c, s, stages).time_s + (c.p2p_s if s else 0.0)
        lp.add({lp.C: 1.0, n + s: -c.layer_s, k + s: -c.recompute_s}, fixed_s, np.inf)
    lp.add({n + s: 1.0 for s in range(stages)}, layers, layers)
    cost = np.zeros(lp.nv)
    cost[lp.S] = 1.0
    if v == 1:  # 1F1B: M max_s t_s + the fill and drain of the others, (M - 1) T + sum_s t_s
        cost[lp.T] = m - 1
        cost[n : n + stages], cost[k : k + stages] = c.layer_s, c.recompute_s
    else:  # interleaved 1F1B: M max_d t_d + (groups - 1) chunks' fill and drain, at the slowest chunk's pace
        cost[lp.T], cost[lp.C] = m, G - 1
        cost[n : n + stages], cost[k : k + stages] = TIE * c.layer_s, TIE * c.recompute_s  # no needless recompute
    # ties (the bottleneck's sync hides the others'): offload no stage more than the memory asks
    cost[n : n + stages] += TIE * c.sync_s
    cost[z : z + G] = TIE * (c.offload_sync_s - c.sync_s)
    upper = np.array(
        [layers] * (2 * stages)
        + [1 if c.can_offload else 0] * G
        + [layers] * G
        + [int(v == 1)] * G
        + [layers] * (2 * G)
        + [np.inf] * (4 + lp.nv - lp.a)
    )
    lower = np.array([1] * stages + [0] * (stages + 5 * G) + [0] * (4 + lp.nv - lp.a))
    if v > 1:  # Llama 3's balanced interleaved pipeline: an end chunk may run only the embedding or the head
        lower[n], lower[n + stages - 1] = 0, 0
    integ = np.array([1] * (2 * stages + 5 * G) + [0] * (4 + lp.nv - lp.a))
    if walked:
        cost = walked_objective(lp, c, m, schedule, chunks, group)
    return cost, lp.matrix(), lower, upper, integ, lp


class Incumbents:
    """The ``keep`` (PRUNE_KEEP) best objectives (s) of the programs solved so far for one graph and cluster,
    kept in the graph's memo (so in this process): a grid point whose LP bound is at least the
    worst of them cannot enter them, and its program is not solved (its plan stays the grid's).
    Sound for the program's objective: the PRUNE_KEEP best layouts over the grid are those the
    unpruned search finds (tests/test_fine.py). Each point's outcome is memoized with it, so a
    plan drafted again (simulated, its layout reported) is the one screened. Which points are
    pruned depends on the order they are drafted in: with ``--jobs`` > 1 explore drafts every
    assignment in order in its own process before the workers fork (``FineStages.drafts_in_order``),
    so that they find each outcome in the memo and the rows are those of ``--jobs 1``; a Ray task or
    a spawned worker (no fork) that drafts a point its memo lacks prunes against its own programs."""

    def __init__(self, keep: int | None = None) -> None:
        self.keep = PRUNE_KEEP if keep is None else keep
        self._worst_first: list[float] = []  # negated objectives: heapq's min-heap as a max-heap
        self._lock = threading.Lock()

    def bar_s(self) -> float:
        """The objective a point must beat to be solved (inf until ``keep`` programs are)."""
        with self._lock:
            return -self._worst_first[0] if len(self._worst_first) >= self.keep else math.inf

    def add(self, objective_s: float) -> None:
        with self._lock:
            heapq.heappush(self._worst_first, -objective_s)
            if len(self._worst_first) > self.keep:
                heapq.heappop(self._worst_first)


def stage_extras(c: StageCosts, s: int, G: int) -> GroupCost:
    """Stage ``s``'s extras: the first stage's, the last's, or both's on one stage, and every stage's
    once-only time per micro-batch (``StageCosts.unit_s``)."""
    parts = ([c.first] if s == 0 else []) + ([c.last] if s == G - 1 else [])
    fields = ("time_s", "sync_s", "static_bytes", "saved_bytes", "work_bytes")
    time_s, *rest = (sum(getattr(p, f) for p in parts) for f in fields)
    return GroupCost(time_s + c.unit_s, *rest)


def apply_layout(draft: Draft, layout: StageLayout) -> None:
    """Put ``layout`` on ``draft``: the stages' (model chunks') layer counts, each stage's first
    ``recompute[s]`` layers recomputed in full (the others keep the draft's recomputation), per
    device group offloading. ConfigError in one line if the layout does not fit the draft's layers,
    stages and chunks."""
    ctx = draft.ctx
    G, L = draft.num_stages, ctx.layers
    problem = layout_problem(layout, L, G, draft.chunks)
    if problem:
        raise ConfigError(f"fine: {problem}")
    if G > 1:
        draft.stages = pipeline_stages(ctx.graph, G, L, layout.layers)
    starts = np.cumsum((0,) + layout.layers)
    redo = {int(starts[s]) + i + 1 for s in range(G) for i in range(layout.recomputed(s))}  # groups: layer + 1
    if redo:
        draft.recompute = dict(draft.recompute)
        draft.recompute.update({op: grp for op, grp in recompute_groups(ctx.graph, "full").items() if grp in redo})
    if any(layout.offloads(d) for d in range(draft.groups)):  # a device group's first stage is its number
        draft.offload_optimizer = True
        draft.offload_stages = tuple(d for d in range(draft.groups) if layout.offloads(d))
    draft.layout = layout


def priced_by(ctx: Context) -> tuple:
    """What prices ``ctx``'s plans: the cluster, its nodes, and the exploration's calibration profile,
    software and precision (a part of every key the fine space keeps in the graph's memo)."""
    return (ctx.cluster, ctx.nodes, ctx.profile, ctx.software, ctx.precision)


def fine_cost_model(ctx: Context) -> CostModel:
    """The exploration's cost model (its profile, software and precision: explore's ``Setup``), one
    per graph and :func:`priced_by` (the graph's memo)."""
    return ctx.graph.memo(
        ("fine_cost_model",) + priced_by(ctx),
        lambda: CostModel.load(
            ctx.cluster, ctx.nodes, profile=ctx.profile, software=ctx.software, precision=ctx.precision
        ),
    )


def _screen(ctx: Context) -> Screen:
    """One screen per graph and :func:`priced_by` (kept in the graph's memo)."""
    key = ("fine_screen",) + priced_by(ctx)
    return ctx.graph.memo(key, lambda: Screen(ctx.graph, fine_cost_model(ctx), fine_cost_model(ctx).precision))


def _costs_key(draft: Draft, offload: bool) -> tuple:
    """What the per-layer costs of ``draft``'s grid point are priced from (their key in the graph's memo)."""
    return ("fine_costs",) + priced_by(draft.ctx) + (offload, probe_key(draft))


def point_costs(draft: Draft, offload: bool, key: tuple | None = None) -> StageCosts:
    """The per-layer costs of ``draft``'s grid point (fine_costs.py), once per graph, cluster and
    what the probe is priced from (the graph's memo, under ``key``, :func:`_costs_key` unless given):
    grid points that differ only in their stages, chunks or schedule share them."""
    ctx = draft.ctx
    return ctx.graph.memo(key or _costs_key(draft, offload), lambda: stage_costs(_screen(ctx), draft, offload))


def choose_layout(draft: Draft, offload: bool) -> Solved:
    """How the integer program for ``draft``'s grid point ended (its layout: None when none fits
    or the point was pruned), once per point (the graph's memo)."""
    ctx = draft.ctx
    cost = fine_cost_model(ctx)
    key = _costs_key(draft, offload)
    incumbents = ctx.graph.memo(("fine_incumbents",) + priced_by(ctx), Incumbents)

    def solve() -> Solved:
        got = solve_program(
            point_costs(draft, offload, key),
            ctx.layers,
            draft.num_stages,
            draft.microbatches,
            cost.device_memory_bytes,
            draft.schedule,
            draft.chunks,
            incumbents.bar_s(),
            draft.group,
            walked=True,
        )
        if got.layout is not None:
            incumbents.add(got.objective_s)
        log.debug("fine program: %s", got.status)
        return got

    return ctx.graph.memo(key + ("fine_layout", draft.num_stages, draft.schedule, draft.chunks, draft.group), solve)


PROGRAM, GRID = "program", "grid"  # fine_layout's values: the integer program's layout, the grid point's own plan


def _unset(name: str, allowed: tuple) -> Constraint:
    """With fine_layout=program, knob ``name`` only at ``allowed`` (the program chooses the rest itself)."""
    return Constraint(
        lambda a, c: a.get("fine_layout") != PROGRAM or a.get(name) in (None,) + allowed,
        lambda a, c: (
            f"the fine space chooses per-stage layers and recomputation itself: {name}={a.get(name)!r} "
            f"does not go with fine_layout={PROGRAM}; choose {' or '.join(map(repr, allowed))}, "
            f"or fine_layout={GRID} for the grid's own plan"
        ),
    )


class FineStages(Space):
    """Per stage, its layers, recomputed layers and offloading, by an integer program over the
    screen's per-layer costs (module docstring); compose it with the grid: ``megatron*fine``.
    ``fine_layout`` keeps both plans of a grid point: the grid's own (``grid``, the default: every
    plan of the grid is one of ``megatron*fine``'s) and the program's layout (``program``), which
    is left out (the row's reason says why) where it is the grid's plan again, where no layout fits
    and where the point was pruned: the screen and the simulation see each plan once."""

    name = "fine"
    order = 5  # after the stages, the mesh axes and the recomputation it refines
    drafts_in_order = True  # a grid point is pruned against the programs solved before it (Incumbents)
    lays_out_stages = True  # apply_layout sets Draft.layout
    knobs = (
        Knob.choice(
            "fine_layout",
            (GRID, PROGRAM),
            f"{GRID}: the grid point's own plan; {PROGRAM}: per-stage layers and recomputation chosen by the integer program",
            default=GRID,
        ),
        Knob.bool("fine_offload", "let the integer program offload the optimizer per stage (ZeRO-Offload)"),
    )
    constraints = (
        Constraint(
            lambda a, c: not a.get("fine_offload") or fine_cost_model(c).cluster.node.host is not None,
            lambda a, c: (
                f"fine_offload=True on cluster {c.cluster!r}, which gives no host side; set fine_offload=false"
            ),
        ),
        Constraint(
            lambda a, c: not a.get("fine_offload") or a.get("fine_layout") in (None, PROGRAM),
            lambda a, c: (
                f"fine_offload=True lets the integer program offload, and fine_layout={GRID} keeps the grid "
                f"point's own plan; set fine_layout={PROGRAM} or fine_offload=false"
            ),
        ),
        _unset("schedule", FINE_SCHEDULES),
        Constraint(
            lambda a, c: (
                a.get("fine_layout") != PROGRAM
                or not (a.get(FIRST) or a.get(LAST))
                or a.get("pp") is None
                or a.get("virtual_stages") is None
                or c.layers % (a["pp"] * a["virtual_stages"]) != 0
            ),
            lambda a, c: (
                f"the fine space chooses per-stage layers itself: {FIRST}={a.get(FIRST)}, {LAST}={a.get(LAST)} "
                f"with pp={a['pp']} x virtual_stages={a['virtual_stages']}, which divide the {c.layers} layers, "
                f"would only repeat the even plan; set both to 0, or fine_layout={GRID}"
            ),
        ),
        _unset("recompute", ("none", "selective")),
        _unset("offload_optimizer", (False,)),
    )

    def apply(self, draft: Draft, values: dict) -> None:
        if values.get("fine_layout", GRID) != PROGRAM:
            return
        if draft.vshape or draft.mirror or draft.spread or draft.recycles > 1:
            raise InfeasiblePlan(
                f"fine_layout={PROGRAM}: the program lays out 1F1B, GPipe and interleaved pipelines only; "
                f"this point's plan is fine_layout={GRID}'s"
            )
        offload = bool(values.get("fine_offload"))
        got = choose_layout(draft, offload)
        if got.layout is None:
            raise InfeasiblePlan(_no_layout(got))
        if offload and not any(got.layout.offload):  # the fine_offload=false row's plan again? (its program, memoized)
            plain = choose_layout(draft, False).layout
            if plain is not None and (plain.layers, plain.recompute) == (got.layout.layers, got.layout.recompute):
                raise InfeasiblePlan(
                    f"fine_layout={PROGRAM}: with fine_offload=true the program offloads nothing and lays out "
                    "the plan of fine_offload=false"
                )
        before = (draft.stages, draft.recompute)
        apply_layout(draft, got.layout)
        if not any(got.layout.offload) and (draft.stages, draft.recompute) == before:
            raise InfeasiblePlan(
                f"fine_layout={PROGRAM}: the integer program chose the grid point's own plan (fine_layout={GRID})"
            )


def _no_layout(got: Solved) -> str:
    """Why a grid point has no plan of the program's (one line)."""
    if got.status == "pruned":
        return (
            f"fine_layout={PROGRAM}: pruned, no layout of this point beats the {PRUNE_KEEP} best programs "
            f"(its bound {got.objective_s:.4g} s)"
        )
    return f"fine_layout={PROGRAM}: no layout fits the device's memory in the program's model ({got.status})"


register_space("fine", FineStages)
