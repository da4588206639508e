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


@functools.lru_cache(maxsize=8)
def traced(name: str = "gpt-tiny", batch: int = 8, args: tuple = ()):
    spec = ModelSpec(name, args)
    model, inputs = build_model(spec, batch=batch)
    return spec, trace(model, inputs)


@pytest.fixture
def tiny():
    return traced("gpt-tiny", 8)
