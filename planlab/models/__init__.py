"""Built-in model families as real torch modules, and users' own models by ``package.module:function``.

``ModelSpec`` loads with the package; the rest loads on first use (:mod:`planlab.lazy`): the configs,
presets and families without torch (:mod:`planlab.models.configs`, :mod:`planlab.models.families`),
the modules and ``build_model`` with it.
"""

from planlab.lazy import make_lazy
from planlab.models.spec import ModelSpec  # noqa: F401 (public, loaded with the package)

_REGISTRY = ("build_model", "list_models")
_FAMILIES = ("FAMILIES", "Family")
_PRESETS = ("GPT", "LLAMA", "T5", "EVOFORMER", "MOE", "SWIN")
_MODULES = {
    "gpt": ("GPT",),
    "llama": ("Llama",),
    "t5": ("T5",),
    "evoformer": ("Evoformer",),
    "moe": ("MoE",),
    "swin": ("Swin",),
    "configs": (
        "GPTConfig",
        "LlamaConfig",
        "T5Config",
        "EvoformerConfig",
        "MoEConfig",
        "SwinConfig",
        "UserModelConfig",
    ),
}
make_lazy(
    __name__,
    {
        **{n: "planlab.models.registry" for n in _REGISTRY},
        **{n: "planlab.models.families" for n in _FAMILIES + tuple(f"{p}_PRESETS" for p in _PRESETS)},
        **{n: f"planlab.models.{m}" for m, names in _MODULES.items() for n in names},
    },
)

__all__ = sorted(
    [
        "ModelSpec",
        *_REGISTRY,
        *_FAMILIES,
        *(f"{p}_PRESETS" for p in _PRESETS),
        *(n for v in _MODULES.values() for n in v),
    ]
)
