"""Exploring a space: enumerate, screen, prune, simulate the best candidates, rank; Pareto front and plots.

Phases, in order:
1. enumerate the knob assignments the space's constraints allow (``Space.enumerate``);
2. screen every plan (``planlab.search_spaces.screen``): an analytic estimate of its iteration
   time and memory from its Draft, without materializing;
3. prune the plans whose memory lower bound exceeds the device's (their ``reason`` says why);
4. simulate (materialize + simpy) the candidates (the ``candidates`` fastest by the screen, those near its Pareto
   front, the fastest of each part of the space), fastest first, in ``jobs`` processes, until ``budget`` s from the start;
5. rank: simulated feasible plans first, fastest first; the Pareto front of time against memory.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from planlab.candidates import (
    JOURNAL,
    PLAN_KEY,
    ROW_KEYS,
    SIMULATED_KEY,
    BestPlans,
    Draws,
    drafted_before_fork,
    Journal,
    PoolRunner,
    RayRunner,
    SerialRunner,
    Simulated,
    Workers,
    exploration_header,
    init_worker,
    simulate_candidates,
)
from planlab.costmodel import CostModel
from planlab.drawing import Drawing, drawing_of
from planlab.errors import ConfigError, InfeasiblePlan
from planlab.gcpause import paused_gc
from planlab.inputs import check_explore_options, check_sizes
from planlab.memo import DIGEST_KEY, SimulationMemo, plan_digest
from planlab.memory_bound import memory_lower_bound_bytes
from planlab.graph.ir import Graph
from planlab.models.spec import ModelSpec
from planlab.models.trace_cache import trace_model
from planlab.plan.plan import Plan
from planlab.plan.plan_file import save_plan
from planlab.plan.software_passes import build_program
from planlab.progress import PhaseClock, note
from planlab.progress import progress as progress_bar
from planlab.plan.shared_params import forward_only_of, training_flops  # noqa: F401 (re-exported)
from planlab.search_spaces.builtin import get_space
from planlab.search_spaces.compose import SPACE_KEY
from planlab.search_spaces.screen import Estimate, Screen
from planlab.search_spaces.selection import MEMORY_SLACK
from planlab.search_spaces.selection import candidates as choose_candidates
from planlab.search_spaces.selection import factor_masks, pareto_mask, part_masks
from planlab.search_spaces.space import Context, Space
from planlab.simulator.engine import simulate

SCREEN_COLUMNS = ["screen_time_s", "screen_mem_gib", "screen_rank"]
RESULT_COLUMNS = SCREEN_COLUMNS + [
    "iter_time_s",
    "peak_mem_gib",
    "tflops_per_gpu",
    "mfu",
    "feasible",
    "simulated",
    "reason",
]
# the reason of a candidate the budget left unsimulated (its row's reason starts with it)
BUDGET_REASON = "not simulated within the budget"
DEFAULT_CANDIDATES = 16  # the fastest plans by the screen simulated, and as many along its Pareto front
PHASES = ("trace_s", "enumerate_s", "screen_s", "simulate_s")  # df.attrs["phases"], with "total_s"


@dataclass(frozen=True)
class Setup:
    """The inputs of an exploration: model, cluster, batch and training software (the space
    comes apart)."""

    model: ModelSpec
    cluster: str
    nodes: int
    global_batch: int
    profile: str | None = None  # a calibration profile (planlab calibrate) pricing the cluster
    software: str | None = None  # a built-in software name or a software file; None: the cluster's default
    precision: str | None = None  # the software's precision; None: the device's default


def make_context(setup: Setup, graph: Graph | None = None) -> tuple[Context, CostModel, Graph]:
    cost = CostModel.load(
        setup.cluster, setup.nodes, profile=setup.profile, software=setup.software, precision=setup.precision
    )
    if graph is None:
        graph = trace_model(setup.model, setup.global_batch)
    ctx = Context(
        graph,
        setup.model,
        setup.global_batch,
        setup.cluster,
        setup.nodes,
        cost.cluster.num_devices,
        cost.cluster.node.devices_per_node,
        setup.profile,
        setup.software,
        setup.precision,
    )
    return ctx, cost, graph


def _nan_row(reason: str, feasible: bool = False, **extra) -> dict:
    return dict(
        iter_time_s=math.nan,
        peak_mem_gib=math.nan,
        tflops_per_gpu=math.nan,
        mfu=math.nan,
        feasible=feasible,
        reason=reason,
        **extra,
    )


def evaluate(plan: Plan, graph: Graph, cost: CostModel, *, timeline: bool = False):
    """Simulate one plan; returns ``(row dict, SimResult or None)``. Infeasible plans are rows too."""
    row, res, _ = _evaluated(plan, graph, cost, timeline)
    return row, res


def _evaluated(plan: Plan, graph: Graph, cost: CostModel, timeline: bool):
    """``evaluate``'s row and SimResult, and the Program simulated (None when it was not)."""
    row = dict(plan.knobs)
    mem_cap = cost.device_memory_bytes
    static, acts = memory_lower_bound_bytes(plan, graph, cost.precision, cost.software)
    if static + acts > mem_cap:
        what = (
            "weights, gradients and optimizer states alone need"
            if static > mem_cap
            else "weights, optimizer states and the activations saved in flight need at least"
        )
        row.update(
            _nan_row(
                f"{what} {(static if static > mem_cap else static + acts) / 2**30:.1f} GiB per device "
                f"(device memory {mem_cap / 2**30:.1f} GiB)"
            ),
            peak_mem_gib=(static + acts) / 2**30,
        )
        return row, None, None
    try:
        program = build_program(plan, graph, cost)
        res = simulate(program, cost, model_flops=training_flops(graph), timeline=timeline)
    except InfeasiblePlan as e:
        row.update(_nan_row(str(e).splitlines()[0]))
        return row, None, None
    row.update(
        iter_time_s=res.iter_time_s,
        peak_mem_gib=res.peak_mem_bytes / 2**30,
        tflops_per_gpu=res.tflops_per_gpu,
        mfu=res.mfu,
        feasible=res.feasible,
        reason=res.reason,
    )
    return row, res, program


# -- the work of one plan, in this process or in a worker --------------------------------------
_STATE: dict = {}  # ctx, cost, graph, space, screen: set before the workers fork (or by _init_spawned)


def _init_spawned(setup: Setup, space: str) -> None:
    init_worker()
    ctx, cost, graph = make_context(setup)
    _STATE.update(ctx=ctx, cost=cost, graph=graph, space=get_space(space), screen=None)


def _screen_of() -> Screen:
    if _STATE.get("screen") is None:
        _STATE["screen"] = Screen(_STATE["graph"], _STATE["cost"], _STATE["cost"].precision)
    return _STATE["screen"]


def _screen_one(values: dict) -> tuple[Estimate | None, str]:
    """The screen's estimate of one assignment; or None and the rule it breaks; or None and
    ``SCREEN_FAILED``, the screen's own failure (such plans are simulated)."""
    sp, ctx = _STATE["space"], _STATE["ctx"]
    try:  # a space's apply may refuse an assignment (InfeasiblePlan); a ConfigError ends the exploration
        draft = sp.draft(ctx, values)
        draft.check_rules(_rules_of(sp, values), sp.name)
    except InfeasiblePlan as e:
        return None, str(e).splitlines()[0]
    try:
        return _screen_of().estimate(draft), ""
    except Exception as e:  # noqa: BLE001 - an estimate is a hint; the simulation decides
        return None, f"{SCREEN_FAILED} ({type(e).__name__}: {e})"


SCREEN_FAILED = "the screen could not estimate it"


def _space_of(space: str | Space) -> Space:
    """The Space ``space`` names (a built-in or composed name), or ``space`` itself."""
    sp = get_space(space) if isinstance(space, str) else space
    if not isinstance(sp, Space):
        raise ConfigError(f"space must be a name or a planlab Space, got a {type(space).__name__}")
    return sp


def _rules_of(sp: Space, values: dict) -> tuple:
    if SPACE_KEY in values and len(sp.alternatives()) > 1:
        return sp.alternative(values[SPACE_KEY]).all_rules()
    return sp.all_rules()


def _screen_many(items: list[tuple[int, dict]]) -> list[tuple[int, Estimate | None, str]]:
    with paused_gc():  # the collector would walk the graph's objects, and frees nothing here
        return [(i, *_screen_one(v)) for i, v in items]


def simulate_candidate(
    sp: Space, ctx: Context, cost: CostModel, values: dict, *, timeline: bool = False, known: dict | None = None
):
    """Build and simulate one assignment of ``sp``'s knobs: the simulation's columns of its row
    (``ROW_KEYS``, and under ``PLAN_KEY`` the Plan when it fits the device, so the parent need not
    build the best plan again: an alpa plan's integer programs are solved where it was built), and
    its Program and SimResult (None for a plan not simulated; with ``timeline``, the timeline
    recorded). The same in this process, a forked worker or a Ray task. ``known``: rows by plan
    digest (:class:`planlab.memo.SimulationMemo`); a plan found there is not simulated again, and
    the row carries its digest (``DIGEST_KEY``) for the parent to record."""
    with paused_gc():  # building a plan allocates much and frees no cycle; the collector would walk the graph
        return _simulated_candidate(sp, ctx, cost, values, timeline, known)


def _simulated_candidate(sp: Space, ctx: Context, cost: CostModel, values: dict, timeline: bool, known: dict | None):
    try:
        plan = sp.build(ctx, values)
    except InfeasiblePlan as e:
        return _nan_row(str(e).splitlines()[0]), None
    digest = None if known is None else plan_digest(plan)
    if digest is not None and digest in known:
        out, sim = {k: known[digest][k] for k in ROW_KEYS}, None
    else:
        row, res, program = _evaluated(plan, ctx.graph, cost, timeline)
        out, sim = {k: row[k] for k in ROW_KEYS}, (None if res is None else Simulated(program, res))
    if digest is not None:
        out[DIGEST_KEY] = digest
    return ({**out, PLAN_KEY: plan} if out["feasible"] else out), sim


def drawn_candidate(sp: Space, ctx: Context, cost: CostModel, values: dict) -> Drawing:
    """The :class:`~planlab.drawing.Drawing` of one fitting assignment's timeline: built and
    simulated again with the timeline recorded, in a worker or a Ray task (where Programs are
    built), so that the parent draws the best plan without building or simulating it. Only the
    final best is drawn, in one task once every candidate is in."""
    with paused_gc():
        plan = sp.build(ctx, values)
        program = build_program(plan, ctx.graph, cost)
        return drawing_of(simulate(program, cost, model_flops=training_flops(ctx.graph), timeline=True))


def kept_candidate(
    sp: Space, ctx: Context, cost: CostModel, values: dict, best_s: float, known: dict | None = None
) -> dict:
    """:func:`simulate_candidate`'s row, in a worker or a Ray task: with its Plan (``PLAN_KEY``)
    only when it is as fast as ``best_s``, the fastest the parent had when it was submitted (a
    slower row cannot be the best), so that the plans of the others are not sent back."""
    row, _ = simulate_candidate(sp, ctx, cost, values, known=known)
    return (
        row if PLAN_KEY not in row or row["iter_time_s"] <= best_s else {k: v for k, v in row.items() if k != PLAN_KEY}
    )


def _simulate_one(item: tuple[int, dict, float]) -> tuple[int, dict]:
    i, values, best_s = item
    return i, kept_candidate(_STATE["space"], _STATE["ctx"], _STATE["cost"], values, best_s, _STATE.get("known"))


def _simulate_batch(item: tuple[list[int], list[dict], float]) -> list[tuple[int, dict]]:
    """Twins (:data:`TWIN_KNOBS`) one after another in this worker: the second builds on the first's
    draft (:func:`planlab.plan.materialize.shared_passes`)."""
    batch, values, best_s = item
    out = []
    for i, v in zip(batch, values):
        row = kept_candidate(_STATE["space"], _STATE["ctx"], _STATE["cost"], v, best_s, _STATE.get("known"))
        if row["feasible"]:
            best_s = min(best_s, row["iter_time_s"])
        out.append((i, row))
    return out


# the knobs that change only a plan's recompute groups or ZeRO stage in the built-in spaces: such plans share
# materialize's first passes (plan.materialize.SHARED), so a worker simulates them together (a hint)
TWIN_KNOBS = frozenset({"zero", "recompute", "recompute_mlp", "recompute_moe_act", "recompute_mla_up_proj"})


def _twins(values: dict) -> tuple:
    return tuple((k, v) for k, v in values.items() if k not in TWIN_KNOBS)


def _draw_one(values: dict) -> Drawing:
    return drawn_candidate(_STATE["space"], _STATE["ctx"], _STATE["cost"], values)


def _simulate_here(item: tuple[int, dict]) -> tuple[int, dict]:
    """One candidate simulated in this process: a fitting row carries its Simulated too
    (``SIMULATED_KEY``), so that the outputs draw the best plan without materializing it again
    (:class:`BestPlans` keeps the fastest). A lone candidate (``_STATE["lone"]``) records its
    timeline at once."""
    i, values = item
    st = _STATE
    row, sim = simulate_candidate(
        st["space"], st["ctx"], st["cost"], values, timeline=st["lone"], known=st.get("known")
    )
    return i, ({**row, SIMULATED_KEY: sim} if PLAN_KEY in row and sim is not None else row)


def _ray_task(ctx: Context, cost: CostModel, sp: Space, i: int, values: dict, best_s: float) -> tuple[int, dict]:
    return i, kept_candidate(sp, ctx, cost, values, best_s)


def _ray_draw(ctx: Context, cost: CostModel, sp: Space, values: dict) -> Drawing:
    return drawn_candidate(sp, ctx, cost, values)


def explore(
    model: str | ModelSpec,
    *,
    cluster: str,
    nodes: int = 1,
    space: str | Space = "megatron",
    fixed: dict | None = None,
    global_batch: int | None = None,
    jobs: int = 1,
    out: str | os.PathLike | None = None,
    progress: bool = False,
    profile: str | os.PathLike | None = None,
    budget: float | None = None,
    candidates: int | None = DEFAULT_CANDIDATES,
    ray: bool | str = False,
    resume: bool = False,
    software: str | os.PathLike | None = None,
    precision: str | None = None,
    memo: SimulationMemo | None = None,
) -> pd.DataFrame:
    """Screen every plan of ``space``, simulate the best candidates, return the ranked DataFrame
    (simulated feasible plans first, fastest first).

    Columns: the knobs (and ``space``, the part of a union a plan comes from), the screen's
    ``screen_time_s``, ``screen_mem_gib`` and ``screen_rank``, the simulation's ``iter_time_s``,
    ``peak_mem_gib``, ``tflops_per_gpu``, ``mfu``, ``feasible``, ``simulated``, ``reason`` (why a
    plan is infeasible or was not simulated) and ``pareto``. ``candidates`` plans are simulated
    besides those near the screen's Pareto front (None: every plan the memory bound leaves);
    ``budget`` (seconds from the start) stops the simulations and returns the best found so far.
    ``df.attrs``: ``best_plan`` (a Plan or None), ``phases`` (seconds per phase, wall), ``phases_cpu``
    (CPU seconds per phase: this process's and its ``jobs`` workers'; not Ray's), ``counts``,
    ``part_best`` (the best row of each part of a union or product), ``screen_rank_corr``.
    With ``out``, writes ``results.csv``, ``pareto.png``, ``best_plan.json`` and the best plan's
    ``timeline.png`` and ``memory.png`` there, and journals each simulated row to ``simulations.jsonl``
    as it finishes (:mod:`planlab.candidates`); ``resume`` continues from that journal. ``profile``
    (from ``planlab calibrate``) prices the cluster with its measurements. ``ray`` simulates the
    candidates as Ray tasks: True on a local Ray instance, a string on the cluster at that address.
    ``progress`` names each phase on stderr as it goes.
    ``software`` (a built-in name, ``planlab.costmodel.software``, or a software file) and
    ``precision`` are the training software the plans run with (default: the cluster's, see
    ``CostModel.load``); the frame's ``software`` and ``precision`` columns and
    ``df.attrs["software"]`` (one line for the printout) say which, and the best plan records them.
    ``memo`` (a :class:`planlab.memo.SimulationMemo` kept across explorations): a plan it holds for
    the same setup takes its row, not simulated again (``counts["reused"]``; not on Ray); its graph is traced once."""
    clock = PhaseClock()
    spec = model if isinstance(model, ModelSpec) else ModelSpec(model)
    spec.config()  # unknown model -> ConfigError before any work
    profile, software = (None if path is None else os.fspath(path) for path in (profile, software))
    check_explore_options(jobs, budget, candidates, ray, resume, out)
    cost = CostModel.load(cluster, nodes, profile=profile, software=software, precision=precision)
    batch = global_batch if global_batch is not None else max(8, cost.cluster.num_devices)
    check_sizes(batch, cost.cluster.num_devices)
    sp = _space_of(space)
    setup = Setup(spec, cluster, nodes, batch, profile, software, precision)
    ctx, cost, graph = make_context(setup, memo.graph(spec, batch) if memo else None)  # a memo's: traced once
    note(f"trace: {spec} at batch {batch}", clock.mark() - clock.wall[0], show=progress)
    drafted = drafted_before_fork(sp, ctx, fixed, jobs)  # before the workers fork (None: not needed)
    screen = Screen(graph, cost, cost.precision)  # made before the workers fork: they inherit its tables
    _STATE.update(ctx=ctx, cost=cost, graph=graph, space=sp, screen=screen, known=memo.known(setup) if memo else None)
    spawned = (_init_spawned, (setup, space)) if isinstance(space, str) else None
    workers, plans, journal = Workers(jobs, spawned), BestPlans(), None
    try:
        screening = Screening(sp, ctx, fixed, workers, drafted)  # the workers screen what is enumerated meanwhile
        assignments = screening.assignments
        clock.mark()  # this process's enumeration (the workers' CPU is the screen's)
        # opened once the space has plans (a space without any leaves a journal as it was)
        journal = None if out is None else _journal(Path(out), setup, space, fixed, candidates, resume)
        est, why = screening.results(progress)
        clock.mark(workers.cpu_s)
        rows, order, counts = _plan_rows(sp, assignments, est, why, cost, candidates)
        deadline = None if budget is None else clock.wall[0] + budget
        runner = _runner(ray, workers, (ctx, cost, sp), lone=len(order) == 1)
        try:
            draws = Draws(runner, assignments) if out is not None else None  # the best plan's timeline
            remember = None if memo is None else memo.recorder(setup)
            done = _simulate_all(order, assignments, rows, runner, progress, deadline, journal, plans, draws, remember)
            clock.mark(workers.cpu_s)
            counts.update(simulated=done, feasible=sum(1 for r in rows if r["feasible"]), **_reused(remember))
            df, best, index = _ranked(sp, ctx, assignments, rows, cost, plans)
            drawing = draws.get(index) if draws is not None and best is not None else None
        finally:
            if isinstance(runner, RayRunner):
                runner.close()
        workers.close()
    finally:
        workers.close(kill=True)  # after an error or an interrupt (the pool is gone otherwise)
        _STATE.clear()
        if journal is not None:
            journal.close()
    df.attrs.update(
        software=cost.describe_software(),
        device_memory_gib=cost.device_memory_bytes / 2**30,
        counts=counts,
        phases={**clock.seconds(PHASES), "total_s": time.perf_counter() - clock.wall[0]},
        phases_cpu=clock.seconds(PHASES, cpu=True),
    )
    if out is not None:
        kept = dict(simulated=plans.simulated.get(index), drawing=drawing)
        df.attrs["outputs"] = write_outputs(df, Path(out), best=best, graph=graph, cost=cost, progress=progress, **kept)
    return df


def _reused(remember) -> dict:
    return {} if remember is None else {"reused": remember.reused}


def _ranked(
    sp: Space, ctx: Context, assignments: list[dict], rows: list[dict], cost: CostModel, kept: BestPlans
) -> tuple[pd.DataFrame, Plan | None, int]:
    """The ranked DataFrame (attrs: best_plan, space, part_best, screen_rank_corr), the best plan
    (as its worker built it, where ``kept`` holds it), and its row's index in ``assignments`` (-1: none)."""
    df = _frame(sp, assignments, rows, cost)
    best = _best_plan(sp, ctx, assignments, df, cost, kept.plans)
    index = int(df.loc[0, "_index"]) if best is not None else -1
    part_best = {}
    for name, mask in part_masks(sp, df).items():
        ok = df[pd.Series(mask, index=df.index) & df["feasible"]]
        if len(ok):
            part_best[name] = int(ok["iter_time_s"].idxmin())
    df = _with_layouts(sp, ctx, assignments, df).drop(columns=["_index"])
    sim = df[df["simulated"] & df["iter_time_s"].notna() & df["screen_time_s"].notna()]
    # Spearman's rho: the Pearson correlation of the average ranks (pandas' method="spearman" imports scipy.stats, ~1 s)
    corr = float(sim["screen_time_s"].rank().corr(sim["iter_time_s"].rank())) if len(sim) >= 3 else math.nan
    df.attrs.update(best_plan=best, space=sp.name, part_best=part_best, screen_rank_corr=corr)
    return df, best, index


LAYOUT_COLUMNS = ("stage_layers", "stage_recompute", "stage_offload")


def _with_layouts(sp: Space, ctx: Context, assignments: list[dict], df: pd.DataFrame) -> pd.DataFrame:
    """The simulated plans' per-stage layouts (the fine space's StageLayout: layers and fully
    recomputed layers per stage, optimizer offload per device group) as columns before the
    screen's; no columns when no plan has one (drafted again only where the space sets layouts)."""
    got = {}
    for pos in df.index[df["simulated"]] if sp.sets_layouts() else ():
        layout = sp.draft(ctx, assignments[int(df.at[pos, "_index"])]).layout
        if layout is not None:
            got[pos] = (layout.layers, layout.recompute, layout.offload)
    if not got:
        return df
    at = df.columns.get_loc(SCREEN_COLUMNS[0])
    for j, name in enumerate(LAYOUT_COLUMNS):
        df.insert(at + j, name, pd.Series({p: v[j] for p, v in got.items()}, dtype=object).reindex(df.index))
    return df


def _journal(out: Path, setup: Setup, space: str | Space, fixed: dict | None, candidates, resume: bool) -> Journal:
    """The journal of simulated rows in ``out`` (resumed from, with ``resume``), for the exploration
    of ``space`` with ``fixed`` knobs and ``candidates``."""
    what = dict(space=space if isinstance(space, str) else space.name, fixed=dict(fixed or {}), candidates=candidates)
    header = exploration_header(
        model=setup.model.to_json(),
        cluster=setup.cluster,
        nodes=setup.nodes,
        global_batch=setup.global_batch,
        profile=setup.profile,
        **what,
    )
    try:
        return Journal(out, header, resume=resume)
    except OSError as e:
        raise ConfigError(f"--out {str(out)!r}: cannot write {JOURNAL} there: {e.strerror}") from None


def _runner(ray: bool | str, workers: Workers, shared: tuple, *, lone: bool = False):
    """Where candidates are simulated: Ray tasks, the forked workers, or this process (``lone``:
    the only candidate, its timeline recorded as it is simulated)."""
    if ray is not False:
        return RayRunner(None if ray is True or ray == "" else ray, _ray_task, _ray_draw, shared)
    if workers.pool is not None:
        return PoolRunner(
            workers.pool, workers.jobs, _simulate_one, _draw_one, lambda: workers.close(kill=True), _simulate_batch
        )
    _STATE["lone"] = lone
    return SerialRunner(_simulate_here)


SCREEN_CHUNK = 256  # plans a worker screens at a time: enumerated in a row, they share structures


class Screening:
    """The assignments of a space (``assignments``, enumerated by this process as the object is
    made), and the screen's estimate of each (:meth:`results`). With workers, each chunk of
    ``SCREEN_CHUNK`` plans is handed to them as soon as it is enumerated, so they screen while the
    rest is enumerated; without, the plans are screened here once enumerated. ConfigError when the
    space has no plan (``Space.enumerate``'s). ``drafted``: the assignments when this process has
    already enumerated and drafted them in order (:func:`~planlab.candidates.drafted_before_fork`)."""

    def __init__(
        self, sp: Space, ctx: Context, fixed: dict | None, workers: Workers, drafted: list[dict] | None = None
    ) -> None:
        self.workers, self.pending = workers, []
        self.assignments: list[dict] = []
        chunk: list[tuple[int, dict]] = []
        with paused_gc():
            for values in sp.assignments(ctx, fixed) if drafted is None else drafted:
                chunk.append((len(self.assignments), values))
                self.assignments.append(values)
                if len(chunk) == SCREEN_CHUNK and workers.pool is not None:
                    self.pending.append(workers.pool.apply_async(_screen_many, (chunk,)))
                    chunk = []
        if chunk and workers.pool is not None:
            self.pending.append(workers.pool.apply_async(_screen_many, (chunk,)))
        if not self.assignments:
            raise sp.empty_error(ctx, sp.coerced(ctx, fixed or {}))

    def results(self, progress: bool) -> tuple[list[Estimate | None], list[str]]:
        """Each plan's estimate (None: see its reason) and reason (``_screen_one``)."""
        n = len(self.assignments)
        est: list[Estimate | None] = [None] * n
        why = [""] * n
        bar = progress_bar(n, "screen", show=progress)
        if self.workers.pool is None:
            with paused_gc():
                for i, values in enumerate(self.assignments):
                    est[i], why[i] = _screen_one(values)
                    bar.update(1)
        for handle in self.pending:
            chunk = handle.get()
            for i, e, w in chunk:
                est[i], why[i] = e, w
            bar.update(len(chunk))
        bar.close()
        return est, why


def _plan_rows(
    sp: Space, assignments: list[dict], est: list, why: list, cost: CostModel, k: int | None
) -> tuple[list[dict], list[int], dict]:
    """Rows with the screen's columns and the pruned plans' reasons; the candidates to simulate,
    in order; the counts."""
    cap = cost.device_memory_bytes
    n = len(assignments)
    rows = [
        _nan_row(why[i], screen_time_s=math.nan, screen_mem_gib=math.nan, screen_rank=math.nan, simulated=False)
        for i in range(n)
    ]
    ranked = sorted((i for i in range(n) if est[i] is not None), key=lambda i: est[i].time_s)
    for r, i in enumerate(ranked):
        rows[i].update(screen_time_s=est[i].time_s, screen_mem_gib=est[i].mem_bytes / 2**30, screen_rank=r + 1)
    pruned = 0
    for i in ranked:
        e = est[i]
        if e.bound_bytes > cap:
            pruned += 1
            if e.static_bytes > cap:
                what, need = "weights, gradients and optimizer states alone need", e.static_bytes
            else:
                what, need = (
                    "weights, optimizer states and the activations saved in flight need at least",
                    e.bound_bytes,
                )
            rows[i]["reason"] = f"{what} {need / 2**30:.1f} GiB per device (device memory {cap / 2**30:.1f} GiB)"
    live = [
        (est[i].time_s, est[i].mem_bytes) if est[i] is not None and est[i].bound_bytes <= cap else None
        for i in range(n)
    ]
    unknown = [i for i in range(n) if est[i] is None and why[i].startswith(SCREEN_FAILED)]
    chosen = choose_candidates(live, k=k, memory_bytes=cap, parts=_frame_parts(sp, assignments)) + unknown
    for i in range(n):
        if rows[i]["reason"] or live[i] is None:
            continue
        rows[i]["reason"] = (
            (
                "not simulated: the screen estimates "
                if est[i].mem_bytes > cap * (1 + MEMORY_SLACK)
                else f"not simulated: screen rank {rows[i]['screen_rank']} of {len(ranked)}, estimated "
            )
            + f"{est[i].time_s:.3g} s and {est[i].mem_bytes / 2**30:.1f} GiB per device"
            + (f" (device memory {cap / 2**30:.1f} GiB)" if est[i].mem_bytes > cap * (1 + MEMORY_SLACK) else "")
        )
    counts = dict(plans=n, screened=len(ranked), pruned=pruned, candidates=len(chosen))
    return rows, chosen, counts


def _strip(sp: Space, values: dict) -> dict:
    return values if len(sp.alternatives()) > 1 else {k: v for k, v in values.items() if k != SPACE_KEY}


def _frame_parts(sp: Space, assignments: list[dict]) -> dict[str, list[bool]]:
    return factor_masks(sp, pd.DataFrame(assignments)) if assignments else {}


def _simulate_all(
    order: list[int],
    assignments: list[dict],
    rows: list[dict],
    runner,
    progress: bool,
    deadline: float | None,
    journal: Journal | None,
    best: BestPlans,
    draws: Draws | None = None,
    remember: Callable[[dict], None] | None = None,
) -> int:
    """Simulate ``order`` (fastest estimate first) until ``deadline``, each row journaled as it
    finishes (rows the journal already holds are taken from it), the fastest rows' plans kept in
    ``best``; returns how many were. ``draws``: where the likely best is drawn once the last
    candidate is submitted (the fastest row yet; ties by the screen's estimate, as ranked).
    ``remember``: called with each row a worker returns (it takes the row's ``DIGEST_KEY`` off)."""

    def drained() -> None:
        if draws is not None and best.plans:
            draws.start(min(best.plans, key=lambda i: (rows[i]["screen_time_s"], i)))

    def late() -> bool:
        return deadline is not None and time.perf_counter() >= deadline

    done = 0
    bar = progress_bar(len(order), "simulate", show=progress)

    def store(i: int, result: dict) -> None:
        nonlocal done
        if remember is not None:
            remember(result)
        result = best.offer(i, result)
        rows[i].update(result, simulated=True)
        if journal is not None and i not in resumed:
            journal.record(assignments[i], result)
        done += 1
        bar.update(1)

    resumed = set()
    if journal is not None:
        for i in order:
            row = journal.row_of(assignments[i])
            if row is not None:
                resumed.add(i)
                store(i, row)
    todo = [i for i in order if i not in resumed]

    def fastest() -> float:
        return best.time_s

    simulate_candidates(
        todo,
        assignments,
        runner,
        store=store,
        late=late,
        deadline=deadline,
        fastest=fastest,
        drained=drained,
        twins=_twins,
    )
    bar.close()
    for i in order:
        if not rows[i]["simulated"]:
            rows[i]["reason"] = (
                f"{BUDGET_REASON}; screen estimate {rows[i]['screen_time_s']:.3g} s"
                if not math.isnan(rows[i]["screen_time_s"])
                else BUDGET_REASON
            )
    return done


def _best_plan(
    sp: Space, ctx: Context, assignments: list[dict], df: pd.DataFrame, cost: CostModel, kept: dict[int, Plan]
) -> Plan | None:
    """The fastest feasible simulated plan (``df``'s first row), as its worker built it (``kept``,
    :class:`BestPlans`) or built again (a row resumed from the journal), with the software and
    precision it was priced with; None if none fits."""
    if not len(df) or not bool(df.loc[0, "feasible"]):
        return None
    i = int(df.loc[0, "_index"])
    best = kept[i] if i in kept else sp.build(ctx, _strip(sp, assignments[i]))
    return dataclasses.replace(best, software=software_name(cost), precision=cost.precision.name)


def _frame(sp: Space, assignments: list[dict], rows: list[dict], cost: CostModel | None = None) -> pd.DataFrame:
    recs = []
    for i, (a, row) in enumerate(zip(assignments, rows)):
        rec = {SPACE_KEY: a.get(SPACE_KEY, sp.name)}
        rec.update({k: v for k, v in a.items() if k != SPACE_KEY})
        rec.update(row)
        rec["_index"] = i
        recs.append(rec)
    df = pd.DataFrame(recs)
    for c in RESULT_COLUMNS:
        if c not in df:
            df[c] = math.nan
    knobs = [c for c in df.columns if c not in RESULT_COLUMNS and c != "_index"]
    df = df[knobs + RESULT_COLUMNS + ["_index"]]
    if cost is not None:  # the software and precision every plan was priced with
        df.insert(len(knobs), "precision", cost.precision.name)
        df.insert(len(knobs), "software", software_name(cost))
    kinds = {k.name: k.kind_of() for k in sp.all_knobs()}
    for k in knobs:  # a union's parts leave each other's knobs empty: keep the others' types
        if df[k].isna().any() and kinds.get(k) in ("int", "bool"):
            df[k] = df[k].astype("Int64" if kinds[k] == "int" else "boolean")
    df["feasible"] = df["feasible"].astype(bool)
    df["simulated"] = df["simulated"].astype(bool)
    df["pareto"] = pareto_mask(df)
    df = df.sort_values(
        ["feasible", "simulated", "iter_time_s", "screen_time_s"],
        ascending=[False, False, True, True],
        na_position="last",
        kind="stable",
    )
    return df.reset_index(drop=True)


def write_outputs(
    df: pd.DataFrame,
    out: Path,
    *,
    best: Plan | None = None,
    graph: Graph | None = None,
    cost: CostModel | None = None,
    progress: bool = False,
    simulated: Simulated | None = None,
    drawing: Drawing | None = None,
) -> dict[str, float]:
    """results.csv, pareto.png and best_plan.json (and with ``graph`` and ``cost``, the best plan's
    timeline.png and memory.png, from a simulation that records its timeline), each written whole
    or not at all. ``drawing``: the best plan's timeline as a worker drew it (nothing is simulated
    here); else ``simulated``, its Program and simulation as the exploration made them: its
    timeline is drawn as recorded, else its Program simulated again (not materialized again).
    Returns the seconds each took (``timeline`` for that simulation)."""
    from planlab.plotting import memory_plot, pareto_plot, timeline_plot

    best = best if best is not None else df.attrs.get("best_plan")
    timeline = best is not None and graph is not None and cost is not None
    bar = progress_bar(3 + 3 * timeline, "plot", show=progress, unit="output")
    seconds: dict[str, float] = {}

    def done(name: str, t0: float) -> float:
        seconds[name] = time.perf_counter() - t0
        bar.update(1)
        return time.perf_counter()

    t = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "results.csv.tmp", index=False)
    os.replace(out / "results.csv.tmp", out / "results.csv")
    t = done("results.csv", t)
    pareto_plot(df, out / "pareto.png")
    t = done("pareto.png", t)
    if best is not None:
        save_plan(best, out / "best_plan.json")
        t = done("best_plan.json", t)
        if timeline:
            if drawing is None:
                res = simulated.result if simulated is not None else None
                if res is None or not res.events:
                    program = simulated.program if simulated is not None else build_program(best, graph, cost)
                    res = simulate(program, cost, model_flops=training_flops(graph), timeline=True)
                drawing = drawing_of(res)
            t = done("timeline", t)
            timeline_plot(drawing, out / "timeline.png", title=best.describe())
            t = done("timeline.png", t)
            memory_plot(drawing, out / "memory.png", title=best.describe())
            done("memory.png", t)
    else:
        for name in ("best_plan.json", "timeline.png", "memory.png"):
            if (out / name).exists():
                (out / name).unlink()
    bar.close()
    return seconds


def software_name(cost: CostModel) -> str:
    """How a plan file and results.csv name the cost model's software: its built-in name, or the
    path of the user's file."""
    from planlab.costmodel.software import SOFTWARE_DIR

    path = cost.software.path
    return cost.software.name if not path or Path(path).parent == SOFTWARE_DIR else path
