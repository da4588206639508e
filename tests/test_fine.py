"""The fine-grained space: per-stage layer counts, recomputation and offloading chosen by an
integer program (HiGHS) over per-layer costs; its choices on hand-checkable cases, its refusals,
and a fine plan's numerics on gloo."""

import pytest

from planlab.cli import GRAD_TOL, LOSS_TOL
from planlab.errors import ConfigError, InfeasiblePlan, PlanFileError
from planlab.executor import launch_local
from planlab.plan import PlanBuilder, materialize, plan_from_json, plan_to_json
from planlab.plan.plan_file import plan_to_dict
from planlab.plan.program import Role
from planlab.search_spaces import Context, get_space
from planlab.search_spaces.fine import apply_layout, choose_layout, solve_layout
from planlab.search_spaces.fine_costs import StageCosts
from planlab.search_spaces.screen import GroupCost
from planlab.simulator import find_deadlock

from conftest import traced

NONE = GroupCost(0.0, 0.0, 0.0, 0.0, 0.0)


def _costs(first=NONE, last=NONE, **kw):
    base = dict(
        layer_s=1.0,
        recompute_s=0.3,
        sync_s=0.0,
        offload_sync_s=0.0,
        static_bytes=1.0,
        offload_static_bytes=1.0,
        saved_bytes=10.0,
        recompute_saved_bytes=1.0,
        work_bytes=0.0,
        p2p_s=0.0,
        first=first,
        last=last,
        can_offload=False,
    )
    return StageCosts(**{**base, **kw})


def test_a_memory_limit_forces_recompute_on_the_first_stage_only():
    # 1F1B keeps 2 micro-batches in flight on stage 0 of 2 and 1 on stage 1: 2 + 2 x 20 = 42 > 30
    # bytes on stage 0 without recomputation, 2 + 2 x 11 = 24 with one layer recomputed; moving a
    # layer to stage 1 instead costs more time (3 layers: 3 + 30 > 30 would need recompute there too)
    got = solve_layout(_costs(), layers=4, stages=2, m=8, cap_bytes=30.0)
    assert (got.layers, got.recompute, got.offload) == ((2, 2), (1, 0), (False, False))
    # with room for everything, nothing recomputes
    assert solve_layout(_costs(), layers=4, stages=2, m=8, cap_bytes=100.0).recompute == (0, 0)


def test_a_stage_that_recomputes_pays_the_regrown_layer_once():
    # as above, but a recomputed layer's forward, run again before its backward, keeps 10 bytes for
    # it: one recomputed layer on stage 0 needs 2 + 2 x 11 + 10 = 34 > 30, both 2 + 2 x 2 + 10 = 16
    got = solve_layout(_costs(recompute_work_bytes=10.0), layers=4, stages=2, m=8, cap_bytes=30.0)
    assert (got.layers, got.recompute) == ((2, 2), (2, 0))


def test_a_heavy_output_layer_makes_the_last_stage_shorter():
    # the last stage's head and loss take 2 layers' time: 4 + 2 layers balance at 4 and 2 + 2
    head = GroupCost(2.0, 0.0, 0.0, 0.0, 0.0)
    got = solve_layout(_costs(last=head), layers=6, stages=2, m=8, cap_bytes=1e9)
    assert (got.layers, got.recompute) == ((4, 2), (0, 0))


def test_offloading_goes_where_the_memory_is_short():
    # optimizer states: 5 bytes a layer of 6 on the device; offloaded they leave (1), at a sync cost
    c = _costs(static_bytes=6.0, offload_static_bytes=1.0, sync_s=0.01, offload_sync_s=0.05, can_offload=True)
    got = solve_layout(c, layers=4, stages=2, m=8, cap_bytes=40.0)
    # stage 0: 12 + 2 x 20 = 52 > 40; offloaded 2 + 40 = 42 > 40; recomputing one: 12 + 22 = 34 fits
    assert got.offload == (False, False) and got.recompute == (1, 0)
    # 33: stage 1 fits as it is (12 + 20); stage 0 offloads and recomputes one layer (2 + 22), which
    # beats recomputing both (12 + 4) by 0.3 s a micro-batch for 0.08 s of sync
    got = solve_layout(c, layers=4, stages=2, m=8, cap_bytes=33.0)
    assert (got.layers, got.recompute, got.offload) == ((2, 2), (1, 0), (True, False))
    assert solve_layout(c, layers=4, stages=2, m=8, cap_bytes=3.0) is None


def test_interleaved_chunks_balance_at_the_slowest_chunk():
    # 10 layers in 4 chunks on 2 devices (chunks 0 and 2 on device 0); the head costs 2 layers: chunk
    # times 3, 3, 3, 1 + 2 make both devices 6 and no chunk slower than 3
    head = GroupCost(2.0, 0.0, 0.0, 0.0, 0.0)
    got = solve_layout(_costs(last=head), layers=10, stages=4, m=8, cap_bytes=1e9, schedule="interleaved", chunks=2)
    assert (got.layers, got.recompute, got.offload) == ((3, 3, 3, 1), (0, 0, 0, 0), (False, False))
    # 9 layers and a head of 3: the last chunk runs the head alone (Llama 3's balanced pipeline), chunk
    # times 3, 3, 3, 0 + 3; a layer on it would make it 4
    head = GroupCost(3.0, 0.0, 0.0, 0.0, 0.0)
    got = solve_layout(_costs(last=head), layers=9, stages=4, m=8, cap_bytes=1e9, schedule="interleaved", chunks=2)
    assert got.layers == (3, 3, 3, 0)


def _ctx(layers=3, n=2, cluster="cpu"):
    spec, g = traced("gpt-tiny", 8, (("layers", layers),))
    return Context(g, spec, 8, cluster, n if cluster == "cpu" else 1, n, 1), g


def _fine_plan(layout, ctx):
    space = get_space("megatron")
    knobs = dict(pp=2, dp=1, tp=1, microbatch=2, recompute="none")
    draft = space.draft(ctx, space.with_defaults(knobs))
    apply_layout(draft, layout)
    return draft.to_plan(space="megatron*fine", knobs=knobs)


def test_bad_layouts_are_refused_in_one_line_naming_the_knob():
    from planlab.search_spaces.stages import StageLayout

    ctx, _ = _ctx()
    for layout, match in (
        (StageLayout((1, 1)), r"stage_layers=\(1, 1\).*add up to the model's 3 layers"),
        (StageLayout((1, 1, 1)), r"3 counts for pp=2 stages"),
        (StageLayout((2, 1), recompute=(3, 0)), r"stage_recompute=\(3, 0\).*from 0 to its stage's layers"),
        (StageLayout((2, 1), offload=(True,)), r"stage_offload=\(True,\): expected 2 booleans"),
    ):
        with pytest.raises(ConfigError, match=match) as e:
            _fine_plan(layout, ctx)
        assert "\n" not in str(e.value)
    with pytest.raises(Exception, match="stages=.*with offload off"):
        PlanBuilder(
            ctx.graph, model=ctx.model, global_batch=8, cluster="cpu", nodes=2, num_devices=2
        ).offload_optimizer(False, (0,))


def test_the_space_composes_with_the_grid_and_refuses_what_it_chooses_itself():
    ctx, _ = _ctx(layers=4)
    space = get_space("megatron*fine")
    plans = list(space.assignments(ctx, {"pp": 2, "tp": 1, "fine_layout": "program"}))
    assert plans and all(p["recompute"] in ("none", "selective") for p in plans)
    with pytest.raises(ConfigError, match="fine space chooses.*recompute='full'.*fine_layout=program"):
        space.build(ctx, dict(pp=2, tp=1, recompute="full", fine_layout="program"))
    with pytest.raises(ConfigError, match="fine_offload=True on cluster 'cpu'"):
        space.build(ctx, dict(pp=2, tp=1, fine_offload=True))
    with pytest.raises(ConfigError, match="fine_layout=grid keeps the grid point's own plan"):
        space.build(_ctx(layers=4, cluster="dgx-a100-80g")[0], dict(pp=2, tp=1, fine_offload=True, fine_layout="grid"))
    knobs = dict(pp=2, tp=1, dp=1, microbatch=2)
    got = choose_layout(get_space("megatron").draft(ctx, space.with_defaults(knobs)), False)
    assert got.layout is not None and got.layout.layers == (2, 2) and got.layout.recompute == (0, 0)
    with pytest.raises(InfeasiblePlan, match="program chose the grid point's own plan"):
        space.draft(ctx, space.with_defaults({**knobs, "fine_layout": "program"}))


def test_a_per_stage_offloaded_plan_offloads_those_stages_only_and_round_trips():
    from planlab.search_spaces.stages import StageLayout

    ctx, g = _ctx(layers=3, cluster="dgx-a100-80g")
    plan = _fine_plan(StageLayout((2, 1), (1, 0), (True, False)), ctx)
    assert plan.offload_stages == (0,)
    program = materialize(plan, g)
    find_deadlock(program)
    host_steps = {
        d
        for d, dp in enumerate(program.devices)
        for b in dp.blocks.values()
        for t in b.tasks
        if t.role is Role.HOST_STEP
    }
    assert host_steps == {0}
    assert plan_from_json(plan_to_json(plan)).offload_stages == (0,)
    d = plan_to_dict(plan)
    d["offload_optimizer"] = False
    import json

    with pytest.raises(PlanFileError, match="offload_stages.*needs 'offload_optimizer'"):
        plan_from_json(json.dumps(d))


@pytest.mark.parametrize(
    "n, layout, v",
    [
        (2, ((2, 1), (1, 0), (True, False)), 1),
        (2, ((0, 2, 1, 1), (0, 1, 0, 1), (False, True)), 2),
        pytest.param(4, ((2, 1), (0, 1)), 1, marks=pytest.mark.slow),
    ],
)
def test_uneven_layers_with_per_stage_recompute_match_one_process_on_gloo(n, layout, v):
    """Stage 0 holds 2 of 3 layers and recomputes its own number of them (on 2 ranks it also keeps its
    optimizer on the host, stage 1 not); interleaved over 2 chunks a device, the first chunk runs only
    the embedding, two chunks recompute and device 1 offloads: two steps match one process."""
    from planlab.search_spaces.stages import StageLayout

    spec, g = traced("gpt-tiny", 8, (("layers", sum(layout[0])),))
    ctx = Context(g, spec, 8, "cpu", n, n, 1)
    space = get_space("megatron")
    knobs = dict(pp=2, dp=n // 2, tp=1, microbatch=2, recompute="none")
    if v > 1:
        knobs.update(schedule="interleaved", virtual_stages=v)
    draft = space.draft(ctx, space.with_defaults(knobs))
    apply_layout(draft, StageLayout(*layout))
    plan = draft.to_plan(space="megatron*fine", knobs=knobs)
    assert {p.recompute for p in plan.ops} != {0}
    res = launch_local(plan, n, steps=2, lr=1e-2, record=True)
    assert res.max_loss_error <= LOSS_TOL, (res.losses, res.ref_losses)
    assert res.max_grad_error <= GRAD_TOL
    assert res.losses[1] < res.losses[0]
    hosted = {t["device"] for t in res.timeline if t["task"].startswith("host-optimizer")}
    assert hosted == ({d for d, o in enumerate(layout[2]) if o} if len(layout) > 2 else set())


def test_explore_reports_each_simulated_plan_s_stage_layout(tmp_path):
    """results.csv carries the fine space's choice per simulated plan (layers and recomputed layers
    per stage, offload per device group); the grid's plans have none."""
    import pandas as pd

    import planlab
    from planlab.models import ModelSpec

    # the grid's plan puts 2 layers on the first stage (last_stage_layers=1), the program 1
    fixed = dict(pp=2, tp=1, dp=1, microbatch=8, zero=0, sequence_parallel=False, last_stage_layers=1)
    df = planlab.explore(
        ModelSpec("gpt-tiny", (("layers", 3),)),
        cluster="cpu",
        nodes=2,
        global_batch=8,
        space="megatron*fine",
        fixed=fixed,
        candidates=None,
        out=tmp_path,
    )
    sim = df[df["simulated"] & (df["fine_layout"] == "program")]
    assert len(sim) and all(v == (1, 2) for v in sim["stage_layers"])
    assert all(len(v) == 2 for v in sim["stage_recompute"]) and all(len(v) == 2 for v in sim["stage_offload"])
    assert df[df["simulated"] & (df["fine_layout"] == "grid")]["stage_layers"].isna().all()
    assert df[~df["simulated"]]["stage_layers"].isna().all()
    assert "stage_layers" in pd.read_csv(tmp_path / "results.csv").columns


def test_zero3_gathers_one_unit_per_device_not_one_per_layer():
    """Under ZeRO-3 a device holds the unit it computes gathered once, whatever its layers: the
    per-layer static memory is the shards only, and the gathered unit is the device's once-only part."""
    from planlab.costmodel import CostModel
    from planlab.search_spaces.fine_costs import stage_costs
    from planlab.search_spaces.screen import Screen

    ctx, g = _ctx(layers=5, n=2)
    space = get_space("megatron")
    cost = CostModel.load("cpu", 2)
    screen = Screen(g, cost, cost.precision)
    got = {}
    for zero in (0, 3):
        d = space.draft(ctx, space.with_defaults(dict(pp=1, dp=2, tp=1, microbatch=2, zero=zero, recompute="none")))
        got[zero] = stage_costs(screen, d, False)
    assert got[0].unit_static_bytes == pytest.approx(0.0, abs=1e-6 * got[0].static_bytes)
    # fp32 on cpu: 4 + 4 + 8 bytes a parameter, all sharded over dp=2 under ZeRO-3; the unit's 4 gathered
    assert got[3].static_bytes == pytest.approx(got[0].static_bytes / 2, rel=1e-3)
    assert got[3].unit_static_bytes == pytest.approx(got[0].static_bytes / 4, rel=1e-3)


@pytest.mark.parametrize("pp,microbatch", [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_zero3_exposes_a_stage_s_first_gathers_once_so_the_walk_is_never_above_the_screen(pp, microbatch):
    """A one-layer probe group exposes its unit's ZeRO-3 gathers, which a stage of many layers exposes
    once (the next units' are prefetched): charged per layer, the walk ran 14-20% over the screen at
    these plans (and 7.7% over the simulator at LLaMA-3 70B's grid best on 256 H100), so a fine
    layout's walked time, a bound's floor, was not a floor. The walk of the grid plan's own layout
    stays at or under the screen's estimate of it, and a stage's once-only part is ZeRO-3's alone."""
    from planlab.search_spaces.fine import fine_cost_model, point_costs
    from planlab.search_spaces.fine_bound import grid_plan_cost
    from planlab.search_spaces.screen import Screen

    ctx, g = _ctx(layers=6, n=2 * pp)
    space = get_space("megatron")
    cost = fine_cost_model(ctx)
    screen = Screen(g, cost, cost.precision)
    for zero in (0, 3):
        knobs = space.with_defaults(dict(pp=pp, dp=2, tp=1, microbatch=microbatch, zero=zero, recompute="none"))
        draft = space.draft(ctx, knobs)
        walked_s, fits, _ = grid_plan_cost(ctx, space, knobs)
        screen_s = screen.estimate(draft).time_s
        assert screen_s * 0.95 <= walked_s <= screen_s * 1.01  # zero 0: up to +0.7% (the sync)
        unit_s = point_costs(draft, False).unit_s
        assert unit_s > 0 if zero == 3 else unit_s == pytest.approx(0.0, abs=1e-12)


def test_pruning_by_the_lp_bound_keeps_the_best_programs_of_the_unpruned_search():
    # a family of grid points (micro-batches, stages, chunks, memory) solved in order, as the space
    # does: each pruned point's LP bound is at least the worst of the best 3 so far, so the best 3
    # objectives are those of solving every program, and some points were pruned
    from planlab.search_spaces.fine import Incumbents, solve_program

    head = GroupCost(2.0, 0.0, 0.0, 0.0, 0.0)
    points = [
        (m, stages, chunks, cap)
        for cap in (1e9, 60.0)
        for m in (16, 4)
        for stages, chunks in ((2, 1), (4, 2), (4, 1), (8, 2))
    ]
    c = _costs(last=head)
    full = [solve_program(c, 12, s, m, cap, "interleaved" if v > 1 else "1f1b", v) for m, s, v, cap in points]
    keep = Incumbents(keep=3)
    pruned = []
    for m, s, v, cap in points:
        got = solve_program(c, 12, s, m, cap, "interleaved" if v > 1 else "1f1b", v, keep.bar_s())
        if got.layout is not None:
            keep.add(got.objective_s)
        pruned.append(got)
    statuses = {got.status for got in pruned}
    assert "pruned" in statuses and "optimal" in statuses
    best = sorted(got.objective_s for got in full if got.layout is not None)[:3]
    assert sorted(got.objective_s for got in pruned if got.layout is not None)[:3] == pytest.approx(best)
    for a, b in zip(full, pruned):  # a pruned point's bound is a true lower bound of its program
        assert b.status != "pruned" or b.objective_s <= a.objective_s + 1e-9


def test_the_balanced_bound_is_never_above_the_lp_relaxation():
    # the bound that prunes without a solver relaxes the LP relaxation further: on a family of points
    # (1F1B and interleaved, memory tight or not, a heavy head, offloading) it is at most the LP's
    # objective, and on some it is close enough to prune
    from scipy.optimize import Bounds, LinearConstraint, milp

    from planlab.search_spaces.fine import balanced_bound_s, program_arrays

    head, emb = GroupCost(2.0, 0.1, 3.0, 1.0, 0.0), GroupCost(0.5, 0.0, 2.0, 0.5, 0.0)
    c = _costs(first=emb, last=head, sync_s=0.01, offload_sync_s=0.005, static_bytes=6.0, can_offload=True)
    seen = 0
    for cap in (1e9, 90.0):
        for m in (16, 4):
            for stages, chunks in ((2, 1), (4, 2), (4, 1), (8, 2), (6, 3)):
                sched = "interleaved" if chunks > 1 else "1f1b"
                cost, rows, lower, upper, _, lp = program_arrays(c, 12, stages, m, cap, sched, chunks)
                relaxed = milp(cost, constraints=LinearConstraint(rows, lp.lo, lp.hi), bounds=Bounds(lower, upper))
                if relaxed.x is None:
                    continue
                bound = balanced_bound_s(c, 12, stages, m, chunks)
                assert bound <= relaxed.fun + 1e-9, (m, stages, chunks, cap)
                seen += bound >= 0.9 * relaxed.fun
    assert seen


def test_two_jobs_give_the_rows_of_one(monkeypatch, caplog):
    """The fine space prunes against the programs solved before a point; explore drafts every
    assignment in order before its workers fork, so --jobs 2 prunes the points --jobs 1 does and
    every row (screen figures, simulated times, per-stage layouts, reasons) is the same."""
    import logging

    import pandas as pd

    import planlab
    import planlab.search_spaces.fine as fine
    from planlab.models import ModelSpec

    monkeypatch.setattr(fine, "PRUNE_KEEP", 3)  # a small grid prunes too
    caplog.set_level(logging.DEBUG, logger="planlab.search_spaces.fine")
    frames = [
        planlab.explore(
            ModelSpec("gpt-tiny", (("layers", 7),)),
            cluster="cpu",
            nodes=4,
            global_batch=16,
            space="megatron*fine",
            fixed=dict(zero=0),
            candidates=8,
            jobs=jobs,
        )
        for jobs in (1, 2)
    ]
    statuses = {str(r.args[0]) for r in caplog.records if r.name == "planlab.search_spaces.fine" and r.args}
    assert {"pruned", "optimal"} <= statuses
    assert all("stage_layers" in f and f["stage_layers"].notna().any() for f in frames)
    pd.testing.assert_frame_equal(frames[0], frames[1])


def test_the_fine_space_keeps_every_plan_of_the_grid_beside_the_program_s():
    """megatron*fine holds each grid plan as it is (fine_layout=grid, recompute=full included)
    besides the program's layout of its point; a program's layout that is the grid's plan again,
    or none, is left out with its reason, so the screen sees each plan once."""
    ctx, _ = _ctx(layers=4)
    grid, fine = get_space("megatron"), get_space("megatron*fine")
    ours = {tuple(sorted(a.items())) for a in fine.assignments(ctx)}
    plans = list(grid.assignments(ctx))
    assert any(a["recompute"] == "full" for a in plans)
    for a in plans:
        b = {**a, "fine_layout": "grid", "fine_offload": False}
        assert tuple(sorted(b.items())) in ours
        mine, theirs = fine.draft(ctx, b), grid.draft(ctx, a)
        assert (mine.stages, mine.recompute, mine.num_stages, mine.chunks, mine.microbatches, mine.layout) == (
            theirs.stages,
            theirs.recompute,
            theirs.num_stages,
            theirs.chunks,
            theirs.microbatches,
            None,
        )
    refused = 0
    for a in fine.assignments(ctx, {"fine_layout": "program"}):
        try:
            d = fine.draft(ctx, a)
        except InfeasiblePlan as e:
            refused += 1
            assert "fine_layout=program:" in str(e) and "\n" not in str(e)
            continue
        assert d.layout is not None and (d.stages, d.recompute) != (grid.draft(ctx, a).stages, {})
    assert refused


def test_exploring_the_fine_space_never_loses_to_the_grid():
    # every plan simulated (candidates=None): the fine space's best is at most the grid's, and the
    # program's rows it left out say why
    import planlab
    from planlab.models import ModelSpec

    fixed = dict(tp=1, zero=0, sequence_parallel=False)
    frames = {
        space: planlab.explore(
            ModelSpec("gpt-tiny", (("layers", 5),)),
            cluster="cpu",
            nodes=2,
            global_batch=8,
            space=space,
            fixed=fixed,
            candidates=None,
        )
        for space in ("megatron", "megatron*fine")
    }
    best = {s: df[df["feasible"] == True]["iter_time_s"].min() for s, df in frames.items()}  # noqa: E712
    assert best["megatron*fine"] <= best["megatron"]
    df = frames["megatron*fine"]
    program = df[df["fine_layout"] == "program"]
    assert len(df[df["fine_layout"] == "grid"]) == len(frames["megatron"])
    left = program[program["screen_time_s"].isna()]
    assert len(left) and left["reason"].str.startswith("fine_layout=program:").all()


def test_the_grid_bound_is_the_best_layout_of_every_point_solving_few_programs():
    # the bound over every point of a small grid solves few programs yet finds the best layout of
    # all (every program solved), the least LP relaxation, and no grid plan (in the program's
    # model) goes under it
    import math

    from planlab.search_spaces.fine import fine_cost_model, solve_program
    from planlab.search_spaces.fine_bound import Point, fine_points, grid_bound, grid_plan_cost

    ctx, _ = _ctx(layers=4)
    grid = get_space("megatron")
    cap = fine_cost_model(ctx).device_memory_bytes
    got = grid_bound(ctx, grid)
    points = [Point.of(d, False) for _, d in fine_points(ctx, grid)]
    assert got.points == len(points) and got.chain_programs < got.chain_lps < len(points) and got.node_limited == 0
    assert got.programs <= got.lps <= got.chain_programs
    # the relaxations solved hold the chains walked at earlier points of their shape: no weaker than without
    assert min(p.relaxed_s(cap) for p in points) <= got.least_lp_s * (1 + 1e-9) <= got.least_s * (1 + 1e-6)
    every = [
        solve_program(
            p.costs, p.layers, p.stages, p.microbatches, cap, p.schedule, p.chunks, group=p.group, walked=True
        )
        for p in points
    ]
    best = min(s.objective_s for s in every if s.layout is not None)
    assert got.best_s == pytest.approx(best, rel=1e-4) and got.least_s <= got.best_s
    assert got.least_s >= got.least_lp_s * (1 - 1e-9) and got.least_s == pytest.approx(best, rel=1e-4)
    for a in grid.assignments(ctx):
        if a["schedule"] in ("1f1b", "gpipe", "interleaved"):
            model_s, fits, layout = grid_plan_cost(ctx, grid, a)
            assert sum(layout.layers) == 4 and math.isfinite(model_s)
            assert not fits or got.least_s <= model_s * (1 + 1e-9)


def test_the_walk_gives_the_closed_forms_of_even_pipelines():
    # even stages, nothing else: 1F1B is (M - 1) t + G t, interleaved 1F1B M T + (G - 1) t_chunk,
    # each plus the last device's sync; a forward is a third of a layer's time here
    from planlab.search_spaces.fine_walk import walk
    from planlab.search_spaces.stages import StageLayout

    c = _costs(layer_s=3.0, sync_s=0.1, forward_share=1 / 3)
    w = walk(c, StageLayout((2, 2, 2, 2)), 8)
    assert w.time_s == pytest.approx(7 * 6 + 4 * 6 + 0.2)
    # the critical path: micro-batch 0 through the pipeline, the last stage's 8, the way back, device 0's sync
    assert (w.forwards, w.backwards, w.hops, w.device) == ((1, 1, 1, 8), (1, 1, 1, 8), 6, 0)
    assert walk(c, StageLayout((1,) * 8), 8, "interleaved", 2).time_s == pytest.approx(8 * 6 + 3 * 3 + 0.2)
    # a transfer between stages is half the stage's p2p each way, on the path, not on the devices: 1F1B on
    # two stages waits for one at each of the 4 hand-offs of its critical path (worked by hand: 30.4)
    got = walk(_costs(layer_s=3.0, p2p_s=0.2), StageLayout((2, 2)), 4)
    assert got.time_s == pytest.approx(3 * 6 + 2 * 6 + 4 * 0.1) and got.hops == 4


def test_the_walk_sees_an_uneven_interleaved_pipeline_stall_where_the_closed_form_does_not():
    # two devices with 8 layers each; unevenly chunked, the interleaved order makes a device wait
    # for the other's long chunk in every round: the walk is 102 against 66 for even chunks, while
    # M T + (G - 1) C (each device's total is the same 8 layers) moves only by the slowest chunk
    from planlab.search_spaces.fine_bound import Point
    from planlab.search_spaces.fine_walk import walk_s
    from planlab.search_spaces.stages import StageLayout

    c = _costs(layer_s=1.0)
    even, uneven = StageLayout((2,) * 8), StageLayout((0, 1, 1, 1, 6, 1, 1, 5))
    closed = Point(c, 16, 8, 8, "interleaved", 4, walked=False)
    assert closed.layout_s(1e9, uneven) - closed.layout_s(1e9, even) == pytest.approx(4.0)  # (G - 1) x (6 - 2)
    assert walk_s(c, even, 8, "interleaved", 4) == pytest.approx(66.0)
    assert walk_s(c, uneven, 8, "interleaved", 4) == pytest.approx(102.0)
    walked = Point(c, 16, 8, 8, "interleaved", 4)
    assert walked.layout_s(1e9, uneven) == pytest.approx(102.0, rel=1e-3)


@pytest.mark.parametrize("schedule,stages,chunks", [("1f1b", 3, 1), ("interleaved", 4, 2)])
def test_the_walked_program_finds_the_best_walk_of_every_layout(schedule, stages, chunks):
    # the walked program against every layout walked: its layout's walk is the least of all,
    # and its proven bound is under every layout's walk
    import itertools

    from planlab.search_spaces.fine_paths import solve_walked, ties_s
    from planlab.search_spaces.fine_walk import walk_s
    from planlab.search_spaces.stages import StageLayout

    head = GroupCost(2.5, 0.0, 0.0, 0.0, 0.0)
    c = _costs(last=head, p2p_s=0.3, sync_s=0.05, forward_share=0.3)
    layers, m, low = 7, 4, 0 if chunks > 1 else 1
    every = []
    for n in itertools.product(range(layers + 1), repeat=stages):
        inner = n[1:-1] if chunks > 1 else n
        if sum(n) == layers and min(inner) >= 1 and min(n) >= low:
            lay = StageLayout(n, (0,) * stages, (False,) * (stages // chunks))
            every.append(walk_s(c, lay, m, schedule, chunks) + ties_s(c, lay))
    layout, found_s, least_s, status = solve_walked(
        (c, layers, stages, m, 1e9, schedule, chunks, 0), float("inf"), False
    )
    assert status == "optimal" and sum(layout.layers) == layers
    assert found_s == pytest.approx(min(every), rel=1e-6)
    assert least_s <= min(every) * (1 + 1e-6)
    assert walk_s(c, layout, m, schedule, chunks) + ties_s(c, layout) == pytest.approx(found_s)


def test_a_fine_offload_row_that_offloads_nothing_is_left_out():
    # a tiny model on an A100 has room for everything: the program allowed to offload offloads no
    # stage, so its plan is the fine_offload=false row's, and that row is not screened twice
    ctx, _ = _ctx(layers=4, cluster="dgx-a100-80g")
    space = get_space("megatron*fine")
    knobs = space.with_defaults(dict(pp=2, tp=1, dp=1, microbatch=2, fine_layout="program", fine_offload=True))
    with pytest.raises(InfeasiblePlan, match="offloads nothing and lays out the plan of fine_offload=false"):
        space.draft(ctx, knobs)
    grid = get_space("megatron").draft(ctx, space.with_defaults(dict(pp=2, tp=1, dp=1, microbatch=2)))
    assert choose_layout(grid, True).layout == choose_layout(grid, False).layout


@pytest.mark.parametrize(
    "schedule,stages,chunks,group",
    [("1f1b", 4, 1, 0), ("gpipe", 3, 1, 0), ("interleaved", 8, 2, 0), ("interleaved", 6, 3, 4)],
)
def test_the_walked_program_at_any_layout_is_its_walk(schedule, stages, chunks, group):
    # the program's rows hold W at the longest path through the schedule's actions, so with the
    # layout fixed its LP gives the walk exactly (with recomputation, offloading, transfers, a heavy
    # head and uneven chunks), not a chain under it: its relaxation bounds every layout at once
    import itertools

    from planlab.search_spaces.fine_bound import Point, _solved_s
    from planlab.search_spaces.fine_paths import ties_s
    from planlab.search_spaces.fine_walk import walk_s
    from planlab.search_spaces.stages import StageLayout

    head, emb = GroupCost(2.5, 0.1, 0.0, 0.0, 0.0), GroupCost(0.4, 0.02, 0.0, 0.0, 0.0)
    c = _costs(first=emb, last=head, p2p_s=0.3, sync_s=0.05, offload_sync_s=0.2, forward_share=0.3, can_offload=True)
    groups, m = stages // chunks, 8
    seen = 0
    for n in itertools.islice(itertools.product((0, 1, 3), repeat=stages), 0, None, 2):
        if chunks == 1 and min(n) == 0 or chunks > 1 and min(n[1:-1]) == 0:
            continue
        off = tuple(d % 2 == 1 for d in range(groups))
        lay = StageLayout(n, tuple(min(1, x) for x in n), off)
        p = Point(c, sum(n), stages, m, schedule, chunks, group)
        want = walk_s(c, lay, m, schedule, chunks, group) + ties_s(c, lay)
        assert _solved_s(p, 1e9, lay) == pytest.approx(want, rel=1e-7)
        seen += 1
    assert seen >= 4


def test_a_grid_bound_from_an_incumbent_solves_fewer_programs_and_finds_the_same_best():
    # the grid best's own layout given as the first incumbent prunes the points that cannot beat it;
    # the best layout found is the same, and an incumbent no layout beats is the answer, with no knobs
    from planlab.search_spaces.fine_bound import grid_bound

    ctx, _ = _ctx(layers=4)
    grid = get_space("megatron")
    free = grid_bound(ctx, grid)
    got = grid_bound(ctx, grid, incumbent_s=free.best_s * 1.01)
    assert got.best_s == pytest.approx(free.best_s, rel=1e-4) and got.knobs == free.knobs
    assert got.lps <= free.lps and got.programs <= free.programs
    low = grid_bound(ctx, grid, incumbent_s=free.least_s * 0.99)
    assert low.knobs == {} and low.best_s == low.least_s == pytest.approx(free.least_s * 0.99)


def test_a_grid_bound_asked_for_enough_proves_that_much_solving_no_more():
    # enough_s under the exact bound (the grid best over a target speedup): the bound proven is
    # enough_s itself, from no more LPs and programs; over the best layout, the exact answer again
    from planlab.search_spaces.fine_bound import grid_bound

    ctx, _ = _ctx(layers=4)
    grid = get_space("megatron")
    free = grid_bound(ctx, grid)
    low = grid_bound(ctx, grid, enough_s=free.least_s * 0.95)
    assert low.least_s == pytest.approx(free.least_s * 0.95)
    assert low.lps <= free.lps and low.programs <= free.programs
    high = grid_bound(ctx, grid, enough_s=free.best_s * 1.05)
    assert (high.least_s, high.best_s, high.knobs) == (free.least_s, free.best_s, free.knobs)


def _bound_costs(offload_sync_s: float):
    """Per-layer costs for the bounds' tests: transfers, a heavy head, an embedding, offloading
    (cheaper or dearer than the sync per ``offload_sync_s``) and a static memory that a small device fills."""
    head, emb = GroupCost(2.5, 0.1, 3.0, 1.0, 0.0), GroupCost(0.4, 0.02, 2.0, 0.5, 0.0)
    c = _costs(first=emb, last=head, p2p_s=0.3, sync_s=0.05, offload_sync_s=offload_sync_s, forward_share=0.3)
    return _costs(**{**c.__dict__, "can_offload": True, "static_bytes": 6.0})


@pytest.mark.parametrize(
    "schedule,stages,chunks,group",
    [("1f1b", 4, 1, 0), ("gpipe", 3, 1, 0), ("1f1b", 8, 1, 0), ("interleaved", 8, 2, 0), ("interleaved", 6, 3, 4)],
)
def test_the_chains_bound_is_never_above_the_walked_relaxation_and_sees_the_bubble(schedule, stages, chunks, group):
    # grid_bound settles a point on the chains' bound without the program's relaxation: so it must
    # never be above that relaxation (a point pruned on it could otherwise hold a layout under the
    # target), on points with transfers, a heavy head, offloading cheaper or dearer than the sync and
    # a tight memory; and where micro-batches are few it is above the bound without the bubble
    from planlab.search_spaces.fine_bound import Point
    from planlab.search_spaces.fine_paths import path_bound_s, walked_bound_s

    above = 0
    for off_s in (0.01, 0.2):
        c = _bound_costs(off_s)
        for m in (4, 8, 16):
            for cap in (1e9, 120.0):
                p = Point(c, 12, stages, m, schedule, chunks, group)
                relaxed = p.relaxed_s(cap)
                bound = path_bound_s(c, 12, stages, m, schedule, chunks, group)
                assert bound <= relaxed * (1 + 1e-9), (off_s, m, cap)
                above += bound > walked_bound_s(c, 12, stages, m, chunks) * 1.01
    assert above


def test_a_grid_bound_with_the_chains_bound_reaches_the_same_bound_from_fewer_relaxations(monkeypatch):
    # the chains' bound only settles points before their LP relaxation: with it taken away (every point
    # relaxed), the bound, the best layout and where it is are the same, from no fewer relaxations
    import math

    from planlab.search_spaces.fine_bound import Point, grid_bound

    ctx, _ = _ctx(layers=4)
    grid = get_space("megatron")
    free = grid_bound(ctx, grid)
    low = grid_bound(ctx, grid, enough_s=free.least_s * 0.97)
    monkeypatch.setattr(Point, "chains_s", lambda self: -math.inf)
    every = grid_bound(ctx, grid)
    every_low = grid_bound(ctx, grid, enough_s=free.least_s * 0.97)
    assert (free.least_s, free.best_s, free.knobs) == (every.least_s, every.best_s, every.knobs)
    assert low.least_s == every_low.least_s
    assert free.lps <= every.lps and low.lps <= every_low.lps and free.chains == every.chains
    assert free.lps < free.chains or low.lps < low.chains  # the chains settled some point on their own


@pytest.mark.parametrize(
    "schedule,stages,chunks,group",
    [("1f1b", 4, 1, 0), ("gpipe", 3, 1, 0), ("interleaved", 8, 2, 0), ("interleaved", 6, 3, 4)],
)
def test_the_chains_program_is_never_above_the_walked_program_and_sees_the_memory(schedule, stages, chunks, group):
    # grid_bound settles a point on its chains program (relaxed or integer) without the walked program:
    # so its bound must never be above the walked relaxation (relaxed) or the walked optimum (integer),
    # also when stopped early at one node; its layout walks as it says; and under a tight memory, where
    # recomputation or offloading is forced, it is above the chains' bound over the layers alone
    import math

    from planlab.search_spaces.fine_bound import Point
    from planlab.search_spaces.fine_paths import chains_program, path_bound_s, solve_walked, ties_s
    from planlab.search_spaces.fine_walk import walk_s

    above = 0
    for off_s in (0.01, 0.2):
        c = _bound_costs(off_s)
        for cap in (1e9, 60.0):
            program = (c, 12, stages, 8, cap, schedule, chunks, group)
            relaxed = Point(c, 12, stages, 8, schedule, chunks, group).relaxed_s(cap)
            _, optimum_s, _, status = solve_walked(program, math.inf, False)
            assert status == "optimal"
            lp_s, _, _ = chains_program(program, math.inf, False)
            assert lp_s <= relaxed * (1 + 1e-9), (off_s, cap)
            for nodes in (1, 200):
                least_s, layout, found_s = chains_program(program, math.inf, True, nodes)
                # both solved within HiGHS' gap: the bound under either layout, neither found far under the other
                assert least_s <= min(optimum_s, found_s) * (1 + 1e-6), (off_s, cap, nodes)
                assert found_s >= optimum_s * (1 - 2e-3), (off_s, cap, nodes)
                assert found_s == pytest.approx(walk_s(c, layout, 8, schedule, chunks, group) + ties_s(c, layout))
            above += lp_s > path_bound_s(c, 12, stages, 8, schedule, chunks, group) * 1.01
    assert above


def test_a_walked_program_stopped_early_keeps_a_bound_never_above_its_optimum(monkeypatch):
    # grid_bound stops the walked program after PROGRAM_TIME_S and keeps HiGHS' proven bound: on
    # programs stopped at once (a time limit of a microsecond) and at every node limit, that bound is
    # never above the optimum the unstopped program proves, and a layout found is never under it
    import math

    import planlab.search_spaces.fine_paths as fine_paths
    from planlab.search_spaces.fine_paths import solve_walked

    head = GroupCost(2.5, 0.1, 3.0, 1.0, 0.0)
    c = _costs(last=head, p2p_s=0.3, sync_s=0.05, offload_sync_s=0.2, forward_share=0.3, can_offload=True)
    for schedule, stages, chunks in (("1f1b", 4, 1), ("interleaved", 8, 2)):
        program = (c, 12, stages, 8, 60.0, schedule, chunks, 0)
        _, optimum_s, proven_s, status = solve_walked(program, math.inf, False)
        assert status == "optimal" and proven_s <= optimum_s
        _, found_s, least_s, _ = solve_walked(program, math.inf, False, time_limit_s=1e-6)
        assert least_s <= optimum_s * (1 + 1e-6) and (found_s >= optimum_s * (1 - 1e-3) or math.isinf(found_s))
        for nodes in (1, 2, 5):
            monkeypatch.setattr(fine_paths, "NODE_LIMIT", nodes)
            _, found_s, least_s, _ = solve_walked(program, math.inf, False)
            assert least_s <= optimum_s * (1 + 1e-6), (schedule, nodes)
            assert math.isinf(found_s) or found_s >= optimum_s * (1 - 1e-3)
