"""The built-in model families: their configs, presets and checks, importable without torch.

:class:`~planlab.models.spec.ModelSpec` reads a model's config from here; the torch modules load
only when a family's :attr:`Family.module` is first used (:func:`planlab.models.registry.build_model`).
"""

from __future__ import annotations

import importlib
from dataclasses import MISSING, dataclass
from typing import Any, Callable, Union

from planlab.errors import ConfigError
from planlab.models.configs import (
    DeepSeekConfig,
    EvoformerConfig,
    GPTConfig,
    LlamaConfig,
    MoEConfig,
    SwinConfig,
    T5Config,
    UserModelConfig,
    check_swin,
)
from planlab.models.nnscaler import NNSCALER_EVOFORMER_PRESETS, NNSCALER_SWIN_PRESETS, NNSCALER_T5_PRESETS

ModelConfig = Union[
    GPTConfig, LlamaConfig, T5Config, EvoformerConfig, MoEConfig, DeepSeekConfig, SwinConfig, UserModelConfig
]

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
    "llama2-7b": LlamaConfig(layers=32, hidden=4096, heads=32, kv_heads=32, ffn_hidden=11008, seq=4096, vocab=32000),
    "llama2-13b": LlamaConfig(layers=40, hidden=5120, heads=40, kv_heads=40, ffn_hidden=13824, seq=4096, vocab=32000),
    "llama2-70b": LlamaConfig(layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672, seq=4096, vocab=32000),
    "llama3-8b": LlamaConfig(
        layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, seq=8192, vocab=128256, rope_theta=500000.0
    ),
    "llama3-70b": LlamaConfig(
        layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672, seq=8192, vocab=128256, rope_theta=500000.0
    ),
    "llama3-405b": LlamaConfig(
        layers=126, hidden=16384, heads=128, kv_heads=8, ffn_hidden=53248, seq=8192, vocab=128256, rope_theta=500000.0
    ),
}


def _t5_v1_1(layers: int, hidden: int, heads: int, ffn_hidden: int) -> T5Config:
    """A T5 v1.1 size: as many decoder layers as encoder layers, 64 channels a head, 32,128 tokens,
    512 input and 114 target tokens (see :data:`T5_PRESETS`)."""
    return T5Config(
        encoder_layers=layers,
        decoder_layers=layers,
        hidden=hidden,
        heads=heads,
        head_dim=64,
        ffn_hidden=ffn_hidden,
        seq=512,
        decoder_seq=114,
        vocab=32128,
    )


# T5 v1.1 shapes from the released config.json of google/t5-v1_1-{small,base,large,xl,xxl} (d_model,
# d_ff, num_heads, d_kv = 64, num_layers = num_decoder_layers, vocab_size 32,128, 32 relative
# buckets up to distance 128). Sequence lengths of T5's span-corruption pre-training (Raffel et al.
# 2020, section 3.1.4; t5x's pretrain gin files): 512 input tokens; 15% noise in spans of mean
# length 3 leaves targets of 114 tokens, the decoder length here. For fine-tuning on long outputs
# use --model-arg decoder_seq=512.
T5_PRESETS: dict[str, T5Config] = {
    "t5-tiny": T5Config(
        encoder_layers=2,
        decoder_layers=2,
        hidden=64,
        heads=4,
        head_dim=8,
        ffn_hidden=128,
        seq=32,
        decoder_seq=16,
        vocab=128,
    ),
    "t5-v1_1-small": _t5_v1_1(layers=8, hidden=512, heads=6, ffn_hidden=1024),
    "t5-v1_1-base": _t5_v1_1(layers=12, hidden=768, heads=12, ffn_hidden=2048),
    "t5-v1_1-large": _t5_v1_1(layers=24, hidden=1024, heads=16, ffn_hidden=2816),
    "t5-v1_1-xl": _t5_v1_1(layers=24, hidden=2048, heads=32, ffn_hidden=5120),
    "t5-v1_1-xxl": _t5_v1_1(layers=24, hidden=4096, heads=64, ffn_hidden=10240),
}

# AlphaFold2's Evoformer stack (Jumper et al. 2021, supplementary information, section 1.6 and
# Algorithms 6-15): 48 blocks, c_m = 256, c_z = 128, MSA attention 8 heads x 32 channels, triangle
# attention 4 heads x 32, outer product mean 32 channels, triangle multiplication 128, transitions
# x4 (the EvoformerConfig defaults). Crop sizes of its training stages (supplement section 1.11):
# initial training N_res = 256 residues with N_seq = 128 MSA sequences, fine-tuning N_res = 384 with
# N_seq = 512 (nnScaler's AlphaFold2 example, msrasys/nnscaler examples/alphafold2/README.md,
# uses the same shapes). The larger AlphaFold2 settings of nnScaler's evaluation (OSDI'24, section 7)
# are not included: their sizes were not found in a source we could cite.
EVOFORMER_PRESETS: dict[str, EvoformerConfig] = {
    "evoformer-tiny": EvoformerConfig(
        blocks=2,
        c_m=16,
        c_z=8,
        heads_msa=2,
        heads_pair=2,
        n_seq=8,
        n_res=8,
        c_att_msa=8,
        c_att_pair=4,
        c_opm=4,
        c_tri_mul=8,
    ),
    "alphafold2": EvoformerConfig(blocks=48, c_m=256, c_z=128, heads_msa=8, heads_pair=4, n_seq=128, n_res=256),
    "alphafold2-finetune": EvoformerConfig(
        blocks=48, c_m=256, c_z=128, heads_msa=8, heads_pair=4, n_seq=512, n_res=384
    ),
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


def _check_t5(cfg: T5Config) -> None:
    for name in (
        "encoder_layers",
        "decoder_layers",
        "hidden",
        "heads",
        "head_dim",
        "ffn_hidden",
        "seq",
        "decoder_seq",
        "vocab",
    ):
        v = getattr(cfg, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"{name}={v!r} must be a positive integer")
    if cfg.decoder_seq < 2:
        raise ConfigError(
            f"decoder_seq={cfg.decoder_seq} must be at least 2 (the labels shifted right behind the start token)"
        )
    if cfg.rel_buckets < 4 or cfg.rel_buckets % 2:
        raise ConfigError(f"rel_buckets={cfg.rel_buckets} must be an even number of at least 4")
    if cfg.rel_max_distance <= cfg.rel_buckets // 2:
        raise ConfigError(
            f"rel_max_distance={cfg.rel_max_distance} must exceed rel_buckets/2="
            f"{cfg.rel_buckets // 2} (the exactly bucketed distances)"
        )
    if not 0.0 <= cfg.dropout < 1.0:
        raise ConfigError(f"dropout={cfg.dropout} must be in [0, 1)")
    if cfg.gated_ffn not in (0, 1):
        raise ConfigError(f"gated_ffn={cfg.gated_ffn!r} must be 0 (two-matrix feed-forward) or 1 (gated, T5 v1.1)")


def _check_evoformer(cfg: EvoformerConfig) -> None:
    for name in EvoformerConfig.__dataclass_fields__:
        v = getattr(cfg, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"{name}={v!r} must be a positive integer")
    if cfg.relpos_bins % 2 == 0:
        raise ConfigError(f"relpos_bins={cfg.relpos_bins} must be odd (offsets -k..k, 2k+1 bins)")


# Mixtral shapes from the released config.json of mistralai/Mixtral-8x7B-v0.1 (hidden_size 4,096,
# intermediate_size 14,336, 32 layers, 32 heads, 8 key/value heads, 8 local experts, 2 per token,
# vocab_size 32,000, rope_theta 1e6, router_aux_loss_coef 0.02; Jiang et al. 2024, "Mixtral of
# Experts", table 1) and of Mixtral-8x22B-v0.1 (as released by Mistral AI, mirrored at
# mistral-community/Mixtral-8x22B-v0.1: hidden_size 6,144, intermediate_size 16,384, 56 layers, 48
# heads, 8 key/value heads, 8 experts, 2 per token, vocab_size 32,000, rope_theta 1e6,
# router_aux_loss_coef 0.001). Sequence 4,096, the length Megatron-Core's Mixtral training examples
# use; the released context lengths (32,768 and 65,536) are --model-arg seq=.. away.
MOE_PRESETS: dict[str, MoEConfig] = {
    "moe-tiny": MoEConfig(
        layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=96, experts=4, top_k=2, seq=32, vocab=128
    ),
    "mixtral-8x7b": MoEConfig(
        layers=32,
        hidden=4096,
        heads=32,
        kv_heads=8,
        ffn_hidden=14336,
        experts=8,
        top_k=2,
        seq=4096,
        vocab=32000,
        aux_loss_coef=0.02,
    ),
    "mixtral-8x22b": MoEConfig(
        layers=56,
        hidden=6144,
        heads=48,
        kv_heads=8,
        ffn_hidden=16384,
        experts=8,
        top_k=2,
        seq=4096,
        vocab=32000,
        aux_loss_coef=0.001,
    ),
}


def _check_moe(cfg: MoEConfig) -> None:
    _check_llama(cfg)  # the attention's sizes
    if cfg.experts < 1:
        raise ConfigError(f"experts={cfg.experts} must be at least 1")
    if not 1 <= cfg.top_k <= cfg.experts:
        raise ConfigError(f"top_k={cfg.top_k} must be between 1 and experts={cfg.experts}")
    if not cfg.capacity_factor > 0:
        raise ConfigError(
            f"capacity_factor={cfg.capacity_factor} must be positive (tokens an expert takes, "
            "relative to an even share)"
        )
    if cfg.aux_loss_coef < 0:
        raise ConfigError(f"aux_loss_coef={cfg.aux_loss_coef} must be at least 0")


# DeepSeek-V3's shape from its technical report (DeepSeek-AI 2024, arXiv:2412.19437, section 4.2,
# "Model Hyper-Parameters": 61 layers, hidden 7,168, 128 heads of 128 channels, kv compression 512,
# query compression 1,536, decoupled rotary key/query 64 per head, all FFNs but the first three
# layers MoE, each with 1 shared and 256 routed experts of intermediate size 2,048, 8 routed experts
# per token; section 2.1.2: sigmoid affinities, normalised over the selected ones; section 4.2:
# sequence-wise balance factor 0.0001; 671B parameters, 37B active per token) and the released
# config.json of deepseek-ai/DeepSeek-V3 (vocab_size 129,280, intermediate_size 18,432 for the dense
# layers, qk_nope_head_dim 128, v_head_dim 128, routed_scaling_factor 2.5, rope_theta 10,000,
# rms_norm_eps 1e-6; n_group 8 and topk_group 4: the node-limited routing of section 2.1.2, each
# token's experts in the best 4 of 8 groups, one group per node of its 64-way expert parallelism).
# Sequence 4,096: the pre-training length (section 4.2). capacity_factor 1.0
# prices a balanced load (see planlab/models/deepseek.py); DeepSeek-V3 itself drops no token.
# deepseek-tiny runs here: capacity_factor 4 = experts / top_k drops nothing.
DEEPSEEK_PRESETS: dict[str, DeepSeekConfig] = {
    "deepseek-tiny": DeepSeekConfig(
        layers=4,
        dense_layers=1,
        hidden=64,
        heads=4,
        ffn_hidden=128,
        moe_ffn_hidden=32,
        experts=8,
        shared_experts=1,
        top_k=2,
        q_lora_rank=32,
        kv_lora_rank=16,
        rope_head_dim=8,
        nope_head_dim=8,
        v_head_dim=8,
        seq=32,
        vocab=128,
        capacity_factor=4.0,
    ),
    "deepseek-v3": DeepSeekConfig(
        layers=61,
        dense_layers=3,
        hidden=7168,
        heads=128,
        ffn_hidden=18432,
        moe_ffn_hidden=2048,
        experts=256,
        shared_experts=1,
        top_k=8,
        q_lora_rank=1536,
        kv_lora_rank=512,
        rope_head_dim=64,
        nope_head_dim=128,
        v_head_dim=128,
        seq=4096,
        vocab=129280,
        route_groups=8,
        route_group_topk=4,
    ),
}


def _check_deepseek(cfg: DeepSeekConfig) -> None:
    for name in DeepSeekConfig.__dataclass_fields__:
        v = getattr(cfg, name)
        if (
            isinstance(v, int)
            and name not in ("dense_layers", "shared_experts", "mtp_layers", "mtp_shared_embedding", "vocab_parallel")
            and v < 1
        ):
            raise ConfigError(f"{name}={v} must be at least 1")
    if not 0 <= cfg.dense_layers <= cfg.layers:
        raise ConfigError(f"dense_layers={cfg.dense_layers} must be between 0 and layers={cfg.layers}")
    if cfg.shared_experts < 0:
        raise ConfigError(f"shared_experts={cfg.shared_experts} must be at least 0")
    if not 1 <= cfg.top_k <= cfg.experts:
        raise ConfigError(f"top_k={cfg.top_k} must be between 1 and experts={cfg.experts}")
    if cfg.rope_head_dim % 2:
        raise ConfigError(f"rope_head_dim={cfg.rope_head_dim} must be even for rotary embeddings")
    for name in ("capacity_factor", "routed_scale"):
        if not getattr(cfg, name) > 0:
            raise ConfigError(f"{name}={getattr(cfg, name)} must be positive")
    if cfg.aux_loss_coef < 0:
        raise ConfigError(f"aux_loss_coef={cfg.aux_loss_coef} must be at least 0")
    if cfg.mtp_layers < 0:
        raise ConfigError(f"mtp_layers={cfg.mtp_layers} must be at least 0 (0: no multi-token prediction)")
    if cfg.vocab_parallel not in (0, 1):
        raise ConfigError(f"vocab_parallel={cfg.vocab_parallel} must be 0 or 1")
    if cfg.mtp_shared_embedding not in (0, 1):
        raise ConfigError(f"mtp_shared_embedding={cfg.mtp_shared_embedding} must be 0 or 1")
    if cfg.mtp_loss_coef < 0:
        raise ConfigError(f"mtp_loss_coef={cfg.mtp_loss_coef} must be at least 0")
    if cfg.experts % cfg.route_groups or not cfg.route_group_topk <= cfg.route_groups:
        raise ConfigError(
            f"route_groups={cfg.route_groups} must divide experts={cfg.experts}, and route_group_topk="
            f"{cfg.route_group_topk} be at most route_groups"
        )
    if cfg.route_group_topk < cfg.route_groups and cfg.route_group_topk * cfg.experts // cfg.route_groups < cfg.top_k:
        raise ConfigError(
            f"route_group_topk={cfg.route_group_topk} groups of {cfg.experts // cfg.route_groups} experts hold "
            f"fewer than top_k={cfg.top_k}"
        )


# Swin Transformer shapes (224x224 images, 4x4 patches, window 7, ImageNet-1k head). Swin-T/S/B/L from
# Liu et al. 2021, "Swin Transformer", section 3.3 and table 1 (C = 96, 96, 128, 192; depths 2,2,6,2
# for T and 2,2,18,2 for the others; heads 3,6,12,24 scaled with C; 28M, 50M, 88M, 197M parameters;
# 28.3M, 49.6M, 87.8M and 196.5M as timm's model cards of the released weights report). The large
# shapes come from Swin Transformer V2 (Liu et al. 2022, section 3.4): SwinV2-H (C = 352, depths
# 2,2,18,2, heads of 32 channels: 11,22,44,88; 658M parameters) and SwinV2-G (C = 512, depths 2,2,42,4,
# heads 16,32,64,128; 3.0B), the sizes nnScaler's Swin experiments scale to (msrasys/nnscaler,
# examples/swin/swin_dwt.py, at 224x224 with window 7). They are built here with V1 blocks (a bias
# table instead of V2's position MLP, pre-norm), within 0.1% of V2's parameters; SwinV2-G's 192x192
# pre-training with window 12 is --model-arg image=192 --model-arg window=12 away.
SWIN_PRESETS: dict[str, SwinConfig] = {
    "swin-tiny": SwinConfig(embed=16, depths=(2, 2, 2), num_heads=(2, 4, 8), image=32, patch=4, window=2, classes=10),
    "swin-t": SwinConfig(embed=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24)),
    "swin-s": SwinConfig(embed=96, depths=(2, 2, 18, 2), num_heads=(3, 6, 12, 24)),
    "swin-b": SwinConfig(embed=128, depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32)),
    "swin-l": SwinConfig(embed=192, depths=(2, 2, 18, 2), num_heads=(6, 12, 24, 48)),
    "swin-h": SwinConfig(embed=352, depths=(2, 2, 18, 2), num_heads=(11, 22, 44, 88)),
    "swin-g": SwinConfig(embed=512, depths=(2, 2, 42, 4), num_heads=(16, 32, 64, 128)),
}


@dataclass(frozen=True)
class Family:
    """A built-in model family: its config class, module, presets, required sizes and checks.

    ``module_path`` (``package.module:Class``) names the torch module built from a config, which
    has ``example_inputs(cfg, batch, device, seed)``; :attr:`module` imports it (and torch) on
    first use, so that a family's configs and checks are read without torch.
    """

    name: str
    config: type
    module_path: str
    presets: dict[str, Any]
    required: tuple[str, ...]
    check: Callable[[Any], None]

    @property
    def module(self) -> type:
        """The family's torch module class (imported here, with torch)."""
        where, _, attr = self.module_path.partition(":")
        return getattr(importlib.import_module(where), attr)

    def __str__(self) -> str:
        return self.name


FAMILIES: dict[str, Family] = {
    "gpt": Family(
        "gpt",
        GPTConfig,
        "planlab.models.gpt:GPT",
        GPT_PRESETS,
        ("layers", "hidden", "heads", "seq", "vocab"),
        _check_gpt,
    ),
    "llama": Family(
        "llama",
        LlamaConfig,
        "planlab.models.llama:Llama",
        LLAMA_PRESETS,
        ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "seq", "vocab"),
        _check_llama,
    ),
    "t5": Family(
        "t5",
        T5Config,
        "planlab.models.t5:T5",
        {**T5_PRESETS, **NNSCALER_T5_PRESETS},
        (
            "encoder_layers",
            "decoder_layers",
            "hidden",
            "heads",
            "head_dim",
            "ffn_hidden",
            "seq",
            "decoder_seq",
            "vocab",
        ),
        _check_t5,
    ),
    "evoformer": Family(
        "evoformer",
        EvoformerConfig,
        "planlab.models.evoformer:Evoformer",
        {**EVOFORMER_PRESETS, **NNSCALER_EVOFORMER_PRESETS},
        ("blocks", "c_m", "c_z", "heads_msa", "heads_pair", "n_seq", "n_res"),
        _check_evoformer,
    ),
    "moe": Family(
        "moe",
        MoEConfig,
        "planlab.models.moe:MoE",
        MOE_PRESETS,
        ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "experts", "top_k", "seq", "vocab"),
        _check_moe,
    ),
    "deepseek": Family(
        "deepseek",
        DeepSeekConfig,
        "planlab.models.deepseek:DeepSeek",
        DEEPSEEK_PRESETS,
        tuple(
            f for f in DeepSeekConfig.__dataclass_fields__ if DeepSeekConfig.__dataclass_fields__[f].default is MISSING
        ),
        _check_deepseek,
    ),
    "swin": Family(
        "swin",
        SwinConfig,
        "planlab.models.swin:Swin",
        {**SWIN_PRESETS, **NNSCALER_SWIN_PRESETS},
        ("embed", "depths", "num_heads"),
        check_swin,
    ),
}
PRESET_FAMILY: dict[str, str] = {p: f.name for f in FAMILIES.values() for p in f.presets}
