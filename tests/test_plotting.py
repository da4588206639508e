"""Plots pick their axes from their data (the Pareto plot's memory axis spans the simulated peaks,
and the device memory only when it is near them), and the timeline and memory plots draw a million
tasks as pixels: each pixel shows the time its tasks cover, and the memory line keeps every pixel's peak."""

import numpy as np
import pandas as pd
import pytest

from planlab.plotting import coverage, pareto_plot, shown_capacity, step_envelope


@pytest.mark.parametrize(
    "top, cap, shown",
    [(0.0025, 3.7, None), (30.0, 80.0, 80.0), (30.0, 95.0, None), (0.5, None, None), (0.0, 80.0, None)],
)
def test_the_device_memory_is_shown_only_near_the_data(top, cap, shown):
    assert shown_capacity(top, cap) == shown


def test_the_memory_axis_of_tiny_plans_spans_their_peaks(tmp_path, monkeypatch):
    """gpt-tiny's plans peak at about 2.5 MiB on a CPU 'device' of 3.7 GiB: the axis is in MiB and
    ends near the points, not at 4,800 MiB."""
    df = pd.DataFrame(
        dict(
            iter_time_s=[0.010, 0.012, 0.020],
            peak_mem_gib=[2.5 / 1024, 2.2 / 1024, 1.9 / 1024],
            feasible=[True, True, True],
            simulated=[True, True, True],
            pareto=[True, True, True],
            screen_time_s=[0.011, 0.013, 0.019],
            screen_mem_gib=[2.4 / 1024, 2.1 / 1024, 2.0 / 1024],
            dp=[2, 1, 1],
        )
    )
    df.attrs.update(device_memory_gib=3.7, space="megatron")
    seen = {}
    monkeypatch.setattr("planlab.plotting._save", lambda fig, path: seen.update(fig=fig))
    pareto_plot(df, tmp_path / "pareto.png")
    ax = seen["fig"].axes[0]
    assert ax.get_xlabel() == "peak memory per device (MiB)"
    lo, hi = ax.get_xlim()
    assert lo == 0 and 2.5 < hi < 4.0, hi


@pytest.mark.parametrize(
    "starts, ends, expected",
    [
        ([0.0], [1.0], [1.0, 0.0, 0.0, 0.0]),  # one span, exactly one bin
        ([0.25], [0.75], [0.5, 0.0, 0.0, 0.0]),  # inside a bin: its share of it
        ([0.5], [2.5], [0.5, 1.0, 0.5, 0.0]),  # across bins
        ([0.0, 0.5], [0.25, 0.75], [0.5, 0.0, 0.0, 0.0]),  # two small tasks add up
        ([0.0, 0.0], [1.0, 1.0], [1.0, 0.0, 0.0, 0.0]),  # overlapping: clipped to the whole bin
        ([3.5, 1.0], [4.0, 1.1], [0.0, 0.1, 0.0, 0.5]),  # any order
        ([], [], [0.0, 0.0, 0.0, 0.0]),
    ],
)
def test_coverage_is_the_share_of_each_bin_the_spans_take(starts, ends, expected):
    assert np.allclose(coverage(starts, ends, np.arange(5.0)), expected)


def test_a_million_tasks_cover_what_they_take():
    rng = np.random.default_rng(0)
    starts = np.sort(rng.uniform(0, 10, 1_000_000))
    ends = starts + 1e-6
    cov = coverage(starts, ends, np.linspace(0, 10, 1001))
    assert cov.sum() * 0.01 == pytest.approx(1.0, rel=1e-6)  # 1e6 tasks of 1 us: 1 s of 10


def test_step_envelope_keeps_every_pixels_peak():
    t = np.linspace(0, 1, 100_001)
    v = np.sin(40 * t) + (t == t[70_000]) * 5.0  # a one-sample spike
    tt, vv = step_envelope(t, v, 0.001)
    assert len(tt) <= 1001 and vv.max() == v.max() and tt[0] == 0.0
    assert np.all(np.diff(tt) > 0)
    short_t, short_v = step_envelope([0.0, 0.5], [1.0, 2.0], 0.001)
    assert list(short_v) == [1.0, 2.0]
