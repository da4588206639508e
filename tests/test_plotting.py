"""Plots pick their axes from their data: the Pareto plot's memory axis spans the simulated peaks,
and the device memory only when it is near them."""

import pandas as pd
import pytest

from planlab.plotting import pareto_plot, shown_capacity


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
