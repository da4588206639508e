"""Built-in model families as real torch modules, and users' own models by ``package.module:function``.

``ModelSpec`` loads with the package; the modules and presets import torch, so they load on first
use (:mod:`planlab.lazy`).
"""

from planlab.lazy import make_lazy
from planlab.models.spec import ModelSpec  # noqa: F401 (public, loaded with the package)

_REGISTRY = ("FAMILIES", "Family", "build_model", "list_models")
_PRESETS = ("GPT", "LLAMA", "T5", "EVOFORMER", "MOE", "SWIN")
_MODULES = {
    "gpt": ("GPT", "GPTConfig"),
    "llama": ("Llama", "LlamaConfig"),
    "t5": ("T5", "T5Config"),
    "evoformer": ("Evoformer", "EvoformerConfig"),
    "moe": ("MoE", "MoEConfig"),
    "swin": ("Swin", "SwinConfig"),
    "user": ("UserModelConfig",),
}
make_lazy(
    __name__,
    {
        **{n: "planlab.models.registry" for n in _REGISTRY + tuple(f"{p}_PRESETS" for p in _PRESETS)},
        **{n: f"planlab.models.{m}" for m, names in _MODULES.items() for n in names},
    },
)

__all__ = sorted(
    ["ModelSpec", *_REGISTRY, *(f"{p}_PRESETS" for p in _PRESETS), *(n for v in _MODULES.values() for n in v)]
)
