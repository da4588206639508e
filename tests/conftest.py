import functools
import os

import pytest

os.environ.setdefault("MPLBACKEND", "Agg")  # plots in tests (and the kernels of the notebook tests) draw off-screen

from planlab.graph import trace
from planlab.models import ModelSpec, build_model


@functools.lru_cache(maxsize=8)
def traced(name: str = "gpt-tiny", batch: int = 8, args: tuple = ()):
    spec = ModelSpec(name, args)
    model, inputs = build_model(spec, batch=batch)
    return spec, trace(model, inputs)


@pytest.fixture
def tiny():
    return traced("gpt-tiny", 8)
