"""The ``3f1b`` space (planlab/search_spaces/recycling.py) and its schedule: golden text, no deadlock
over a table of pipeline sizes, micro-batches and recycling passes (with the plain recycling
schedule of ``pp`` next to it), 1F1B's memory where the plain schedule needs GPipe's, and the
constraints' messages."""

import pytest

from planlab.errors import ConfigError
from planlab.plan.materialize import materialize
from planlab.search_spaces import Context, get_space
from planlab.search_spaces.schedules import format_schedule, one_f_one_b, recycled, three_f_one_b
from planlab.simulator.dryrun import find_deadlock

from conftest import traced


def _text(fn, ranks, *args):
    return [format_schedule(fn(r, ranks, *args)) for r in range(ranks)]


def test_three_f_one_b_golden():
    # 4 groups, 8 micro-batches, 3 passes: stages r, 4 + r, 8 + r; only stage 8 + r has backwards
    assert _text(three_f_one_b, 4, 8, 3) == [
        "0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 8F0 8F1 8F2 8F3 0F4 0F5 0F6 8B0 0F7 8B1 4F4 8B2 4F5 8B3 4F6 4F7 8F4 "
        "8F5 8F6 8F7 8B4 8B5 8B6 8B7",
        "1F0 1F1 1F2 1F3 5F0 5F1 5F2 5F3 9F0 9F1 9F2 9F3 1F4 9B0 1F5 9B1 1F6 9B2 1F7 9B3 5F4 5F5 5F6 5F7 9F4 "
        "9F5 9F6 9F7 9B4 9B5 9B6 9B7",
        "2F0 2F1 2F2 2F3 6F0 6F1 6F2 6F3 10F0 10F1 10F2 10B0 10F3 10B1 2F4 10B2 2F5 10B3 2F6 2F7 6F4 6F5 6F6 "
        "6F7 10F4 10F5 10F6 10B4 10F7 10B5 10B6 10B7",
        "3F0 3F1 3F2 3F3 7F0 7F1 7F2 7F3 11F0 11B0 11F1 11B1 11F2 11B2 11F3 11B3 3F4 3F5 3F6 3F7 7F4 7F5 7F6 "
        "7F7 11F4 11B4 11F5 11B5 11F6 11B6 11F7 11B7",
    ]
    assert _text(three_f_one_b, 2, 4, 1) == _text(one_f_one_b, 2, 4)


def test_plain_recycling_golden():
    assert _text(recycled, 4, 4, 2) == [
        "0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 4B0 4B1 4B2 4B3",
        "1F0 1F1 1F2 1F3 5F0 5F1 5F2 5B0 5F3 5B1 5B2 5B3",
        "2F0 2F1 2F2 2F3 6F0 6F1 6B0 6F2 6B1 6F3 6B2 6B3",
        "3F0 3F1 3F2 3F3 7F0 7B0 7F1 7B1 7F2 7B2 7F3 7B3",
    ]


@pytest.mark.parametrize("pp,mbs,passes", [(2, 2, 2), (2, 4, 3), (4, 4, 2), (4, 8, 3), (4, 4, 4)])
def test_no_deadlock(pp, mbs, passes):
    spec, g = traced("evoformer-tiny", mbs, (("blocks", 4), ("recycles", passes)))
    ctx = Context(g, spec, mbs, "cpu", pp, pp, 1)
    for space in ("3f1b", "megatron"):
        plan = get_space(space).build(ctx, dict(pp=pp, dp=1, tp=1, microbatch=1))
        prog = materialize(plan, g)
        assert find_deadlock(prog, raise_error=False) is None, (space, pp, mbs, passes)


def test_3f1b_keeps_1f1b_memory_where_the_plain_schedule_cannot():
    """On two device groups the plain schedule must run the last pass's forwards first on group 0
    (GPipe's memory); 3f1b keeps 1F1B's, in about the same time. (Its time does not beat the plain
    schedule's: that one has no flush between the passes either, see docs/spaces.md.)"""
    import planlab

    spec, _ = traced("evoformer-tiny", 8, (("blocks", 4), ("recycles", 3)))
    got = {}
    for space in ("3f1b", "megatron"):
        df = planlab.explore(
            spec,
            cluster="cpu",
            nodes=2,
            space=space,
            global_batch=8,
            fixed=dict(pp=2, dp=1, tp=1, microbatch=1, recompute="none"),
        )
        got[space] = (float(df["iter_time_s"].min()), float(df["peak_mem_gib"].min()))
    assert got["3f1b"][1] < 0.5 * got["megatron"][1], got
    assert got["3f1b"][0] < 1.05 * got["megatron"][0], got


@pytest.mark.parametrize(
    "model,knobs,message",
    [
        ("evoformer-tiny", dict(pp=2, dp=1, tp=1, microbatch=1), "runs its trunk once: give it recycles > 1"),
        ("recycled", dict(pp=1, dp=2, tp=1, microbatch=1), "knob 'pp' = 1 is outside its range: choose 2"),
        ("recycled", dict(pp=2, dp=1, tp=1, microbatch=4), "3f1b runs micro-batches in groups of pp=2: the 1 micro"),
    ],
)
def test_constraint_messages(model, knobs, message):
    args = (("recycles", 2),) if model == "recycled" else ()
    spec, g = traced("evoformer-tiny", 4, args)
    with pytest.raises(ConfigError, match=message) as e:
        get_space("3f1b").build(Context(g, spec, 4, "cpu", 2, 2, 1), knobs)
    assert "3f1b" in str(e.value)
