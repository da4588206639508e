"""Checks of what a user gives planlab, made at the edges (the command line and the Python API)
before any work starts: each raises a :class:`~planlab.errors.ConfigError` whose message names the
value and what was expected, so ``planlab`` prints one line and exits with status 2.

The limits refuse sizes no training run has used, which would otherwise run for hours or fill
the memory (a schedule of ``global_batch`` micro-batches, a search over every divisor of the
device count): they sit an order of magnitude above the largest published runs.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from planlab.errors import ConfigError

# The largest published global batches are 64k-128k images (LARS/LAMB ImageNet runs); language
# models train on 1-4k sequences (GPT-3: 1,536 of 2,048 tokens; Llama 3: 4M tokens of 8k).
MAX_GLOBAL_BATCH = 2**17
# The largest published training clusters hold about 100k GPUs (Llama 3 trained on 16,384 H100s).
MAX_DEVICES = 2**17
# Model sizes passed with --model-arg (layers, hidden, sequence, vocabulary, ...): the largest
# published are 256k (vocabulary) and 1M (context) entries; layer counts stay below a few hundred.
MAX_MODEL_SIZE = 2**24
MAX_LAYERS = 10_000
LAYER_ARGS = ("layers", "encoder_layers", "decoder_layers", "blocks")


def count(value, what: str, *, minimum: int = 1, maximum: int | None = None, limit_why: str = "") -> int:
    """``value`` if it is an integer from ``minimum`` to ``maximum``; else a ConfigError naming
    ``what`` (``--global-batch``), the value and the range."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{what} must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{what} must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{what}={value:,} is above planlab's limit of {maximum:,}{limit_why}")
    return value


def number(value, what: str, *, minimum: float = 0.0) -> float:
    """``value`` if it is a finite number of at least ``minimum``; else a ConfigError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{what} must be a number, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{what} must be at least {minimum:g}, got {value:g}")
    return float(value)


def _path(path, what: str) -> Path:
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ConfigError(f"{what} must be a path, got {path!r}")
    return Path(path)


def writable_folder(path, what: str) -> Path:
    """``path`` if it is a folder, or can be made one, in which files can be written (nothing is
    created here); else a ConfigError naming ``what`` (``--out``) and the path."""
    p = _path(path, what)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{what} {str(p)!r} is a file; expected a folder")
    base = p
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise ConfigError(f"{what} {str(p)!r} cannot be made: {str(base)!r} is a file, not a folder")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {str(p)!r} cannot be written: folder {str(base)!r} is not writable")
    return p


def writable_file(path, what: str) -> Path:
    """``path`` if a file can be written there (its folder exists or can be made); else a
    ConfigError naming ``what`` (``--trace``) and the path."""
    p = _path(path, what)
    if p.is_dir():
        raise ConfigError(f"{what} {str(p)!r} is a folder; expected a file name")
    writable_folder(p.parent, f"{what} {str(p)!r}: its folder")
    return p


def readable_file(path, what: str) -> Path:
    """``path`` if it names an existing file; else a ConfigError naming ``what`` and the path."""
    p = _path(path, what)
    if not p.exists():
        raise ConfigError(f"{what} {str(p)!r} does not exist")
    if p.is_dir():
        raise ConfigError(f"{what} {str(p)!r} is a folder; expected a file")
    return p


def model_arg_type(name: str, value, default) -> None:
    """One ``--model-arg name=value`` of a built-in family whose default is ``default``: an integer
    where the default is one, a number where it is a float (ConfigError naming both otherwise)."""
    if isinstance(default, bool) or isinstance(default, (tuple, list, str)):
        return
    if isinstance(default, int) and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{name}={value!r} must be a positive integer")
    if isinstance(default, float) and (
        isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
    ):
        raise ConfigError(f"{name}={value!r} must be a number")


def model_arg(name: str, value, default) -> None:
    """:func:`model_arg_type`, and the range: an integer size at least 1 (``vocab_parallel`` 0 or
    1) up to the limits above, a number at least 0 (a dropout less than 1)."""
    model_arg_type(name, value, default)
    if isinstance(default, bool) or isinstance(default, (tuple, list, str)):
        return
    if isinstance(default, int):
        if name == "vocab_parallel":
            if value not in (0, 1):
                raise ConfigError(f"vocab_parallel={value!r} must be 0 or 1")
            return
        limit = MAX_LAYERS if name in LAYER_ARGS else MAX_MODEL_SIZE
        if value < 1:
            raise ConfigError(f"{name}={value!r} must be a positive integer")
        count(value, name, maximum=limit)
    elif value < 0 or (name == "dropout" and value >= 1):
        raise ConfigError(
            f"{name}={value:g} must be in [0, 1)" if name == "dropout" else f"{name}={value:g} must be at least 0"
        )


def check_sizes(global_batch, num_devices: int) -> None:
    """The global batch and the cluster's device count, within planlab's limits."""
    count(global_batch, "--global-batch", maximum=MAX_GLOBAL_BATCH, limit_why=" samples")
    count(num_devices, "the cluster's device count (--nodes x devices per node)", maximum=MAX_DEVICES)


def check_explore_options(jobs, budget, candidates, ray, resume, out) -> None:
    """``planlab.explore``'s options that need no model or cluster, checked before any work."""
    if not isinstance(jobs, int) or jobs < 1:
        raise ConfigError(f"--jobs must be a positive integer, got {jobs!r}")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget < 0):
        raise ConfigError(f"--budget must be a number of seconds >= 0, got {budget!r}")
    if candidates is not None and (not isinstance(candidates, int) or candidates < 1):
        raise ConfigError(f"--candidates must be a positive integer, got {candidates!r}")
    if not isinstance(ray, (bool, str)):
        raise ConfigError(f"--ray takes a Ray address or nothing (a local Ray instance), got {ray!r}")
    if resume and out is None:
        raise ConfigError("--resume needs --out, the folder of the exploration to continue")
    if out is not None:
        writable_folder(out, "--out")  # before the work, not after it
