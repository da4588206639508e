"""Built-in model families as real torch modules, and users' own models by ``package.module:function``."""

from planlab.models.gpt import GPT, GPTConfig
from planlab.models.llama import Llama, LlamaConfig
from planlab.models.registry import (FAMILIES, GPT_PRESETS, LLAMA_PRESETS, Family, ModelSpec, build_model,
                                     list_models)
from planlab.models.user import UserModelConfig

__all__ = ["FAMILIES", "GPT", "GPTConfig", "GPT_PRESETS", "Family", "LLAMA_PRESETS", "Llama", "LlamaConfig",
           "ModelSpec", "UserModelConfig", "build_model", "list_models"]
