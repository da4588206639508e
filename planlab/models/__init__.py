"""Built-in model families as real torch modules."""

from planlab.models.gpt import GPT, GPTConfig
from planlab.models.registry import GPT_PRESETS, ModelSpec, build_model, list_models

__all__ = ["GPT", "GPTConfig", "GPT_PRESETS", "ModelSpec", "build_model", "list_models"]
