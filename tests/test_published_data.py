"""The published validation sets (benchmarks/data) load, name their sources and conditions, convert
their quoted numbers to seconds, and every runnable row builds its plan on its built-in cluster
(the plans are built, not simulated: the runs span up to 3,072 GPUs)."""

from __future__ import annotations

import dataclasses
import math
import shlex
import shutil
from functools import lru_cache
from pathlib import Path

import pytest

from planlab.cli import build_parser
from planlab.costmodel import list_clusters, load_cluster
from planlab.errors import ConfigError
from planlab.explore import Setup, make_context
from planlab.published import CONDITIONS, FAMILIES, flops_per_iteration, load_set, load_sets, parse_model_args
from planlab.published_report import family_orders, predict_row, summarize, tau_within_models
from planlab.search_spaces.builtin import get_space

DATA = Path(__file__).resolve().parents[1] / "benchmarks" / "data"
SETS = load_sets(DATA)
ROWS = [(s, r) for s in SETS for r in s.rows]


def test_sets_cover_the_required_hardware():
    """At least the four sets of issue 17 item 5: A100 weak scaling, ZeRO-3 against PTD-P, one on
    H100 and one on V100, each with runnable rows."""
    names = {s.name for s in SETS}
    assert {"megatron-sc21-weak", "megatron-sc21-zero3", "korthikanti-2022", "shoeybi-2019-v100"} <= names
    runnable = {load_cluster(r.cluster).device.name for s, r in ROWS if r.runnable}
    assert any("h100" in d for d in runnable) and any("v100" in d for d in runnable), runnable


@pytest.mark.parametrize("s", SETS, ids=lambda s: s.name)
def test_every_set_names_its_source_and_conditions(s):
    assert s.source["citation"] and s.source["where"] and s.source["url"].startswith("https://")
    assert all(str(s.conditions[c]).strip() for c in CONDITIONS)
    assert s.metric["conversion"].strip()
    assert s.software and {r.software for r in s.rows} <= set(s.software)
    assert s.rows and len({r.row for r in s.rows}) == len(s.rows)


@pytest.mark.parametrize("s,r", ROWS, ids=lambda x: getattr(x, "row", getattr(x, "name", "")))
def test_every_row_is_well_formed(s, r):
    assert r.cluster in list_clusters()
    assert r.source_ref.strip() and r.family in FAMILIES
    assert r.tp * r.pp * r.dp * r.cp == r.gpus
    if r.model:
        seconds = s.measured_s(r)
        assert math.isfinite(seconds) and 0.01 < seconds < 1000, seconds
    if r.runnable:
        if r.precision == "fp8":  # FP8 is a software precision on devices with FP8 tensor cores
            assert "fp8" in load_cluster(r.cluster).device.peak_flops_per_s
        assert r.model and r.microbatch and r.virtual_stages and r.recompute in ("none", "selective", "full")
    else:
        assert len(r.skip_reason) > 10


RUNNABLE = sorted(
    [(s, r) for s, r in ROWS if r.runnable and r.gpus % load_cluster(r.cluster).node.devices_per_node == 0],
    key=lambda sr: (sr[1].spec().name, sr[1].model_args, sr[1].global_batch),
)


@lru_cache(maxsize=1)  # the rows come sorted by model and batch: each graph is traced once
def _graph(spec, batch):
    from planlab.graph.trace import trace
    from planlab.models.registry import build_model

    model, inputs = build_model(spec, batch=batch)
    return trace(model, inputs)


@pytest.mark.parametrize("s,r", RUNNABLE, ids=lambda x: getattr(x, "row", getattr(x, "name", "")))
def test_every_runnable_row_builds_its_plan(s, r):
    """The plan a user gets from ``planlab explore --space megatron --set ...`` for the row."""
    per_node = load_cluster(r.cluster).node.devices_per_node
    setup = Setup(r.spec(), r.cluster, r.nodes(per_node), r.global_batch)
    ctx, cost, graph = make_context(setup, _graph(r.spec(), r.global_batch))
    plan = get_space("megatron").build(ctx, r.knobs())
    assert plan.num_devices == r.gpus
    assert plan.microbatches == r.global_batch // (r.dp * r.microbatch)
    assert plan.zero == r.zero
    args = build_parser().parse_args(shlex.split(r.command(per_node))[1:])  # the CLI reads the same plan
    assert (args.model, args.cluster, args.nodes, args.global_batch) == (
        r.model,
        r.cluster,
        setup.nodes,
        r.global_batch,
    )
    assert dict(args.set) == {k: str(v).lower() if isinstance(v, bool) else v for k, v in r.knobs().items()}
    assert tuple(args.model_arg or ()) == r.model_args


def test_conversions_match_the_papers_own_cross_checks():
    """Korthikanti et al.: 39.15 s on 2240 GPUs is 54.2% MFU (abstract) by Appendix A's eq. (7),
    and the 42.1% row comes out at 39.15 x 54.2 / 42.1 s. Narayanan et al. Table 1: the 1T row's
    163 teraFLOP/s per GPU over 3072 GPUs is its 502.0 aggregate petaFLOP/s within rounding."""
    k = next(s for s in SETS if s.name == "korthikanti-2022")
    rows = {r.row: r for r in k.rows}
    assert k.measured_s(rows["530B-dp8-full"]) == pytest.approx(39.15 * 54.2 / 42.1, rel=2e-3)
    w = next(s for s in SETS if s.name == "megatron-sc21-weak")
    one_t = next(r for r in w.rows if r.row == "1T")
    assert 163e12 * 3072 == pytest.approx(502.0e15, rel=3e-3)
    assert w.measured_s(one_t) == pytest.approx(
        96 * 3072 * 2048 * 128 * 25600**2 * (1 + 2048 / (6 * 25600) + 51200 / (16 * 128 * 25600)) / (3072 * 163e12)
    )


def test_megatron_lm_flops_match_megatron_core_moe_readme():
    """Megatron-LM's count (num_floating_point_operations) for Mixtral 8x7B, written out by hand from
    its terms: 12 B s l h^2 x (attention with 8 of 32 key/value heads + 2 SwiGLU experts of 14,336
    + the 32,000-word output); 438 TFLOP/s on 64 GPUs is then 3.10 s, 5,282 tokens/s per GPU."""
    m = next(s for s in SETS if s.name == "megatron-core-moe-h100")
    row = next(r for r in m.rows if r.row == "mixtral-8x7b-mcore0.8")
    b, s, n_l, h = 256, 4096, 32, 4096
    by_hand = 12 * b * s * n_l * h * h * ((1 + 8 / 32 + s / h) + 14336 / h * 2 * 1.5 + 32000 / (2 * n_l * h))
    assert flops_per_iteration(row, m.metric) == pytest.approx(by_hand, rel=1e-12)
    assert m.measured_s(row) == pytest.approx(by_hand / (64 * 438e12), rel=1e-12)
    assert b * s / (64 * m.measured_s(row)) == pytest.approx(5282, abs=1)
    gpt = dataclasses.replace(row, model="gpt3-1.3b", model_args=())
    with pytest.raises(ConfigError, match="megatron-lm FLOP formula"):
        flops_per_iteration(gpt, m.metric)


@pytest.mark.parametrize(
    "edit,message",
    [
        (
            lambda t: t.replace(
                ",dgx-a100-80g,megatron-2022,fp16,1,1,32,", ",dgx-a100-80g,megatron-2022,fp16,1,1,31,", 1
            ),
            "tp x pp",
        ),
        (lambda t: t.replace(",fp16,", ",fp4,", 1), "'precision'"),
        (lambda t: t.replace("tflops_per_gpu,137", "tflops_per_gpu,fast", 1), "'value'"),
        (lambda t: t.replace("row,source_ref", "run,source_ref", 1), "columns"),
    ],
)
def test_a_malformed_row_is_a_config_error_naming_it(tmp_path, edit, message):
    for ext in ("json", "csv"):
        shutil.copy(DATA / f"megatron-sc21-weak.{ext}", tmp_path / f"megatron-sc21-weak.{ext}")
    csv_path = tmp_path / "megatron-sc21-weak.csv"
    csv_path.write_text(edit(csv_path.read_text()))
    with pytest.raises(ConfigError, match=message):
        load_set(tmp_path / "megatron-sc21-weak.json")


def test_unknown_set_and_bad_model_args_are_config_errors():
    with pytest.raises(ConfigError, match="unknown published set 'nope'"):
        load_sets(DATA, ["nope"])
    with pytest.raises(ConfigError, match="not KEY=NUMBER"):
        parse_model_args("layers=24;hidden")
    assert parse_model_args("layers=24;dropout=0.1") == (("layers", 24), ("dropout", 0.1))


def test_uneven_stage_columns_reach_the_plan_and_bad_ones_are_config_errors(tmp_path):
    """Llama 3's 126 layers on 16 stages (section 3.3.2): 7, 14 x 8, 7 through the optional columns."""
    from planlab.search_spaces.stages import layers_per_stage

    llama = next(s for s in SETS if s.name == "llama3-2024")
    for r in llama.rows:
        assert (r.knobs()["first_stage_layers"], r.knobs()["last_stage_layers"]) == (7, 7)
        assert layers_per_stage(r.spec().config().layers, r.pp, 7, 7) == (7,) + (8,) * 14 + (7,)
    uneven = {"llama3-2024", "deepseek-v3-2024", "megatron-bridge-25.09-h100"}  # sets whose runs state them
    assert all("first_stage_layers" not in r.knobs() for s, r in ROWS if s.name not in uneven)  # 0: unset
    (deepseek,) = next(s for s in SETS if s.name == "deepseek-v3-2024").rows  # 61 layers on 16 stages
    assert layers_per_stage(61, deepseek.pp, deepseek.first_stage_layers, deepseek.last_stage_layers) == (
        (3,) + (4,) * 14 + (2,)
    )
    assert [r.knobs().get("cp_kind") for r in llama.rows] == [None, None, "allgather"]  # the 131K row's, as Llama 3
    assert [r.knobs()["pipeline_group"] for r in llama.rows] == [16, 16, 16]  # N, as PyTorch's schedule picks it
    for ext in ("json", "csv"):
        shutil.copy(DATA / f"llama3-2024.{ext}", tmp_path / f"llama3-2024.{ext}")
    csv_path = tmp_path / "llama3-2024.csv"
    text = csv_path.read_text()
    csv_path.write_text(text.replace(",1,7,7,,16,8,interleaved,", ",1,7,x,,16,8,interleaved,", 1))
    with pytest.raises(ConfigError, match="'last_stage_layers' is 'x'"):
        load_set(tmp_path / "llama3-2024.json")
    csv_path.write_text(text.replace(",7,7,allgather,", ",7,7,wide,", 1))
    with pytest.raises(ConfigError, match=r"'cp_kind' is 'wide'; choose 'a2a', 'ring' or 'allgather'"):
        load_set(tmp_path / "llama3-2024.json")
    csv_path.write_text(text.replace(",7,7,allgather,16,", ",7,7,allgather,sixteen,", 1))
    with pytest.raises(ConfigError, match=r"'pipeline_group' is 'sixteen'; expected a number of micro-batches"):
        load_set(tmp_path / "llama3-2024.json")
    swapped = text.replace("first_stage_layers,last_stage_layers", "last_stage_layers,first_stage_layers", 1)
    csv_path.write_text(swapped)
    with pytest.raises(ConfigError, match="columns"):
        load_set(tmp_path / "llama3-2024.json")


def _frame(rows):
    import pandas as pd

    base = dict(model="gpt", model_args="a", skip_reason="", fits=True, params_b=1.0, global_batch=8, work=8.0)
    return pd.DataFrame([{**base, **r} for r in rows])


def test_summary_figures_on_a_table_of_cases():
    """MAPE and signed error over the rows that fit, the worst row signed, tau within models of
    per-GPU throughput, and the family order where one model ran on one GPU count twice."""
    df = _frame(
        [
            dict(row="a", gpus=8, family="tp-pp", measured_s=1.0, predicted_s=0.9, error=-0.1),
            dict(row="b", gpus=8, family="zero3-dp", measured_s=2.0, predicted_s=0.8, error=-0.6),
            dict(row="c", gpus=16, family="tp-pp", measured_s=0.6, predicted_s=0.66, error=0.1),
            dict(row="d", gpus=16, family="tp-pp", fits=False, measured_s=0.5, predicted_s=math.nan, error=math.nan),
        ]
    )
    df["unfit_error"] = [math.nan, math.nan, math.nan, -0.2]
    df["peak_mem_gib"], df["reason"], df["failed"] = 70.0, "out of memory", False
    s = summarize(df)
    assert s["mape"] == pytest.approx(80 / 3) and s["signed"] == pytest.approx(-20.0)
    assert s["worst"] == ("b", pytest.approx(-60.0))
    assert s["mape_all"] == pytest.approx(25.0) and s["n_all"] == 4
    assert [u[0] for u in s["unfit"]] == ["d"] and s["failed"] == []
    (fam,) = s["families"]
    assert fam["measured"] == ["tp-pp", "zero3-dp"] and fam["predicted"] == ["zero3-dp", "tp-pp"]
    assert not fam["preserved"] and fam["measured_ratio"] == pytest.approx(2.0)
    tau, groups = tau_within_models(df[df["fits"]])
    assert groups == 1 and tau == pytest.approx(-1 / 3) and s["tau_all"] == pytest.approx(-1 / 3)
    assert family_orders(df[df["family"] == "tp-pp"]) == []


def test_predict_row_simulates_a_small_plan_and_refuses_part_of_a_node():
    """The user's path end to end on a small GPT in the 22B row's plan (tp 8 on one DGX A100),
    and the clear refusal of a run on 4 of a node's 8 GPUs."""
    base = next(r for _, r in ROWS if r.set == "korthikanti-2022" and r.row == "22B-full")
    small = dataclasses.replace(
        base, model_args=parse_model_args("layers=2;hidden=256;heads=8;seq=128;vocab=1024;vocab_parallel=1")
    )
    out = predict_row(small)
    assert out["fits"] and out["predicted_s"] > 0 and not out["failed"], out
    out = predict_row(dataclasses.replace(small, gpus=4, tp=4))
    assert out["failed"] and "whole nodes" in out["reason"] and math.isnan(out["predicted_s"])
