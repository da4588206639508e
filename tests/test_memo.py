"""planlab.memo: a plan simulated in one exploration is not simulated again in another, and no row changes."""

import dataclasses
import importlib

import pandas as pd
import pytest

import planlab
from planlab.candidates import ROW_KEYS
from planlab.memo import SimulationMemo, plan_digest
from planlab.search_spaces import get_space

TINY = dict(cluster="cpu", nodes=2, global_batch=8)
# a baseline, the grid that holds its plans, and a product whose plans without co-sharding are the grid's
SPACES = (("megatron", {"recompute": "full"}), ("megatron", {}), ("megatron*coshard", {}))


def _explored(memo: SimulationMemo | None, jobs: tuple[int, ...] = (1, 1, 1)) -> list[pd.DataFrame]:
    return [
        planlab.explore("gpt-tiny", **TINY, space=s, fixed=f, memo=memo, jobs=j, candidates=6)
        for (s, f), j in zip(SPACES, jobs)
    ]


def _simulated(df: pd.DataFrame) -> pd.DataFrame:
    knobs = [c for c in df.columns[: list(df.columns).index("software")] if c != "space"]
    sim = df[df["simulated"]]
    return sim[knobs + list(ROW_KEYS)].sort_values(knobs, kind="stable").reset_index(drop=True)


@pytest.fixture(scope="module")
def without_memo():
    return _explored(None)


def test_a_memo_reuses_rows_across_spaces_and_changes_none(without_memo):
    memo = SimulationMemo()
    with_memo = _explored(memo, (1, 2, 1))  # rows reused in forked workers and in this process
    for plain, reused in zip(without_memo, with_memo):
        pd.testing.assert_frame_equal(_simulated(plain), _simulated(reused))
        assert plain.loc[0, "iter_time_s"] == reused.loc[0, "iter_time_s"]  # the space's best row
        assert reused.attrs["best_plan"] == plain.attrs["best_plan"]
    counts = [df.attrs["counts"] for df in with_memo]
    assert counts[0]["reused"] == 0
    assert 0 < counts[1]["reused"] < counts[1]["simulated"]  # the baseline's plans are the grid's
    assert 0 < counts[2]["reused"] < counts[2]["simulated"]  # the grid's plans, not the co-sharded ones
    assert memo.reused == counts[1]["reused"] + counts[2]["reused"]
    assert sum(map(len, memo.rows.values())) == sum(c["simulated"] - c["reused"] for c in counts)


def test_another_software_is_another_row():
    memo = SimulationMemo()
    planlab.explore("gpt-tiny", **TINY, fixed={"recompute": "full"}, memo=memo, candidates=2)
    df = planlab.explore("gpt-tiny", **TINY, fixed={"recompute": "full"}, memo=memo, candidates=2, software="deepspeed")
    assert df.attrs["counts"]["reused"] == 0


def test_a_digest_ignores_the_labels_and_keeps_what_is_priced(without_memo):
    plan = without_memo[1].attrs["best_plan"]
    relabelled = dataclasses.replace(plan, space="other", knobs=(*plan.knobs, ("coshard", 1)))
    assert plan_digest(relabelled) == plan_digest(plan)
    tp = dict(plan.knobs).get("tp", 1)
    other_tp = dataclasses.replace(plan, knobs=tuple((k, tp + 1 if k == "tp" else v) for k, v in plan.knobs))
    assert plan_digest(other_tp) != plan_digest(plan)
    assert plan_digest(dataclasses.replace(plan, zero=3 - plan.zero)) != plan_digest(plan)
    assert plan_digest(dataclasses.replace(plan, microbatches=plan.microbatches * 2)) != plan_digest(plan)
    assert "tp" in {k.name for k in get_space("megatron").all_knobs()}


def test_a_memo_traces_its_model_once_for_all_its_explorations(monkeypatch):
    traced = []
    for module in ("planlab.explore", "planlab.memo"):  # (planlab.explore is also the function's name)
        where = importlib.import_module(module)
        trace = where.trace_model
        monkeypatch.setattr(
            where, "trace_model", lambda spec, batch, trace=trace: traced.append(spec) or trace(spec, batch)
        )
    memo = SimulationMemo()
    _explored(memo, (1, 2, 1))
    assert len(traced) == 1  # the three explorations (one with forked workers) share the first one's graph
    assert list(memo.graphs) == [(traced[0], TINY["global_batch"])]
    _explored(None)
    assert len(traced) == 4  # without a memo, each exploration traces (or reads the trace cache) again
