import functools
import os
import tempfile

import pytest

os.environ.setdefault("MPLBACKEND", "Agg")  # plots in tests (and the kernels of the notebook tests) draw off-screen

from planlab.graph import trace
from planlab.models import ModelSpec, build_model

# traced graphs are cached for this session only (planlab.models.trace_cache), never in the user's cache
_TRACE_CACHE = tempfile.TemporaryDirectory(prefix="pytest-trace-cache-")
os.environ["PLANLAB_CACHE_DIR"] = _TRACE_CACHE.name


def all_to_alls(dev) -> list:
    """A device program's all-to-all collectives, after checking it sends and receives nothing."""
    from planlab.plan.program import TaskKind

    tasks = [t for _, t in dev.tasks_in_order()]
    assert not [t for t in tasks if t.kind in (TaskKind.SEND, TaskKind.RECV)]
    return [t for t in tasks if t.kind is TaskKind.COLLECTIVE and t.collective == "all_to_all"]


@functools.lru_cache(maxsize=8)
def traced(name: str = "gpt-tiny", batch: int = 8, args: tuple = ()):
    spec = ModelSpec(name, args)
    model, inputs = build_model(spec, batch=batch)
    return spec, trace(model, inputs)


@pytest.fixture
def tiny():
    return traced("gpt-tiny", 8)
