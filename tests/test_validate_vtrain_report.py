"""benchmarks/validate_vtrain.py: the two-factor table of signed errors that locates issue 17's misses."""

import sys
from pathlib import Path

import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))

from validate_vtrain import cross_table  # noqa: E402


def test_the_cross_table_gives_each_pair_its_mean_signed_error_and_count_and_leaves_absent_pairs_blank():
    df = pd.DataFrame(
        {"tp": [1, 1, 2, 8], "pp": [1, 1, 4, 1], "error": [-0.10, -0.20, 0.05, -0.50]},
    )
    lines = cross_table(df, "tp", "pp").splitlines()
    assert lines[0] == "  signed error %, tp (rows) x pp (columns), runs in brackets:"
    rows = {line.split()[0]: line for line in lines[3:]}
    assert "-15.0 (2)" in rows["1"] and "(1)" not in rows["1"]  # two runs at tp 1, pp 1; none at pp 4
    assert rows["2"].split() == ["2", "+5.0", "(1)"]  # tp 2 ran at pp 4 only
    assert "-50.0 (1)" in rows["8"]


def test_breakdown_names_each_task_by_kind():
    from validate_vtrain import COMM_KINDS, COMPUTE_KINDS, _kind

    assert _kind("grad-reduce[0, 1]", COMM_KINDS) == "dp gradient reduce"
    assert _kind("add_3:send1", COMM_KINDS) == "pp send/recv"
    assert _kind("dadd_3:recv1:gather", COMM_KINDS) == "pp send/recv"
    assert _kind("re:blocks_2_mlp_proj:all_reduce0", COMM_KINDS) == "tp collectives"
    assert _kind("blocks_2_attn_q", COMPUTE_KINDS) == "linear layers"
    assert _kind("re:blocks_11_mlp_fc", COMPUTE_KINDS) == "linear layers"
    assert _kind("lm_head", COMPUTE_KINDS) == "linear layers"
    assert _kind("scaled_dot_product_attention_4", COMPUTE_KINDS) == "attention (bmm, softmax, dropout)"
    assert _kind("blocks_0_attn_drop", COMPUTE_KINDS) == "attention (bmm, softmax, dropout)"
    assert _kind("optimizer", COMPUTE_KINDS) == "optimizer step"
    assert _kind("blocks_0_ln1", COMPUTE_KINDS) == "other"


def test_breakdown_accounts_for_the_whole_busy_time_of_its_device():
    from validate_vtrain import breakdown

    from planlab.simulator.engine import simulate
    from planlab.validation import MeasuredRun, program_of

    run = MeasuredRun(8, 16, 1, 1024, 16, 12, 1024, 2, 2, 2, 0.1)  # a single-node row's shape: tp 2, dp 2, pp 2
    b = breakdown(run)
    res = simulate(*program_of(run))
    dev = next(d for d in res.devices if d.device == b["device"])
    busy = sum(v for k, v in b["busy_s"].items() if "of it" not in k)
    assert b["predicted_s"] == res.iter_time_s
    assert busy == pytest.approx(dev.compute_s + dev.comm_s, rel=1e-9)
    assert (
        0
        < b["busy_s"]["compute: of it recomputation"]
        < b["busy_s"]["compute: linear layers"]
        + b["busy_s"]["compute: attention (bmm, softmax, dropout)"]
        + b["busy_s"]["compute: other"]
    )


def test_step_costs_split_a_configurations_times_into_once_an_iteration_and_per_pipeline_step():
    """Times that are exactly ``fixed + (m + pp - 1) x per`` give back ``fixed`` and ``per``, for the
    measured and the predicted column apart; a configuration at one global batch has no split."""
    from validate_vtrain import fixed_share, step_costs

    shape = dict(hidden=1024, layers=12, tp=2, dp=2, pp=2, micro_batch=2)
    rows = [
        shape
        | dict(global_batch=gb, measured_s=0.010 + (gb // 4 + 1) * 0.050, predicted_s=0.030 + (gb // 4 + 1) * 0.045)
        for gb in (8, 16, 32)
    ] + [dict(shape, tp=4, global_batch=8, measured_s=0.2, predicted_s=0.2)]
    df = pd.DataFrame(rows)
    df["error"] = df["predicted_s"] / df["measured_s"] - 1
    (cost,) = step_costs(df).to_dict("records")
    assert cost["tp"] == 2
    assert cost["fixed_measured_s"] == pytest.approx(0.010) and cost["per_measured_s"] == pytest.approx(0.050)
    assert cost["fixed_predicted_s"] == pytest.approx(0.030) and cost["per_predicted_s"] == pytest.approx(0.045)
    text = fixed_share(df)
    assert "1 configurations" in text and "3 rows" in text  # the tp 4 row has no fixed cost of its own
    assert "10.0 / 30.0" in text


def test_matched_groups_pair_rows_of_the_same_work_per_gpu_and_schedule_and_flag_contradicted_orders():
    """Rows of one model with the same pp, micro-batches and micro-batch per tp rank form a group; a
    pair whose measured order is the opposite of the predicted one is listed, an agreeing pair is not,
    and a row of another schedule (another pp) or another work per GPU stays out."""
    from validate_vtrain import matched_groups, matched_work, order_contradictions

    base = dict(hidden=8192, layers=48, gpus=512, global_batch=1536)
    rows = [
        dict(base, tp=2, dp=16, pp=16, micro_batch=2, measured_s=23.7, predicted_s=14.2),  # m 48, work 1
        dict(base, tp=4, dp=8, pp=16, micro_batch=4, measured_s=15.6, predicted_s=15.0),  # m 48, work 1
        dict(base, tp=8, dp=4, pp=16, micro_batch=8, measured_s=16.9, predicted_s=17.3),  # m 48, work 1
        dict(base, tp=8, dp=4, pp=16, micro_batch=4, measured_s=15.9, predicted_s=16.0),  # m 96: alone
        dict(base, tp=4, dp=16, pp=8, micro_batch=4, measured_s=17.4, predicted_s=14.1),  # pp 8: alone
    ]
    df = pd.DataFrame(rows)
    df["error"] = df["predicted_s"] / df["measured_s"] - 1
    groups = matched_groups(df)
    assert list(groups["tp"]) == [2, 4, 8] and set(groups["m"]) == {48}
    bad = order_contradictions(df)
    # tp 2 measures slower than tp 4 and tp 8 while it is predicted faster; tp 4 < tp 8 both ways
    assert sorted(zip(bad["tp_a"], bad["tp_b"])) == [(2, 4), (2, 8)]
    text = matched_work(df)
    assert "1 groups, 3 rows" in text and "contradicts the predicted one: 2" in text
    assert "tp 2 / tp 4 measured 1.52, predicted 0.95" in text
    assert matched_work(df.iloc[3:]) == "  same work per GPU at several tp: no such rows"
