"""The explorer: the screen against the simulator, candidates, the budget, jobs, unions, plots."""

import dataclasses
import math
import subprocess
import sys

import pandas as pd
import pytest
from conftest import traced
from scipy.stats import spearmanr

import planlab
from planlab.costmodel import CostModel
from planlab.errors import ConfigError
from planlab.candidates import PLAN_KEY, BestPlans, Draws, Pending, simulate_candidates
from planlab.drawing import Drawing
from planlab.explore import Setup, drawn_candidate, evaluate, kept_candidate, make_context, memory_lower_bound_bytes
from planlab.models import ModelSpec
from planlab.plan.plan import Plan
from planlab.plan.materialize import precision_for
from planlab.plan.software_passes import build_program
from planlab.search_spaces import Context, get_space
from planlab.search_spaces.screen import Screen
from planlab.search_spaces.selection import SCREEN_MEMORY_ERROR, candidates, factor_masks, front, part_masks
from planlab.simulator import simulate

TINY = dict(cluster="cpu", nodes=2, global_batch=8)


@pytest.fixture(scope="module")
def small_grid():
    """gpt-small on one DGX A100 node (8 GPUs), global batch 32: every 12th plan of the Megatron
    grid, screened and simulated."""
    spec, g = traced("gpt-small", 32)
    cost = CostModel.load("dgx-a100-80g", 1)
    ctx = Context(g, spec, 32, "dgx-a100-80g", 1, 8, 8)
    sp = get_space("megatron")
    plans = sp.enumerate(ctx)[::12]
    scr = Screen(g, cost, cost.precision)
    out = []
    for a in plans:
        e = scr.estimate(sp.draft(ctx, a))
        plan = sp.build(ctx, a)
        res = simulate(build_program(plan, g, cost), cost, model_flops=3 * g.flops)
        out.append((a, e, res, memory_lower_bound_bytes(plan, g, cost.precision, cost.software)))
    return out


def test_the_screen_ranks_plans_as_the_simulator_does(small_grid):
    """Rank correlation of the screen's estimates with the simulation on a grid where both run
    (measured: time 0.99, memory 0.98)."""
    assert len(small_grid) >= 40
    assert len({(a["tp"], a["pp"], a["dp"]) for a, *_ in small_grid}) >= 6
    st = [e.time_s for _, e, _, _ in small_grid]
    si = [r.iter_time_s for _, _, r, _ in small_grid]
    assert spearmanr(st, si)[0] >= 0.95
    assert (
        spearmanr([e.mem_bytes for _, e, _, _ in small_grid], [r.peak_mem_bytes for _, _, r, _ in small_grid])[0] >= 0.9
    )
    assert all(0.7 <= a / b <= 1.4 for a, b in zip(st, si))


@pytest.mark.parametrize(
    "space, fixed, step",
    [
        ("megatron", {"zero": 3}, 6),  # FSDP: weights gathered per layer, gradients reduce-scattered per micro-batch
        ("megatron", {"schedule": "zb-h1"}, 12),  # zero-bubble: backward split into I and W, W deferred
        ("megatron*coshard", {"coshard": 2}, 20),  # co-located pieces: the base split, recomputed, in k tasks
    ],
)
def test_the_screen_follows_zero3_zero_bubble_and_coshard(space, fixed, step):
    """The screen against the simulator on plans of main's newer features (measured on every plan
    of each grid with the roofline: time Spearman 0.996 to 0.999, ratios 0.85 to 1.22; memory Spearman
    0.97 to 0.985; with the default software's kernel model the co-sharded plans' ratios are 0.725 to
    1.02, the screen pricing each chunk's kernels by the whole operator's factor over the roofline),
    and its memory bound, and the plan's, never above the simulated peak."""
    spec, g = traced("gpt-small", 32)
    cost = CostModel.load("dgx-a100-80g", 1)
    ctx = Context(g, spec, 32, "dgx-a100-80g", 1, 8, 8)
    sp = get_space(space)
    scr = Screen(g, cost, cost.precision)
    rows = []
    for a in sp.enumerate(ctx, fixed)[::step]:
        plan = sp.build(ctx, a)
        res = simulate(build_program(plan, g, cost), cost, model_flops=3 * g.flops)
        bound = sum(memory_lower_bound_bytes(plan, g, cost.precision, cost.software))
        rows.append((a, scr.estimate(sp.draft(ctx, a)), res, bound))
    assert len(rows) >= 15
    st, si = [e.time_s for _, e, _, _ in rows], [r.iter_time_s for _, _, r, _ in rows]
    assert spearmanr(st, si)[0] >= 0.95
    assert all(0.7 <= a / b <= 1.35 for a, b in zip(st, si))
    assert spearmanr([e.mem_bytes for _, e, _, _ in rows], [r.peak_mem_bytes for _, _, r, _ in rows])[0] >= 0.9
    for a, e, r, bound in rows:
        assert e.bound_bytes <= r.peak_mem_bytes * 1.001 and bound <= r.peak_mem_bytes * 1.001, a


def test_a_co_located_piece_is_priced_at_its_share_of_the_split_piece():
    """coshard's k pieces of a split's piece each cost 1/k of it on the kernel level (the split
    piece's kernel factor over the roofline), not the split piece's kernels over 1/k of its flop: a
    k-fold overprice that cost nnScaler's Swin workloads their co-sharded plans in the screen."""
    spec, g = traced("gpt3-6.7b", 8)  # GEMMs of thousands: their time is their work, not a launch
    cost = CostModel.load("dgx-a100-80g", 1)
    scr = Screen(g, cost, cost.precision)
    linear = next(i for i, op in enumerate(g.operators) if op.kind == "linear")
    work = scr.t.work_class[linear]
    for cut in ((), (("out", 2),)):
        split = math.prod(n for _, n in cut)
        for phase in ("F", "B"):
            whole = scr._compute_s(work, split, 1, phase, cut)
            assert scr._compute_s(work, 4 * split, 1, phase, cut) * 4 == pytest.approx(whole, rel=0.05)


def test_memory_bounds_stay_below_the_simulated_peak(small_grid):
    """Pruning is safe: the screen's bound and the plan's bound never exceed the simulated peak."""
    for a, e, r, (static, acts) in small_grid:
        assert e.bound_bytes <= r.peak_mem_bytes * 1.001, a
        assert static + acts <= r.peak_mem_bytes * 1.001, a


@pytest.fixture(scope="module")
def tiny_full():
    return planlab.explore("gpt-tiny", **TINY, candidates=None)


def test_results_carry_screen_and_simulated_columns(tiny_full):
    df = tiny_full
    for c in [
        "space",
        "dp",
        "tp",
        "pp",
        "zero",
        "sequence_parallel",
        "schedule",
        "recompute",
        "screen_time_s",
        "screen_mem_gib",
        "screen_rank",
        "iter_time_s",
        "peak_mem_gib",
        "feasible",
        "simulated",
        "reason",
        "pareto",
    ]:
        assert c in df.columns, c
    assert df["simulated"].all() and df["feasible"].iloc[0] and df["pareto"].any()
    assert list(df["iter_time_s"][df["feasible"]]) == sorted(df["iter_time_s"][df["feasible"]])
    assert sorted(df["screen_rank"]) == list(range(1, len(df) + 1))
    c = df.attrs["counts"]
    assert c["plans"] == c["screened"] == c["candidates"] == c["simulated"] == len(df)
    assert set(df.attrs["phases"]) == {"trace_s", "enumerate_s", "screen_s", "simulate_s", "total_s"}
    assert df.attrs["screen_rank_corr"] > 0.8
    assert set(df.attrs["part_best"]) <= {"pp", "dp", "tp", "recompute"} and "dp" in df.attrs["part_best"]


def test_candidates_are_the_fastest_by_the_screen(tiny_full):
    df = planlab.explore("gpt-tiny", **TINY, candidates=3)
    assert 3 <= df["simulated"].sum() < len(df)
    fastest = df.sort_values("screen_time_s").head(3)
    assert fastest["simulated"].all()
    rest = df[~df["simulated"]]
    assert rest["reason"].str.startswith("not simulated: screen rank").all()
    assert (rest["feasible"] == False).all() and rest["iter_time_s"].isna().all()  # noqa: E712
    # the best plan found among the candidates is the best of the whole grid here
    assert df.attrs["best_plan"].knobs == tiny_full.attrs["best_plan"].knobs


def test_a_budget_of_zero_returns_the_screened_rows_with_reasons():
    df = planlab.explore("gpt-tiny", **TINY, budget=0)
    assert not df["simulated"].any() and df.attrs["best_plan"] is None
    assert df["screen_time_s"].notna().all() and df["screen_mem_gib"].notna().all()
    assert df["reason"].str.startswith("not simulated").all()
    assert df["reason"].str.contains("within the budget").sum() == df.attrs["counts"]["candidates"] > 0
    assert df.attrs["counts"]["simulated"] == 0


def test_jobs_give_the_same_results(tiny_full):
    df = planlab.explore("gpt-tiny", **TINY, candidates=None, jobs=2)
    cols = [c for c in df.columns if c not in ("reason",)]
    key = ["pp", "dp", "microbatch", "zero", "tp", "sequence_parallel", "recompute"]
    a = df[cols].sort_values(key).reset_index(drop=True)
    b = tiny_full[cols].sort_values(key).reset_index(drop=True)
    pd.testing.assert_frame_equal(a, b)
    assert df.attrs["best_plan"] == tiny_full.attrs["best_plan"]  # built in a worker, kept by the parent


def test_the_best_plan_kept_from_its_row_is_the_plan_built_again(tiny_full):
    best = tiny_full.attrs["best_plan"]
    ctx, _, _ = make_context(Setup(ModelSpec("gpt-tiny"), "cpu", 2, 8))
    again = get_space("megatron").build(ctx, dict(best.knobs))
    assert dataclasses.replace(again, software=best.software, precision=best.precision) == best


class _ListRunner:
    """Rows of ``{"t": values["t"]}`` at once, one slot; draws a row as ``("drawn", t)``."""

    slots = 1

    def __init__(self) -> None:
        self.best_s, self.draws = [], []

    def submit(self, i, values, best_s):
        self.best_s.append(best_s)
        return Pending(i, (i, dict(values)))

    def wait(self, pending, timeout_s):
        return [p.handle for p in pending]

    def cancel(self, pending):
        pass

    def draw_async(self, values):
        self.draws.append(values["t"])
        return ("drawn", values["t"])

    def drawn(self, handle):
        return handle


def test_submissions_carry_the_fastest_time_yet_and_the_likely_best_is_drawn_once():
    runner, times, drained = _ListRunner(), [3.0, 2.0, 5.0], []
    assignments, stored = [{"t": t} for t in times], {}
    simulate_candidates(
        [0, 1, 2],
        assignments,
        runner,
        store=lambda i, row: stored.update({i: row["t"]}),
        late=lambda: False,
        deadline=None,
        fastest=lambda: min(stored.values(), default=math.inf),
        drained=lambda: drained.append(len(stored)),
    )
    assert runner.best_s == [math.inf, 3.0, 2.0] and drained == [2] and stored == {0: 3.0, 1: 2.0, 2: 5.0}
    draws = Draws(runner, assignments)
    draws.start(1)
    assert draws.get(1) == ("drawn", 2.0) and runner.draws == [2.0]  # started once, taken at the end
    assert draws.get(0) == ("drawn", 3.0) and runner.draws == [2.0, 3.0]  # another best: drawn then


class _BatchRunner(_ListRunner):
    """A ``_ListRunner`` that also takes batches, and records what it was given."""

    slots = 2

    def __init__(self) -> None:
        super().__init__()
        self.given = []

    def submit(self, i, values, best_s):
        self.given.append([i])
        return super().submit(i, values, best_s)

    def submit_batch(self, batch, values, best_s):
        self.given.append(list(batch))
        return Pending(batch[0], [(i, dict(v)) for i, v in zip(batch, values)], tuple(batch))

    def wait(self, pending, timeout_s):
        return [row for p in pending for row in (p.handle if p.batch else [p.handle])]


def test_twins_are_submitted_together_where_the_first_of_them_comes():
    runner, stored = _BatchRunner(), {}
    assignments = [{"t": t, "z": z} for t, z in [(1.0, 1), (2.0, 1), (1.0, 2), (3.0, 1), (2.0, 2), (1.0, 3)]]
    simulate_candidates(
        [0, 1, 2, 3, 4, 5],
        assignments,
        runner,
        store=lambda i, row: stored.update({i: row["t"]}),
        late=lambda: False,
        deadline=None,
        twins=lambda v: v["t"],
    )
    assert runner.given == [[0, 2, 5], [1, 4], [3]]
    assert stored == {i: a["t"] for i, a in enumerate(assignments)}


def test_best_plans_keep_the_fastest_feasible_rows_only():
    kept, plan = BestPlans(), object()
    row = dict(iter_time_s=2.0, feasible=True, reason="")
    assert kept.offer(0, {**row, PLAN_KEY: plan}) == row  # the plan is taken off the row
    kept.offer(1, {**row, "iter_time_s": 3.0, PLAN_KEY: plan})
    kept.offer(2, {**row, "iter_time_s": 1.0, "feasible": False, PLAN_KEY: plan})
    kept.offer(3, {**row, PLAN_KEY: plan})
    assert set(kept.plans) == {0, 3}
    kept.offer(4, {**row, "iter_time_s": 1.5, PLAN_KEY: plan})
    assert set(kept.plans) == {4}


def test_a_union_explores_both_parts_and_marks_each_best(tmp_path):
    df = planlab.explore("gpt-tiny", **TINY, space="dp|tp", out=tmp_path)
    assert set(df["space"]) == {"dp", "tp"}
    best = df.attrs["part_best"]
    assert set(best) == {"dp", "tp"} and df.loc[best["tp"], "space"] == "tp"
    saved = pd.read_csv(tmp_path / "results.csv")
    assert set(saved["space"]) == {"dp", "tp"}


def test_the_ranking_drafts_plans_again_only_for_a_space_that_sets_stage_layouts(monkeypatch):
    """Ranking reads each simulated plan's per-stage layout by drafting it again, which for alpa
    solves its integer programs again: only a space with the fine space in it sets one."""
    from planlab.explore import _with_layouts

    assert get_space("megatron*fine").sets_layouts() and get_space("fine|dp").sets_layouts()
    assert not any(get_space(s).sets_layouts() for s in ("alpa*recompute", "megatron*coshard", "dp|tp", "3f1b"))
    df = pd.DataFrame({"simulated": [True, False], "_index": [0, 1], "screen_time_s": [1.0, 2.0]})
    for name, drafted in (("dp*tp", 0), ("dp*tp*fine", 1)):
        sp, calls = get_space(name), []
        monkeypatch.setattr(sp, "draft", lambda ctx, values, calls=calls: calls.append(values) or DraftOf(None))
        out = _with_layouts(sp, None, [{"dp": 1}, {"dp": 2}], df)
        assert len(calls) == drafted and list(out.columns) == list(df.columns)


@dataclasses.dataclass(frozen=True)
class DraftOf:
    layout: object


def test_plans_that_break_a_rule_are_rows_with_the_rule():
    sp = get_space("megatron").allow_split(r"mlp\.fc$", ("a0",))  # batch only: no tensor parallelism there
    df = planlab.explore("gpt-tiny", **TINY, space=sp, candidates=None)
    broken = df[df["tp"] == 2]
    assert len(broken) and broken["reason"].str.contains("breaks the rule split").all()
    assert not broken["simulated"].any() and df[df["tp"] == 1]["simulated"].all()


def test_explore_stops_on_a_user_space_that_raises():
    with pytest.raises(ConfigError, match="space 'broken' raised RuntimeError: boom while applying the plan of dp=2"):
        planlab.explore("gpt-tiny", **TINY, space="test_spaces:Broken")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(budget=-1), "--budget must be a number of seconds >= 0, got -1"),
        (dict(candidates=0), "--candidates must be a positive integer, got 0"),
        (dict(jobs=0), "--jobs must be a positive integer, got 0"),
        (dict(space="megatron", fixed={"tp": 2, "pp": 2}), "space 'megatron' has no plan with tp=2, pp=2 fixed"),
    ],
)
def test_bad_options(kwargs, message):
    with pytest.raises(ConfigError) as info:
        planlab.explore("gpt-tiny", **TINY, **kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_space_without_plans_leaves_the_journal_as_it_was(tmp_path, jobs):
    """The plans are enumerated (and, with workers, screened meanwhile) before the journal is opened:
    a space that has none ends with its one line and leaves an earlier exploration's journal alone."""
    (tmp_path / "simulations.jsonl").write_text("an earlier exploration\n")
    with pytest.raises(ConfigError, match="space 'megatron' has no plan with tp=2, pp=2 fixed"):
        planlab.explore("gpt-tiny", **TINY, fixed={"tp": 2, "pp": 2}, jobs=jobs, out=tmp_path)
    assert (tmp_path / "simulations.jsonl").read_text() == "an earlier exploration\n"


def test_out_writes_the_plots_of_the_best_plan(tmp_path):
    df = planlab.explore("gpt-tiny", **TINY, out=tmp_path, candidates=4)
    for name in ("results.csv", "pareto.png", "best_plan.json", "timeline.png", "memory.png"):
        assert (tmp_path / name).stat().st_size > 1000, name
    assert not list(tmp_path.glob("*.tmp*"))
    planlab.explore("gpt-tiny", **TINY, out=tmp_path, budget=0)  # no best plan: its files go
    assert not (tmp_path / "best_plan.json").exists() and not (tmp_path / "timeline.png").exists()
    assert (tmp_path / "pareto.png").exists() and len(df)


def test_outputs_draw_the_evaluated_best_plan_without_materializing_it_again(tmp_path, monkeypatch):
    """A serial exploration keeps the best candidate's Program: the outputs simulate it again only
    to record its timeline, and a lone candidate records its timeline as it is simulated."""
    ex = sys.modules["planlab.explore"]  # the module (planlab.explore is the function)

    calls = []
    real_build, real_simulate = ex.build_program, ex.simulate
    monkeypatch.setattr(ex, "build_program", lambda *a, **k: calls.append("build") or real_build(*a, **k))
    monkeypatch.setattr(ex, "simulate", lambda *a, **k: calls.append(("sim", k["timeline"])) or real_simulate(*a, **k))
    df = planlab.explore("gpt-tiny", **TINY, out=tmp_path / "many", candidates=3)
    n = int(df["simulated"].sum())
    assert n > 1 and calls.count("build") == n and calls.count(("sim", True)) == 1
    calls.clear()
    best = {k.name: df.loc[0, k.name] for k in get_space("megatron").all_knobs()}
    lone = planlab.explore(
        "gpt-tiny", **TINY, fixed={k: getattr(v, "item", lambda: v)() for k, v in best.items()}, out=tmp_path
    )
    assert calls == ["build", ("sim", True)]
    assert lone.loc[0, "iter_time_s"] == df.loc[0, "iter_time_s"]  # recording the timeline changes nothing
    assert (tmp_path / "timeline.png").stat().st_size > 1000


def test_workers_send_the_best_plans_drawing_and_the_parent_simulates_nothing(tmp_path, monkeypatch):
    """With --jobs, a worker draws the likely best plan's timeline once the last candidate is
    submitted, and the final best's if it is another, and no other row's: the parent neither builds
    nor simulates the best plan, and draws the same timeline and memory plots as a serial run."""
    ex = sys.modules["planlab.explore"]
    calls = []  # the parent's: a forked worker appends to its own copy
    drawn = tmp_path / "drawn.log"  # the workers' drawings, one line each
    real_build, real_simulate, real_drawing_of = ex.build_program, ex.simulate, ex.drawing_of
    monkeypatch.setattr(ex, "build_program", lambda *a, **k: calls.append("build") or real_build(*a, **k))
    monkeypatch.setattr(ex, "simulate", lambda *a, **k: calls.append("sim") or real_simulate(*a, **k))
    monkeypatch.setattr(ex, "drawing_of", lambda r: drawn.open("a").write("d\n") and real_drawing_of(r))
    serial = planlab.explore("gpt-tiny", **TINY, out=tmp_path / "serial", candidates=3)
    calls.clear()
    drawn.unlink()
    jobs = planlab.explore("gpt-tiny", **TINY, out=tmp_path / "jobs", candidates=3, jobs=2)
    # the likely best drawn as the last candidates finish, then the final best if it is another row
    assert calls == [] and drawn.read_text() in ("d\n", "d\nd\n") and int(jobs["simulated"].sum()) == 7
    pd.testing.assert_frame_equal(jobs, serial)
    for name in ("timeline.png", "memory.png"):
        assert (tmp_path / "jobs" / name).read_bytes() == (tmp_path / "serial" / name).read_bytes(), name


def test_workers_draw_a_candidate_as_simulated_and_send_only_plans_that_could_be_the_best():
    ctx, cost, g = make_context(Setup(ModelSpec("gpt-tiny"), "cpu", 2, 8))
    sp = get_space("megatron")
    values = sp.enumerate(ctx)[0]
    drawing = drawn_candidate(sp, ctx, cost, values)
    _, res = evaluate(sp.build(ctx, values), g, cost, timeline=True)
    assert isinstance(drawing, Drawing) and drawing.strips and drawing.lines
    assert drawing.iter_time_s == res.iter_time_s and drawing.peak_mem_bytes == res.peak_mem_bytes
    row = kept_candidate(sp, ctx, cost, values, math.inf)  # a worker's row: its Plan only if it could be the best
    assert row["feasible"] and isinstance(row[PLAN_KEY], Plan)
    assert PLAN_KEY not in kept_candidate(sp, ctx, cost, values, row["iter_time_s"] * (1 - 1e-9))
    assert PLAN_KEY in kept_candidate(sp, ctx, cost, values, row["iter_time_s"])  # a tie could be the best


# -- choosing candidates and the front ---------------------------------------------------------------
@pytest.mark.parametrize(
    "points, tol, expected",
    [
        ([(1.0, 5.0), (2.0, 3.0), (3.0, 4.0), (4.0, 1.0)], 0.0, [True, True, False, True]),
        ([(1.0, 5.0), (1.0, 5.0), (1.0, 6.0)], 0.0, [True, True, False]),
        ([(1.0, 5.0), (1.0, 4.0)], 0.0, [False, True]),  # as fast with less memory
        ([(1.0, 5.0), (1.04, 6.0), None], 0.05, [True, True, False]),
        ([(1.0, 5.0), (1.10, 6.0)], 0.05, [True, False]),
    ],
)
def test_front(points, tol, expected):
    assert front(points, tol) == expected


def test_candidates_take_the_fastest_that_fit_the_front_and_each_part():
    gib = 2**30
    est = [(1.0, 100 * gib), (2.0, 50 * gib), (3.0, 40 * gib), (4.0, 70 * gib), (5.0, 10 * gib), None, (9.0, 60 * gib)]
    parts = {"a": [False] * 6 + [True]}
    got = candidates(est, k=1, memory_bytes=80 * gib, parts=parts)
    assert got[0] == 1  # the fastest that fits (0 needs 100 GiB, over the screen's error too)
    assert 5 not in got and 0 not in got and 6 in got  # the best of part a
    assert set(candidates(est, k=None, memory_bytes=80 * gib)) == {0, 1, 2, 3, 4, 6}
    assert candidates([(1.0, 90 * gib), (2.0, 95 * gib)], k=1, memory_bytes=80 * gib) == [0]  # none fits: smallest


def test_candidates_keep_the_fastest_within_the_screens_memory_error():
    """A plan the screen puts over the device by less than its known error is simulated when it is
    among the k fastest of those (the simulator judges it); one further over is not."""
    gib = 2**30
    over = 80 * (1 + SCREEN_MEMORY_ERROR)
    est = [(1.0, (over + 1) * gib), (2.0, (over - 1) * gib), (3.0, 70 * gib), (4.0, 60 * gib), (5.0, 50 * gib)]
    got = candidates(est, k=2, memory_bytes=80 * gib)
    assert got[:3] == [1, 2, 3] and 0 not in got  # 1 by the error; 2 and 3, the fastest that fit
    assert candidates(est, k=1, memory_bytes=80 * gib)[:2] == [1, 2]


def test_a_parts_fastest_within_the_screens_memory_error_is_not_crowded_out_by_the_other_parts():
    """A product's part (the grid in ``megatron*coshard``, where co-sharded plans fill the k fastest
    within the screen's memory error) keeps the plan the part alone would find through that error:
    swin-32's grid best, 29.3 GiB by the screen on a 26.2 GiB device (25.2 simulated)."""
    gib = 2**30
    est = [(3.0, 90 * gib), (1.0, 85 * gib), (2.0, 88 * gib), (5.0, 50 * gib), (6.0, 40 * gib)]
    grid = [True, False, False, False, True]
    got = candidates(est, k=2, memory_bytes=80 * gib, parts={"grid": grid, "coshard": [not g for g in grid]})
    assert got == [1, 2, 0, 3, 4]  # 1 and 2 by the error, 3 and 4 that fit; 0: the grid's fastest within the error
    assert 0 not in candidates(est, k=2, memory_bytes=80 * gib)  # not without the parts


def test_a_products_factors_as_composed_are_parts_whose_fastest_is_kept():
    """``megatron*coshard``'s parts are the grid's own (pp, dp, tp, ...) and coshard; the grid itself
    (every coshard knob at its default) is a factor too, so its fastest plan is simulated."""
    sp = get_space("megatron*coshard")
    assert [f.name for f in sp.factors()] == ["megatron", "coshard"] and "megatron" not in part_masks(
        sp, pd.DataFrame()
    )
    rows = [dict(dp=2, tp=1, coshard=c, coshard_blocks="attention", coshard_outputs="keep") for c in (1, 2)]
    masks = factor_masks(sp, pd.DataFrame(rows))
    assert masks["megatron"] == [True, False] and masks["coshard"] == part_masks(sp, pd.DataFrame(rows))["coshard"]
    assert factor_masks(get_space("megatron"), pd.DataFrame(rows)) == part_masks(
        get_space("megatron"), pd.DataFrame(rows)
    )


def test_evaluate_prunes_by_the_bound_and_names_the_memory():
    spec, g = traced("gpt-tiny", 8)
    cost = CostModel.load("cpu", 2)
    plan = get_space("megatron").build(Context(g, spec, 8, "cpu", 2, 2, 1), dict(dp=2, tp=1, pp=1, microbatch=4))
    device = dataclasses.replace(cost.cluster.device, memory_bytes=1000)
    small = CostModel(dataclasses.replace(cost.cluster, node=dataclasses.replace(cost.cluster.node, device=device)))
    row, res = evaluate(plan, g, small)
    assert res is None and not row["feasible"] and math.isnan(row["iter_time_s"])
    assert "weights, gradients and optimizer states alone need" in row["reason"]


def test_workers_end_when_terminated_whatever_sigterm_handler_the_parent_has():
    """Forked workers inherit their parent's signal handlers (torch's elastic launcher installs one
    for SIGTERM that returns): Pool.terminate must still end them, or an exploration that runs out
    of budget would wait forever."""
    code = """
import signal, time
signal.signal(signal.SIGTERM, lambda *a: None)
from planlab.candidates import Workers
w = Workers(2, None)
w.pool.apply_async(time.sleep, (120,))
time.sleep(1.0)
t = time.perf_counter()
w.close(kill=True)
print(round(time.perf_counter() - t))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) < 60


@pytest.mark.parametrize(
    "knobs",
    [
        dict(dp=1, tp=2, pp=2, microbatch=2, schedule="interleaved", virtual_stages=2),
        dict(dp=1, tp=4, pp=2, microbatch=2, schedule="1f1b", virtual_stages=1),
        dict(dp=2, tp=2, pp=2, microbatch=1, schedule="interleaved", virtual_stages=2, recompute="full"),
    ],
)
def test_the_screen_counts_each_pipeline_transfer_once(knobs):
    """Per device group, one transfer per tensor and receiving stage (the activation on the
    receiving group, its gradient on the sending one), counted from the graph apart; a split whose
    pieces number a stage's index (tp=2, stage 2) must not hide one."""
    spec, g = traced("gpt-small", 8)
    n = knobs["dp"] * knobs["tp"] * knobs["pp"]
    ctx = Context(g, spec, 8, "cpu", n, n, 1)
    base = dict(zero=0, sequence_parallel=False, recompute="none", ep=1, etp=1, cp=1, cp_kind="a2a", cp_layout="auto")
    modules = dict(recompute_moe_act=False, recompute_mlp=False, recompute_mla_up_proj=False)
    values = {
        **base,
        **modules,
        "first_stage_layers": 0,
        "last_stage_layers": 0,
        "pipeline_group": 0,
        "expert_overlap": False,
        **knobs,
    }
    assert values in get_space("megatron").enumerate(ctx)
    d = get_space("megatron").draft(ctx, values)
    s = Screen(g, CostModel.load("cpu", n), precision_for("cpu")).structure(d)
    expected = [0] * d.groups
    for t, sc in {
        (t, d.stages[op.name])
        for op in g.operators
        for t in op.inputs
        if t in g.producer and g.tensors[t].role != "param" and d.stages[g.producer[t].name] != d.stages[op.name]
    }:
        expected[sc % d.groups] += 1
        expected[d.stages[g.producer[t].name] % d.groups] += 1
    assert [sum(n for _, n in p) for p in s.p2p] == expected
    assert sum(expected) > 0
