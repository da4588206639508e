"""Megatron-Core's batch-level expert all-to-all overlap (``--overlap-moe-expert-parallel-comm``) as the
interleaved schedule's paired steps (``expert_overlap``): the order, the plan it builds, what the
simulator and the screen hide with it, and its errors in one line."""

import dataclasses
import json
from pathlib import Path

import pytest

from planlab.costmodel import CostModel
from planlab.errors import ConfigError
from planlab.plan import materialize
from planlab.plan.program import TaskKind
from planlab.published import load_set
from planlab.search_spaces import Context, get_space
from planlab.search_spaces.schedules import interleaved_1f1b
from planlab.search_spaces.schedule_walks import flight_counts, paired_interleaved
from planlab.search_spaces.screen import Screen
from planlab.simulator import find_deadlock, simulate

from conftest import traced


@pytest.mark.parametrize("p, v, m, group", [(2, 2, 4, 0), (4, 2, 8, 0), (4, 4, 8, 0), (3, 2, 6, 0), (4, 2, 10, 5)])
def test_paired_interleaved_runs_one_more_warmup_forward_and_pairs_every_steady_step(p, v, m, group):
    """The same actions as interleaved 1F1B; one more warm-up forward (core_r0.14.0's
    get_pp_rank_microbatches); then each steady-state forward overlaps the backward right after it,
    and no other action overlaps."""
    for r in range(p):
        plain = interleaved_1f1b(r, p, m, v, group)
        paired = interleaved_1f1b(r, p, m, v, group, paired=True)
        assert sorted(map(str, plain)) == sorted(map(str, paired))
        warmup = next(i for i, a in enumerate(paired) if a.phase == "B") - 1  # the step's forward comes first
        assert warmup == min(m * v, 2 * (p - r - 1) + (v - 1) * (group or p) + 1)
        steady = paired[warmup : warmup + 2 * (m * v - warmup)]
        assert [a.phase for a in steady] == ["F", "B"] * (m * v - warmup)
        assert [a.overlaps for a in paired] == [a.phase == "F" and a in steady for a in paired]
        assert paired_interleaved(r, p, m, v, group) == m * v - warmup
        # one more chunk in flight at the peak than without the pairs (the extra warm-up forward)
        assert flight_counts("interleaved", r, p, m, v, group, True).sum(axis=1).max() == min(
            m * v, flight_counts("interleaved", r, p, m, v, group).sum(axis=1).max() + 1
        )


def _moe_ctx():
    spec, g = traced("deepseek-tiny", 32)
    return Context(g, spec, 32, "dgx-h100", 2, 16, 8), g


_KNOBS = dict(dp=8, ep=8, tp=1, pp=2, virtual_stages=2, schedule="interleaved", microbatch=1)


def test_an_expert_parallel_plan_pairs_its_steps_and_hides_its_all_to_alls():
    """deepseek-tiny on two DGX H100 nodes, pp 2 x 2 chunks, ep 8 in each stage's node: with expert_overlap the
    plan pairs its steady-state steps and runs without deadlock; the simulated step is shorter, with
    less exposed communication, and the computation is the same; the screen takes off its estimate
    what the pairs hide."""
    ctx, g = _moe_ctx()
    space = get_space("megatron")
    cost = CostModel.load("dgx-h100", 2)
    plans = {on: space.build(ctx, dict(_KNOBS, expert_overlap=on)) for on in (False, True)}
    assert not any(a.overlaps for s in plans[False].schedule for a in s)
    assert all(any(a.overlaps for a in s) for s in plans[True].schedule)
    res = {}
    for on, plan in plans.items():
        prog = materialize(plan, g)
        assert find_deadlock(prog) is None
        res[on] = simulate(prog, cost)
    assert res[True].iter_time_s < res[False].iter_time_s
    assert sum(d.exposed_comm_s for d in res[True].devices) < sum(d.exposed_comm_s for d in res[False].devices)
    assert sum(d.compute_s for d in res[True].devices) == pytest.approx(
        sum(d.compute_s for d in res[False].devices), rel=0.05
    )
    screen = Screen(g, cost, cost.precision)
    drafts = {on: space.draft(ctx, dict(_KNOBS, expert_overlap=on)) for on in (False, True)}
    assert screen.estimate(drafts[True]).time_s < screen.estimate(drafts[False]).time_s


def test_a_pair_computes_in_the_order_megatron_core_launches_it():
    """Megatron-Core's combined 1F1B step launches the backward's head and combine backward before the
    forward's attention, and a CUDA stream runs kernels in launch order: in every pair whose two chunks
    dispatch experts the backward computes first, even where the forward's input is already there (a
    greedy order ran the forward first, and let a slower kernel shorten the Megatron-Bridge
    DeepSeek-V3 step: planlab/simulator/pairs.py)."""
    ctx, g = _moe_ctx()
    plan = get_space("megatron").build(ctx, dict(_KNOBS, expert_overlap=True))
    prog = materialize(plan, g)
    res = simulate(prog, CostModel.load("dgx-h100", 2), timeline=True)
    first_s = {}
    for e in res.events:
        if e.stream == "compute":
            first_s.setdefault((e.device, e.action), e.start_s)

    def dispatches(device, action):
        block = prog.device(device).blocks[(action.stage, action.phase)]
        return any(t.kind is TaskKind.COLLECTIVE and t.collective == "all_to_all" for t in block.tasks)

    pairs = [
        (d, f, b)
        for d in sorted({e.device for e in res.events})
        for f, b in zip(plan.schedule[d], plan.schedule[d][1:])
        if f.overlaps and dispatches(d, f) and dispatches(d, b)
    ]
    assert len(pairs) >= 6
    for d, f, b in pairs:
        assert first_s[(d, str(b))] <= first_s[(d, str(f))], (d, str(f), str(b))


def test_a_dense_plan_runs_no_pairs():
    """Without experts to dispatch the pairs would hide nothing (Megatron-Core asserts ep > 1): a dense
    model's interleaved plan with expert_overlap runs the plain order, as DualPipe's plans do."""
    spec, g = traced("llama-tiny", 8, (("layers", 4),))
    ctx = Context(g, spec, 8, "cpu", 1, 4, 1)
    knobs = dict(dp=2, tp=1, pp=2, virtual_stages=2, schedule="interleaved", microbatch=1)
    paired = get_space("megatron").build(ctx, dict(knobs, expert_overlap=True))
    assert paired.schedule == get_space("megatron").build(ctx, knobs).schedule


def test_expert_overlap_needs_the_interleaved_schedule():
    ctx, _ = _moe_ctx()
    with pytest.raises(ConfigError, match="expert_overlap pairs the forwards and backwards of schedule=interleaved"):
        get_space("megatron").build(ctx, dict(_KNOBS, virtual_stages=1, schedule="1f1b", expert_overlap=True))


def test_the_published_column_is_true_or_false(tmp_path):
    src = Path(__file__).resolve().parent.parent / "benchmarks/data/megatron-bridge-25.09-h100.csv"
    (tmp_path / "x.json").write_text((src.with_suffix(".json")).read_text())
    (tmp_path / "x.csv").write_text(src.read_text().replace(",true,4,interleaved", ",yes,4,interleaved"))
    with pytest.raises(ConfigError, match=r"column 'expert_overlap' is 'yes'; expected true or false") as e:
        load_set(tmp_path / "x.json")
    assert "\n" not in str(e.value)
    (tmp_path / "x.csv").write_text(src.read_text())
    (row,) = load_set(tmp_path / "x.json").rows
    assert row.expert_overlap and row.knobs()["expert_overlap"] is True


def test_the_dispatch_kernels_sms_slow_the_computation_beside_them_in_a_pair():
    """DeepEP holds 20 of an H100's 132 SMs (Megatron-Core's moe_deepep_num_sms): computation beside
    the other action's dispatch runs 132/112 as long, so the paired plan takes longer than with the
    cluster's figure (none on dgx-h100) and still less than unpaired; a software without the field
    keeps the cluster's."""
    assert CostModel.load("dgx-h100", 2, software="megatron-deepep").dispatch_slowdown == pytest.approx(132 / 112)
    plain = CostModel.load("dgx-h100", 2, software="megatron")
    assert plain.dispatch_slowdown == plain.overlap_slowdown == 1.0
    ctx, g = _moe_ctx()
    space = get_space("megatron")
    paired = materialize(space.build(ctx, dict(_KNOBS, expert_overlap=True)), g)
    unpaired = materialize(space.build(ctx, dict(_KNOBS, expert_overlap=False)), g)
    sms = CostModel.load("dgx-h100", 2, software=dataclasses.replace(plain.software, expert_dispatch_sms=20))
    t = simulate(paired, sms).iter_time_s
    assert simulate(paired, plain).iter_time_s < t < simulate(unpaired, sms).iter_time_s


@pytest.mark.parametrize(
    "sms, text", [(-1, "must be a whole number >= 0, got -1"), (132, "leaves none of the device's")]
)
def test_bad_dispatch_sms_is_one_line(tmp_path, sms, text):
    f = tmp_path / "sw.json"
    f.write_text(json.dumps({"name": "x", "base": "megatron", "expert_dispatch_sms": sms}))
    with pytest.raises(ConfigError, match=text) as e:
        CostModel.load("dgx-h100", 1, software=str(f)).dispatch_slowdown
    assert "\n" not in str(e.value)
