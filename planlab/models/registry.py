"""Built-in models by name: presets and families with overrides, and users' own models.

A :class:`ModelSpec` names a preset (``gpt3-175b``, ``llama3-8b``), a family with every size
given as an override (``gpt`` or ``llama`` with ``layers=..``, ...), or a user's function as
``package.module:function`` (see :mod:`planlab.models.user`). The families, their presets and
checks live in :mod:`planlab.models.families`, without torch; this module builds their modules.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from planlab.models.configs import GPTConfig, LlamaConfig
from planlab.models.families import (  # noqa: F401 (re-exported)
    DEEPSEEK_PRESETS,
    EVOFORMER_PRESETS,
    FAMILIES,
    GPT_PRESETS,
    LLAMA_PRESETS,
    MOE_PRESETS,
    PRESET_FAMILY,
    SWIN_PRESETS,
    T5_PRESETS,
    Family,
    ModelConfig,
)
from planlab.models.spec import ModelSpec, is_user_model  # noqa: F401 (re-exported: ModelSpec lives apart, without torch)
from planlab.models.user import build_user_model


def build_model(
    spec: ModelSpec, *, batch: int, device: str | torch.device = "meta", seed: int = 0
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Build the module and example inputs of ``batch`` samples.

    On ``device="meta"`` no memory is used for weights; on a real device the
    weights are drawn from ``seed`` so every process builds the same model.
    """
    fam = spec.family()
    if fam is None:
        return build_user_model(spec.name, spec.args, batch=batch, device=device, seed=seed)
    cfg = spec.config()
    if str(device) == "meta":
        with torch.device("meta"):
            model = fam.module(cfg)
    else:
        torch.manual_seed(seed)
        model = fam.module(cfg).to(device)
    return model, fam.module.example_inputs(cfg, batch, device, seed=seed + 1)


def list_models() -> list[tuple[str, GPTConfig | LlamaConfig]]:
    """Every preset with its config, family by family."""
    return [(name, cfg) for fam in FAMILIES.values() for name, cfg in fam.presets.items()]
