"""Training data of a run: the model's synthetic example inputs, or batches the user supplies.

``--data`` takes either

* a file saved with ``torch.save``: a list of batches, each a tuple (or list) of tensors
  shaped as the model's example inputs at the plan's global batch (a single tensor for a
  model of one input), or
* ``package.module:function``: called as ``function(global_batch=B, steps=N)``, it returns
  an iterable of such batches (the first N are used).

Step ``s`` trains on batch ``s % len(batches)``, counting the steps of the checkpoint a run
starts from (a resumed run goes on with the next batch). Every rank loads the same batches (each
takes its part of the batch as the plan's load tasks say), and so does the single-process
reference of the numeric check.
"""

from __future__ import annotations

import importlib
import itertools
import os
from typing import Any, Sequence

import torch

from planlab.errors import ConfigError

Batch = tuple[torch.Tensor, ...]


def _describe(batch: Sequence[Any]) -> str:
    return ", ".join(
        f"{tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}" if isinstance(x, torch.Tensor) else type(x).__name__
        for x in batch
    )


def _from_function(source: str, global_batch: int, steps: int) -> list:
    mod, _, attr = source.partition(":")
    try:
        fn = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"--data {source}: cannot load it: {type(e).__name__}: {e}") from None
    try:
        out = fn(global_batch=global_batch, steps=steps)
        return list(itertools.islice(iter(out), steps))
    except Exception as e:
        raise ConfigError(f"--data {source}: the function raised {type(e).__name__}: {e}") from e


def _from_file(source: str) -> list:
    try:
        out = torch.load(source, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ConfigError(f"--data {source}: cannot read it with torch.load: {type(e).__name__}: {e}") from None
    if not isinstance(out, (list, tuple)):
        raise ConfigError(
            f"--data {source} holds a {type(out).__name__}; expected a list of batches (each a tuple of tensors)"
        )
    return list(out)


def load_batches(source: str, *, example: Batch, global_batch: int, steps: int) -> list[Batch]:
    """The batches ``source`` names (a ``torch.save`` file or ``package.module:function``),
    each checked against the model's ``example`` inputs: as many tensors, the same shapes
    and dtypes; ConfigError naming the first batch that differs."""
    is_file = os.path.exists(source) or not (":" in source and "/" not in source.partition(":")[0])
    raw = _from_file(source) if is_file else _from_function(source, global_batch, steps)
    if not raw:
        raise ConfigError(f"--data {source} holds no batch")
    want = _describe(example)
    batches: list[Batch] = []
    for i, b in enumerate(raw):
        b = (b,) if isinstance(b, torch.Tensor) else tuple(b) if isinstance(b, (list, tuple)) else (b,)
        ok = len(b) == len(example) and all(
            isinstance(x, torch.Tensor) and x.shape == e.shape and x.dtype == e.dtype for x, e in zip(b, example)
        )
        if not ok:
            raise ConfigError(
                f"--data {source}: batch {i} is ({_describe(b)}); the model takes ({want}) at "
                f"global batch {global_batch}"
            )
        batches.append(tuple(x.contiguous() for x in b))
    return batches
