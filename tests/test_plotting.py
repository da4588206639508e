"""The timeline and memory plots draw a million tasks as pixels: each pixel shows the time its
tasks cover, and the memory line keeps every pixel's peak."""

import numpy as np
import pytest

from planlab.plotting import coverage, step_envelope


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
