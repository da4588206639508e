"""Built-in models by name: presets and families with overrides."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn

from planlab.errors import ConfigError, choices
from planlab.models.gpt import GPT, GPTConfig

# GPT-3 shapes from Brown et al. 2020, table 2.1 (sequence 2048, vocabulary 50257 rounded to 51200 as Megatron-LM pads it).
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
FAMILIES = {"gpt": GPTConfig}


@dataclass(frozen=True)
class ModelSpec:
    """A model by name (a preset or a family) with keyword overrides."""

    name: str
    args: tuple[tuple[str, int | float], ...] = ()

    def config(self) -> GPTConfig:
        """The family config this spec names; ConfigError on an unknown name or key."""
        if self.name in GPT_PRESETS:
            base = GPT_PRESETS[self.name]
        elif self.name in FAMILIES:
            base = None
        else:
            raise ConfigError(f"unknown model {self.name!r}; choose {choices(list(GPT_PRESETS) + list(FAMILIES))}")
        fields = GPTConfig.__dataclass_fields__
        kw = dict(self.args)
        for k in kw:
            if k not in fields:
                raise ConfigError(f"unknown model argument {k!r} for {self.name!r}; choose {choices(list(fields))}")
        if base is None:
            missing = [f for f in ("layers", "hidden", "heads", "seq", "vocab") if f not in kw]
            if missing:
                raise ConfigError(f"model family {self.name!r} needs --model-arg for {', '.join(missing)}")
            cfg = GPTConfig(**kw)
        else:
            cfg = replace(base, **kw)
        if cfg.hidden % cfg.heads:
            raise ConfigError(f"hidden={cfg.hidden} is not divisible by heads={cfg.heads}")
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
    cfg = spec.config()
    if str(device) == "meta":
        with torch.device("meta"):
            model = GPT(cfg)
    else:
        torch.manual_seed(seed)
        model = GPT(cfg).to(device)
    return model, GPT.example_inputs(cfg, batch, device, seed=seed + 1)


def list_models() -> list[tuple[str, GPTConfig]]:
    return list(GPT_PRESETS.items())
