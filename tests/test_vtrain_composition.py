"""benchmarks/vtrain_composition.py: how a set of measured times hangs together, from the times alone."""

import sys
from pathlib import Path

import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))

from vtrain_composition import (  # noqa: E402
    layer_line_distance,
    lines,
    lut_allreduce_ms,
    read_lut,
    spread,
    vtrain_stage_bytes,
)


def _frame(times: dict) -> pd.DataFrame:
    """Rows of one shape (hidden 1024, tp 2, pp 1, micro-batch 2) keyed by (layers, dp, m) -> ms."""
    rows = [
        dict(hidden=1024, layers=layers, tp=2, dp=dp, pp=1, micro_batch=2, m=m, measured_ms=t)
        for (layers, dp, m), t in times.items()
    ]
    return pd.DataFrame(rows)


def test_times_composed_from_parts_lie_on_the_lines_and_measured_ones_do_not():
    """``fixed + m x per`` with ``per`` linear in layers and shared by the dp degrees lies on every
    line; the same times with a measurement's scatter (0.2% on one run) do not."""
    composed = {
        (layers, dp, m): 3.0 + dp * 0.5 + m * (6.0 + 2.5 * layers)
        for layers in (12, 16, 20)
        for dp in (1, 2)
        for m in (2, 4, 8)
    }
    fits = lines(_frame(composed))
    assert fits["residual_ms"].max() == pytest.approx(0, abs=1e-9)
    assert fits["slope_ms"].tolist() == pytest.approx([6.0 + 2.5 * layers for layers in (12, 12, 16, 16, 20, 20)])
    assert spread(fits, "dp", "slope_ms").max() == pytest.approx(0, abs=1e-9)
    assert spread(fits, "dp", "intercept_ms").max() == pytest.approx(0.5)
    assert layer_line_distance(fits).max() == pytest.approx(0, abs=1e-9)

    measured = dict(composed)
    measured[(16, 2, 4)] *= 1.002
    fits = lines(_frame(measured))
    assert fits["residual_ms"].max() > 0.05
    assert spread(fits, "dp", "slope_ms").max() > 0.01
    assert layer_line_distance(fits).max() > 0.005


def test_vtrains_weights_on_the_first_stage_in_fp16_bytes():
    """hidden 1024, 24 layers, tp 1, one stage: 24 x (12 h^2 + 13 h) + 50,257 x h + 1,024 x h + an
    untied output layer 50,257 x h, two bytes each; at pp 2 the output layer is on the other stage."""
    h = 1024
    layer = 12 * h * h + 13 * h
    assert vtrain_stage_bytes(h, 24, 1, 1, 1024) == 2 * (24 * layer + 50257 * h + 1024 * h + 50257 * h)
    assert vtrain_stage_bytes(h, 24, 1, 2, 1024) == 2 * (12 * layer + 50257 * h + 1024 * h)
    # tp 2: the vocabulary split without padding (50,257 // 2), the layer's column/row-parallel weights halved
    per_tp = 6 * h * h + 7 * h // 2 + 6 * h  # QKV and first MLP biases split; the rest replicated
    assert vtrain_stage_bytes(h, 12, 2, 1, 1024) == 2 * (12 * per_tp + 25128 * h + 1024 * h + 25128 * h)


def test_the_all_reduce_table_is_read_per_row_and_past_its_last_row_at_its_bus_bandwidth(tmp_path):
    header = "size(B),count,type,time(ns),busbw(GB/s),time(ns),busbw(GB/s)\n"
    rows = "1048576,262144,float,44210,23.72,45100,23.25\n1073741824,268435456,float,9000000,100.0,8000000,200.0\n"
    (tmp_path / "AR_GPU2_1M_1024M_LUT").write_text(header + rows)
    tables = {2: read_lut(tmp_path, 2)}
    assert tables[2] == {1: (0.0451, 23.25), 1024: (8.0, 200.0)}  # the in-place columns
    assert lut_allreduce_ms(tables, 2**20 + 1000, 2) == pytest.approx(0.0451)  # rounded to 1 MiB
    assert lut_allreduce_ms(tables, 2048 * 2**20, 2) == pytest.approx(2048 / (200.0 * 1024) * 1e3)  # past 1 GiB
    assert lut_allreduce_ms(tables, 2**30, 1) == 0.0
    with pytest.raises(SystemExit, match="cannot read .*AR_GPU4_1M_1024M_LUT.*expected vTrain's trace/a100 folder"):
        read_lut(tmp_path, 4)
    (tmp_path / "AR_GPU8_1M_1024M_LUT").write_text(header + "1048576,262144,float\n")
    with pytest.raises(SystemExit, match="line 2 is not"):
        read_lut(tmp_path, 8)
