"""Built-in models by name: presets and families with overrides, and users' own models.

A :class:`ModelSpec` names a preset (``gpt3-175b``, ``llama3-8b``), a family with every size
given as an override (``gpt`` or ``llama`` with ``layers=..``, ...), or a user's function as
``package.module:function`` (see :mod:`planlab.models.user`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Union

import torch
import torch.nn as nn

from planlab.errors import ConfigError, choices
from planlab.models.gpt import GPT, GPTConfig
from planlab.models.llama import Llama, LlamaConfig
from planlab.models.user import UserModelConfig, build_user_model, user_model_config

ModelConfig = Union[GPTConfig, LlamaConfig, UserModelConfig]

# GPT-3 shapes from Brown et al. 2020, table 2.1 (sequence 2048, vocabulary 50257 rounded to 51200
# as Megatron-LM pads it).
GPT_PRESETS: dict[str, GPTConfig] = {
    "gpt-tiny": GPTConfig(layers=2, hidden=64, heads=4, seq=32, vocab=128),
    "gpt-small": GPTConfig(layers=4, hidden=128, heads=4, seq=64, vocab=512),
    "gpt3-125m": GPTConfig(layers=12, hidden=768, heads=12, seq=2048, vocab=51200),
    "gpt3-350m": GPTConfig(layers=24, hidden=1024, heads=16, seq=2048, vocab=51200),
    "gpt3-760m": GPTConfig(layers=24, hidden=1536, heads=16, seq=2048, vocab=51200),
    "gpt3-1.3b": GPTConfig(layers=24, hidden=2048, heads=32, seq=2048, vocab=51200),
    "gpt3-2.7b": GPTConfig(layers=32, hidden=2560, heads=32, seq=2048, vocab=51200),
    "gpt3-6.7b": GPTConfig(layers=32, hidden=4096, heads=32, seq=2048, vocab=51200),
    "gpt3-13b": GPTConfig(layers=40, hidden=5120, heads=40, seq=2048, vocab=51200),
    "gpt3-175b": GPTConfig(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200),
}

# LLaMA shapes as Meta published them. Llama 2 (Touvron et al. 2023, "Llama 2: Open Foundation and
# Fine-Tuned Chat Models"; sizes from the released params.json / Hugging Face config.json of
# meta-llama/Llama-2-{7b,13b,70b}): vocabulary 32,000, context 4,096, RoPE theta 10,000, GQA with
# 8 key/value heads only at 70B. Llama 3 / 3.1 (Llama Team 2024, "The Llama 3 Herd of Models", table 3:
# 8B 32 layers x 4,096, FFN 14,336, 32 heads; 70B 80 x 8,192, FFN 28,672, 64 heads; 405B 126 x
# 16,384, FFN 53,248, 128 heads; 8 key/value heads each; RoPE theta 500,000): the paper rounds the
# vocabulary to 128K, the released config.json has 128,256 entries; pre-training sequence 8,192.
LLAMA_PRESETS: dict[str, LlamaConfig] = {
    "llama-tiny": LlamaConfig(layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=160, seq=32, vocab=128),
    "llama2-7b": LlamaConfig(layers=32, hidden=4096, heads=32, kv_heads=32, ffn_hidden=11008, seq=4096,
                             vocab=32000),
    "llama2-13b": LlamaConfig(layers=40, hidden=5120, heads=40, kv_heads=40, ffn_hidden=13824, seq=4096,
                              vocab=32000),
    "llama2-70b": LlamaConfig(layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672, seq=4096,
                              vocab=32000),
    "llama3-8b": LlamaConfig(layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, seq=8192,
                             vocab=128256, rope_theta=500000.0),
    "llama3-70b": LlamaConfig(layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672, seq=8192,
                              vocab=128256, rope_theta=500000.0),
    "llama3-405b": LlamaConfig(layers=126, hidden=16384, heads=128, kv_heads=8, ffn_hidden=53248, seq=8192,
                               vocab=128256, rope_theta=500000.0),
}


def _check_gpt(cfg: GPTConfig) -> None:
    if cfg.hidden % cfg.heads:
        raise ConfigError(f"hidden={cfg.hidden} is not divisible by heads={cfg.heads}")


def _check_llama(cfg: LlamaConfig) -> None:
    if cfg.hidden % cfg.heads:
        raise ConfigError(f"hidden={cfg.hidden} is not divisible by heads={cfg.heads}")
    if cfg.kv_heads < 1 or cfg.heads % cfg.kv_heads:
        raise ConfigError(f"kv_heads={cfg.kv_heads} does not divide heads={cfg.heads}")
    if cfg.head_dim % 2:
        raise ConfigError(f"the head size hidden/heads={cfg.head_dim} must be even for rotary embeddings")


@dataclass(frozen=True)
class Family:
    """A built-in model family: its config class, module, presets, required sizes and checks.

    ``module`` is built from a config and has ``example_inputs(cfg, batch, device, seed)``.
    """

    name: str
    config: type
    module: type[nn.Module]
    presets: dict[str, Any]
    required: tuple[str, ...]
    check: Callable[[Any], None]

    def __str__(self) -> str:
        return self.name


FAMILIES: dict[str, Family] = {
    "gpt": Family("gpt", GPTConfig, GPT, GPT_PRESETS, ("layers", "hidden", "heads", "seq", "vocab"), _check_gpt),
    "llama": Family("llama", LlamaConfig, Llama, LLAMA_PRESETS,
                    ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "seq", "vocab"), _check_llama),
}
PRESET_FAMILY: dict[str, str] = {p: f.name for f in FAMILIES.values() for p in f.presets}


def is_user_model(name: str) -> bool:
    """True for ``package.module:function`` names."""
    return ":" in name


@dataclass(frozen=True)
class ModelSpec:
    """A model by name (a preset, a family, or ``package.module:function``) with keyword overrides."""

    name: str
    args: tuple[tuple[str, int | float], ...] = ()

    def family(self) -> Family | None:
        """The built-in family this spec names (None for a user's model); ConfigError if unknown."""
        if is_user_model(self.name):
            return None
        if self.name in PRESET_FAMILY:
            return FAMILIES[PRESET_FAMILY[self.name]]
        if self.name in FAMILIES:
            return FAMILIES[self.name]
        raise ConfigError(f"unknown model {self.name!r}; choose {choices(list(PRESET_FAMILY) + list(FAMILIES))}, "
                          "or package.module:function for your own model")

    def config(self) -> ModelConfig:
        """The family config this spec names; ConfigError on an unknown name or key."""
        fam = self.family()
        if fam is None:
            return user_model_config(self.name, self.args)
        fields = fam.config.__dataclass_fields__
        kw = dict(self.args)
        for k in kw:
            if k not in fields:
                raise ConfigError(f"unknown model argument {k!r} for {self.name!r}; choose {choices(list(fields))}")
        if self.name in fam.presets:
            cfg = replace(fam.presets[self.name], **kw)
        else:
            missing = [f for f in fam.required if f not in kw]
            if missing:
                raise ConfigError(f"model family {self.name!r} needs --model-arg for {', '.join(missing)}")
            cfg = fam.config(**kw)
        fam.check(cfg)
        return cfg

    def to_json(self) -> dict:
        return {"name": self.name, "args": dict(self.args)}

    @classmethod
    def from_json(cls, d: dict) -> "ModelSpec":
        return cls(str(d["name"]), tuple(sorted(dict(d.get("args", {})).items())))

    def __str__(self) -> str:
        extra = ",".join(f"{k}={v}" for k, v in self.args)
        return self.name + (f"({extra})" if extra else "")


def build_model(spec: ModelSpec, *, batch: int, device: str | torch.device = "meta",
                seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
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
