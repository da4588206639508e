"""benchmarks/nnscaler_eval.py: a space where no plan fits reports its least-memory plan's reason."""

import math
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))

from nnscaler_eval import least_memory_reason  # noqa: E402


def test_none_fits_names_the_least_memory_row_not_the_first():
    # t5-32's alpa rows: tp 2 first (439.5 GiB), tp 1 last with the least (27.5 GiB); rejected by the screen
    df = pd.DataFrame(
        {
            "tp": [2, 4, 16, 1],
            "peak_mem_gib": [math.nan] * 4,
            "screen_mem_gib": [445.97, 222.99, 55.76, 40.03],
            "reason": ["needs 439.5 GiB", "needs 219.8 GiB", "needs 55.0 GiB", "needs 27.5 GiB"],
        }
    )
    assert least_memory_reason(df) == "needs 27.5 GiB"


def test_a_simulated_peak_orders_before_a_missing_estimate():
    df = pd.DataFrame(
        {"peak_mem_gib": [math.nan, 27.1], "screen_mem_gib": [math.nan, 20.0], "reason": ["screen failed", "27.1 GiB"]}
    )
    assert least_memory_reason(df) == "27.1 GiB"
    assert least_memory_reason(df.iloc[:0]) == "no plan"
