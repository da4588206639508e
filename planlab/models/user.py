"""A user's own model: ``package.module:function`` returning ``(module, example_inputs)``.

The function takes the model's ``--model-arg`` overrides as keyword arguments and returns the
module (whose forward returns the scalar training loss) and a tuple of example input tensors
whose first dimension is the batch. planlab rescales that dimension to the global batch by
repeating or narrowing along dim 0, and seeds torch before the call so every process builds
the same weights and inputs.
"""

from __future__ import annotations

import functools
import importlib
import math
from typing import Any, Callable

import torch
import torch.nn as nn

from planlab.errors import ConfigError
from planlab.models.configs import UserModelConfig  # noqa: F401 (re-exported)

_HEAD_ATTRS = ("heads", "n_heads", "num_heads", "n_head", "num_attention_heads")
_KV_ATTRS = ("kv_heads", "n_kv_heads", "num_key_value_heads")


def _load(name: str) -> Callable:
    mod, _, attr = name.partition(":")
    try:
        fn = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"cannot load model {name!r}: {type(e).__name__}: {e}") from None
    if not callable(fn):
        raise ConfigError(
            f"model {name!r} is a {type(fn).__name__}; expected a function returning (module, example_inputs)"
        )
    return fn


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {list(x.shape)}"
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of ({', '.join(type(v).__name__ for v in x)})"
    return f"a {type(x).__name__}"


def _check(name: str, out: Any) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    expected = (
        "(module, example_inputs): an nn.Module whose forward returns the scalar loss and a tuple "
        "of tensors whose first dimension is the batch"
    )
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise ConfigError(f"model function {name!r} must return {expected}; it returned {_describe(out)}")
    module, inputs = out
    if not isinstance(module, nn.Module):
        raise ConfigError(f"model function {name!r} must return {expected}; its first value is {_describe(module)}")
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if (
        not isinstance(inputs, (tuple, list))
        or not inputs
        or not all(isinstance(x, torch.Tensor) and x.dim() >= 1 for x in inputs)
    ):
        raise ConfigError(f"model function {name!r} must return {expected}; its example inputs are {_describe(inputs)}")
    batches = {int(x.shape[0]) for x in inputs}
    if len(batches) != 1 or 0 in batches:
        raise ConfigError(
            f"model function {name!r}: example inputs must share a non-zero first (batch) "
            f"dimension; their shapes are {[list(x.shape) for x in inputs]}"
        )
    return module, tuple(inputs)


def _call(name: str, args: tuple[tuple[str, Any], ...], meta: bool) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    fn = _load(name)
    try:
        if meta:
            with torch.device("meta"):
                out = fn(**dict(args))
        else:
            out = fn(**dict(args))
    except Exception as e:
        raise ConfigError(f"model function {name!r} raised {type(e).__name__}: {e}") from e
    return _check(name, out)


def _rebatch(x: torch.Tensor, batch: int) -> torch.Tensor:
    """``x`` with ``batch`` samples along dim 0: the first ones, or the samples repeated."""
    b0 = x.shape[0]
    if batch > b0:
        x = x.repeat(math.ceil(batch / b0), *([1] * (x.dim() - 1)))
    return x.narrow(0, 0, batch).contiguous()


def build_user_model(
    name: str, args: tuple[tuple[str, Any], ...], *, batch: int, device: str | torch.device, seed: int
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Call the user's function (seeded) and rescale its example inputs to ``batch``.

    On ``device="meta"`` the function runs under ``torch.device("meta")`` so no memory is used
    for weights; if it fails there it runs on the CPU and the result moves to meta.
    """
    torch.manual_seed(seed)
    if str(device) == "meta":
        try:
            module, inputs = _call(name, args, meta=True)
        except ConfigError:
            torch.manual_seed(seed)
            module, inputs = _call(name, args, meta=False)
        module = module.to("meta")
    else:
        module, inputs = _call(name, args, meta=False)
        module = module.to(device)
    return module, tuple(_rebatch(x, batch).to(device) for x in inputs)


def _find_int(module: nn.Module, attrs: tuple[str, ...]) -> int | None:
    for m in module.modules():
        for a in attrs:
            v = getattr(m, a, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


@functools.lru_cache(maxsize=16)
def user_model_config(name: str, args: tuple[tuple[str, Any], ...]) -> UserModelConfig:
    """Layers and heads of the user's model (built once on meta per name and arguments)."""
    module, _ = build_user_model(name, args, batch=1, device="meta", seed=0)
    blocks = getattr(module, "blocks", None)
    layers = len(blocks) if isinstance(blocks, nn.ModuleList) and len(blocks) else 1
    return UserModelConfig(
        name=name,
        layers=layers,
        heads=_find_int(module, _HEAD_ATTRS) or 1,
        kv_heads=_find_int(module, _KV_ATTRS),
        params=sum(p.numel() for p in module.parameters()),
    )
