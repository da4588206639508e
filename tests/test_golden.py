"""Every prediction unchanged: a table of plans (``tests/golden_predictions.py``: every built-in space,
ZeRO 0 to 3, every schedule (zb-v and dualpipe too), coshard, recycling, interlaced, alpa, context and
expert parallelism, ZeRO-Offload, on the cpu cluster, two DGX A100
nodes and the kernel-level spec) against what was recorded in ``tests/data/golden_predictions.json``:
iteration time, hardware FLOPs, per device class its times and peak memory, per device its class, peak
memory and task count, to 1e-12 relative.

A change that moves predictions on purpose regenerates the file with one command from the
repository root (then read the diff)::

    .venv/bin/python tests/golden_predictions.py
"""

import json
import math

import pytest

from golden_predictions import CASES, DATA, measure

RECORDED = json.loads(DATA.read_text())


def _differences(got, want, path: str = "") -> list[str]:
    """Where ``got`` and ``want`` differ: floats beyond 1e-12 relative, anything else at all."""
    if isinstance(want, dict) and isinstance(got, dict):
        if set(got) != set(want):
            return [f"{path}: keys {sorted(got)} != {sorted(want)}"]
        return [d for k in want for d in _differences(got[k], want[k], f"{path}.{k}")]
    if isinstance(want, list) and isinstance(got, list):
        if len(got) != len(want):
            return [f"{path}: {len(got)} entries != {len(want)}"]
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in _differences(g, w, f"{path}[{i}]")]
    if isinstance(want, float) or isinstance(got, float):
        return [] if math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-300) else [f"{path}: {got!r} != {want!r}"]
    return [] if got == want else [f"{path}: {got!r} != {want!r}"]


def test_the_table_and_the_file_name_the_same_cases():
    assert sorted(c.name for c in CASES) == sorted(RECORDED)
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_predictions_are_unchanged(case):
    diffs = _differences(measure(case), RECORDED[case.name])
    assert not diffs, f"{case.name}: {len(diffs)} differences, e.g. " + "; ".join(diffs[:8])


def test_a_changed_prediction_is_found():
    """The comparison is not vacuous: one ulp-scale change passes, a 1e-9 change is reported."""
    want = RECORDED[CASES[0].name]
    close = dict(want, iter_time_s=want["iter_time_s"] * (1 + 1e-15))
    far = dict(want, iter_time_s=want["iter_time_s"] * (1 + 1e-9))
    assert not _differences(close, want)
    assert _differences(far, want) == [f".iter_time_s: {far['iter_time_s']!r} != {want['iter_time_s']!r}"]
    assert _differences(dict(want, tasks=want["tasks"][:-1]), want)
