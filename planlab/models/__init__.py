"""Built-in model families as real torch modules, and users' own models by ``package.module:function``."""

from planlab.models.gpt import GPT, GPTConfig
from planlab.models.llama import Llama, LlamaConfig
from planlab.models.registry import FAMILIES, GPT_PRESETS, LLAMA_PRESETS, Family, ModelSpec, build_model, list_models
from planlab.models.user import UserModelConfig

__all__ = [
    "FAMILIES",
    "GPT",
    "GPTConfig",
    "GPT_PRESETS",
    "Family",
    "LLAMA_PRESETS",
    "Llama",
    "LlamaConfig",
    "ModelSpec",
    "UserModelConfig",
    "build_model",
    "list_models",
]

from planlab.models.registry import T5_PRESETS  # noqa: E402
from planlab.models.t5 import T5, T5Config  # noqa: E402

__all__ += ["T5", "T5Config", "T5_PRESETS"]

from planlab.models.evoformer import Evoformer, EvoformerConfig  # noqa: E402
from planlab.models.registry import EVOFORMER_PRESETS  # noqa: E402

__all__ += ["EVOFORMER_PRESETS", "Evoformer", "EvoformerConfig"]

from planlab.models.moe import MoE, MoEConfig  # noqa: E402
from planlab.models.registry import MOE_PRESETS  # noqa: E402

__all__ += ["MOE_PRESETS", "MoE", "MoEConfig"]

from planlab.models.registry import SWIN_PRESETS  # noqa: E402
from planlab.models.swin import Swin, SwinConfig  # noqa: E402

__all__ += ["SWIN_PRESETS", "Swin", "SwinConfig"]
