"""benchmarks/validate_vtrain.py: the two-factor table of signed errors that locates issue 17's misses."""

import sys
from pathlib import Path

import pandas as pd

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
