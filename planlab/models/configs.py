"""The sizes of the built-in model families, as frozen dataclasses importable without torch.

An exploration or a ``planlab simulate`` whose trace is cached reads a model's config (its layers,
heads, ...) but builds no module: these classes live apart from the torch modules
(:mod:`planlab.models.gpt`, ...) that take them, so that reading a config does not import torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planlab.errors import ConfigError

# Operator kinds whose table a plan may split by rows (the vocabulary, ``v``): torch's embedding
# and the vocabulary-parallel one (:mod:`planlab.models.vocab_parallel`, a config's ``vocab_parallel=1``).
VOCAB_EMBEDDINGS = ("embedding", "vocab_embedding")


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of a GPT decoder. ``ffn_mult`` scales the MLP's hidden width."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    ffn_mult: int = 4
    dropout: float = 0.0
    vocab_parallel: int = 0  # 1: Megatron-LM's vocabulary-parallel embedding and loss (planlab.models.vocab_parallel)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def num_params(self, *, tied: bool = False) -> int:
        """Parameter count of the module (weights and biases). ``tied=True`` leaves out the
        output layer, as published counts do for models that tie it to the embedding."""
        h, f = self.hidden, self.ffn_mult * self.hidden
        per_layer = 4 * (h * h + h) + (h * f + f) + (f * h + h) + 4 * h
        out = 0 if tied else h * self.vocab + self.vocab
        return self.vocab * h + self.seq * h + self.layers * per_layer + 2 * h + out


@dataclass(frozen=True)
class LlamaConfig:
    """Sizes of a LLaMA decoder.

    ``kv_heads`` key/value heads (dividing ``heads``; equal to it is plain multi-head
    attention), ``ffn_hidden`` the SwiGLU width, ``rope_theta`` the rotary base and
    ``norm_eps`` the RMSNorm epsilon.
    """

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    seq: int
    vocab: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    vocab_parallel: int = 0  # 1: the vocabulary-parallel embedding and loss (planlab.models.vocab_parallel)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def num_params(self) -> int:
        """Parameter count of the module: embedding, layers, final norm and untied output."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        per_layer = 2 * h * h + 2 * h * kv + 3 * h * self.ffn_hidden + 2 * h
        return 2 * self.vocab * h + self.layers * per_layer + h

    def __str__(self) -> str:
        return (
            f"llama(layers={self.layers}, hidden={self.hidden}, heads={self.heads}, "
            f"kv_heads={self.kv_heads}, ffn_hidden={self.ffn_hidden}, seq={self.seq}, vocab={self.vocab})"
        )


@dataclass(frozen=True)
class T5Config:
    """Sizes of a T5 v1.1 encoder-decoder.

    ``hidden`` is T5's d_model, ``head_dim`` its d_kv (``heads * head_dim`` need not equal
    ``hidden``), ``ffn_hidden`` its d_ff. ``seq`` is the encoder's input length and
    ``decoder_seq`` the target length; ``rel_buckets`` and ``rel_max_distance`` shape the relative
    position buckets; ``dropout`` is T5's dropout_rate (0 in v1.1 pre-training). ``gated_ffn``:
    v1.1's gated-GELU feed-forward (True), or the original T5's two-matrix one with a GELU between
    (False, ``--model-arg gated_ffn=0``; nnScaler's T5 has it). ``vocab_parallel=1``: Megatron-LM's
    vocabulary-parallel embedding and loss (:mod:`planlab.models.vocab_parallel`), which tensor
    parallelism and the interlaced pipeline split along the vocabulary, as GPT's.
    """

    encoder_layers: int
    decoder_layers: int
    hidden: int
    heads: int
    head_dim: int
    ffn_hidden: int
    seq: int
    decoder_seq: int
    vocab: int
    rel_buckets: int = 32
    rel_max_distance: int = 128
    dropout: float = 0.0
    norm_eps: float = 1e-6
    gated_ffn: bool = True
    vocab_parallel: int = 0

    @property
    def layers(self) -> int:
        """Transformer layers in all, the encoder's and the decoder's (what pipeline stages split)."""
        return self.encoder_layers + self.decoder_layers

    @property
    def inner(self) -> int:
        """Width of the attention projections: ``heads * head_dim``."""
        return self.heads * self.head_dim

    def num_params(self) -> int:
        """Parameter count of the module: shared embedding, both stacks with their relative
        position tables and final norms, and the untied output layer."""
        h, a, f = self.hidden, self.inner, self.ffn_hidden
        attn = 4 * h * a  # q, k, v, o
        ffn = (3 if self.gated_ffn else 2) * h * f  # wi_0, wi_1, wo (gated) or wi, wo
        encoder = self.encoder_layers * (attn + ffn + 2 * h)
        decoder = self.decoder_layers * (2 * attn + ffn + 3 * h)
        tables = 2 * self.rel_buckets * self.heads
        return 2 * self.vocab * h + encoder + decoder + tables + 2 * h

    def __str__(self) -> str:
        return (
            f"t5(encoder_layers={self.encoder_layers}, decoder_layers={self.decoder_layers}, "
            f"hidden={self.hidden}, heads={self.heads}, head_dim={self.head_dim}, "
            f"ffn_hidden={self.ffn_hidden}, seq={self.seq}, decoder_seq={self.decoder_seq}, vocab={self.vocab})"
        )


@dataclass(frozen=True)
class EvoformerConfig:
    """Sizes of an Evoformer stack (defaults: AlphaFold2's, supplement table and Algorithms 6-15).

    ``blocks`` Evoformer blocks; MSA representation ``c_m`` channels over ``n_seq`` sequences and
    ``n_res`` residues; pair representation ``c_z`` channels; ``heads_msa`` heads of
    ``c_att_msa`` channels in the MSA attentions, ``heads_pair`` heads of ``c_att_pair`` in the
    triangle attentions; ``c_opm`` channels of the outer product mean; ``c_tri_mul`` of the
    triangle multiplications; transitions widen by ``transition_n``. Input features: ``msa_feat``
    (49 in AlphaFold2), ``target_feat`` (22), ``relpos_bins`` one-hot relative positions (65 =
    offsets clipped to +-32); ``dist_bins`` distogram bins (64).
    """

    blocks: int
    c_m: int
    c_z: int
    heads_msa: int
    heads_pair: int
    n_seq: int
    n_res: int
    c_att_msa: int = 32
    c_att_pair: int = 32
    c_opm: int = 32
    c_tri_mul: int = 128
    transition_n: int = 4
    msa_feat: int = 49
    target_feat: int = 22
    relpos_bins: int = 65
    dist_bins: int = 64
    recycles: int = 1

    @property
    def layers(self) -> int:
        """The Evoformer blocks (what pipeline parallelism stages)."""
        return self.blocks

    @property
    def heads(self) -> int:
        """The head count that tensor parallelism must divide: a degree divides both the MSA
        and the pair attention's heads exactly when it divides their greatest common divisor."""
        return math.gcd(self.heads_msa, self.heads_pair)

    def block_params(self) -> int:
        """Parameters of one Evoformer block (Algorithms 7-15)."""
        cm, cz, n = self.c_m, self.c_z, self.transition_n

        def lin(i: int, o: int, bias: bool = True) -> int:
            return i * o + (o if bias else 0)

        def mha(c_in: int, c: int, h: int) -> int:  # q, k, v without bias; gate and output with
            return 3 * lin(c_in, h * c, False) + lin(c_in, h * c) + lin(h * c, c_in)

        row = 2 * cm + 2 * cz + lin(cz, self.heads_msa, False) + mha(cm, self.c_att_msa, self.heads_msa)
        col = 2 * cm + mha(cm, self.c_att_msa, self.heads_msa)
        opm = 2 * cm + 2 * lin(cm, self.c_opm) + lin(self.c_opm**2, cz)
        tri_mul = 2 * cz + 4 * lin(cz, self.c_tri_mul) + lin(cz, cz) + 2 * self.c_tri_mul + lin(self.c_tri_mul, cz)
        tri_att = 2 * cz + lin(cz, self.heads_pair, False) + mha(cz, self.c_att_pair, self.heads_pair)

        def transition(c: int) -> int:
            return 2 * c + lin(c, n * c) + lin(n * c, c)

        return row + col + transition(cm) + opm + 2 * tri_mul + 2 * tri_att + transition(cz)

    def num_params(self) -> int:
        """Parameter count of the module: embedders, blocks and the distogram head."""
        cm, cz = self.c_m, self.c_z
        embed = (
            2 * (self.target_feat * cz + cz)
            + (self.target_feat * cm + cm)
            + (self.msa_feat * cm + cm)
            + (self.relpos_bins * cz + cz)
        )
        recycle = 2 * cm + 2 * cz
        head = cz * self.dist_bins + self.dist_bins
        return embed + recycle + self.blocks * self.block_params() + head

    def __str__(self) -> str:
        r = f", recycles={self.recycles}" if self.recycles != 1 else ""
        return (
            f"evoformer(blocks={self.blocks}, c_m={self.c_m}, c_z={self.c_z}, heads_msa={self.heads_msa}, "
            f"heads_pair={self.heads_pair}, n_seq={self.n_seq}, n_res={self.n_res}{r})"
        )


def expert_capacity(capacity_factor: float, seq: int, top_k: int, experts: int) -> int:
    """Tokens one expert takes per sequence: ``ceil(capacity_factor * seq * top_k / experts)``,
    at most ``seq`` (a token picks an expert once, so ``seq`` drops nothing)."""
    return min(seq, math.ceil(capacity_factor * seq * top_k / experts))


@dataclass(frozen=True)
class MoEConfig:
    """Sizes of a mixture-of-experts decoder.

    ``experts`` SwiGLU experts of width ``ffn_hidden`` per layer, ``top_k`` of them per token;
    ``capacity_factor`` sets the tokens an expert takes per sequence (see :attr:`capacity`);
    ``aux_loss_coef`` weighs the load-balancing loss (0 leaves it out). The attention is
    LLaMA's: ``kv_heads`` key/value heads, rotary base ``rope_theta``, RMSNorm ``norm_eps``.
    """

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    experts: int
    top_k: int
    seq: int
    vocab: int
    capacity_factor: float = 1.25
    aux_loss_coef: float = 0.02
    rope_theta: float = 1_000_000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def capacity(self) -> int:
        """Tokens one expert takes per sequence (see :func:`expert_capacity`)."""
        return expert_capacity(self.capacity_factor, self.seq, self.top_k, self.experts)

    def num_params(self) -> int:
        """Parameter count of the module: embedding, layers (attention, router, experts, norms),
        final norm and untied output."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        attention = 2 * h * h + 2 * h * kv
        moe = h * self.experts + self.experts * 3 * h * self.ffn_hidden
        return 2 * self.vocab * h + self.layers * (attention + moe + 2 * h) + h

    def active_params(self) -> int:
        """Parameters one token uses: all but the ``experts - top_k`` experts it skips per layer."""
        return self.num_params() - self.layers * (self.experts - self.top_k) * 3 * self.hidden * self.ffn_hidden

    def __str__(self) -> str:
        return (
            f"moe(layers={self.layers}, hidden={self.hidden}, heads={self.heads}, kv_heads={self.kv_heads}, "
            f"ffn_hidden={self.ffn_hidden}, experts={self.experts}, top_k={self.top_k}, seq={self.seq}, "
            f"vocab={self.vocab})"
        )


@dataclass(frozen=True)
class DeepSeekConfig:
    """Sizes of a DeepSeek-V3-style decoder (names as in the module docstring; ``ffn_hidden`` is
    the dense layers' SwiGLU width, ``moe_ffn_hidden`` one expert's; ``route_groups`` and
    ``route_group_topk``: each token's experts come from the best ``route_group_topk`` of
    ``route_groups`` equal groups, 1 and 1 for no limit; ``mtp_layers`` multi-token-prediction
    modules, each predicting one token further, their losses weighted ``mtp_loss_coef`` / ``mtp_layers``:
    DeepSeek-V3 report section 2.2, Megatron-Core's ``mtp_num_layers`` and ``mtp_loss_scaling_factor``;
    ``mtp_shared_embedding=1``: the modules look their tokens up in the main model's embedding table,
    one parameter with one gradient, as DeepSeek-V3 shares it physically (report section 3.2.3),
    instead of each keeping its own copy as Megatron-Core does on the modules' stage)."""

    layers: int
    dense_layers: int
    hidden: int
    heads: int
    ffn_hidden: int
    moe_ffn_hidden: int
    experts: int
    shared_experts: int
    top_k: int
    q_lora_rank: int
    kv_lora_rank: int
    rope_head_dim: int
    nope_head_dim: int
    v_head_dim: int
    seq: int
    vocab: int
    capacity_factor: float = 1.0
    aux_loss_coef: float = 0.0001
    routed_scale: float = 2.5
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    route_groups: int = 1
    route_group_topk: int = 1
    mtp_layers: int = 0
    mtp_loss_coef: float = 0.1
    mtp_shared_embedding: int = 0
    vocab_parallel: int = 0  # 1: Megatron-Core's vocabulary-parallel embedding and loss (planlab.models.vocab_parallel)

    @property
    def capacity(self) -> int:
        """Tokens one routed expert takes per sequence (see :func:`planlab.models.moe.expert_capacity`)."""
        return expert_capacity(self.capacity_factor, self.seq, self.top_k, self.experts)

    def attention_params(self) -> int:
        """Parameters of one MLA layer (projections and the two latent norms)."""
        h, n, qk = self.hidden, self.heads, self.nope_head_dim + self.rope_head_dim
        q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * n * qk
        kv = h * (self.kv_lora_rank + self.rope_head_dim) + self.kv_lora_rank
        kv += self.kv_lora_rank * n * (self.nope_head_dim + self.v_head_dim)
        return q + kv + n * self.v_head_dim * h

    def num_params(self) -> int:
        """Parameter count of the module: embedding, layers, final norm and untied output, and per
        multi-token-prediction module its embedding table (the copy Megatron-Core keeps on the
        module's stage; none with ``mtp_shared_embedding``), its three norms, its projection of the
        two halves and a MoE layer."""
        h = self.hidden
        dense = 3 * h * self.ffn_hidden
        moe = h * self.experts + (self.experts + self.shared_experts) * 3 * h * self.moe_ffn_hidden
        layer = self.attention_params() + 2 * h
        moe_layers = self.layers - self.dense_layers
        mtp = (0 if self.mtp_shared_embedding else self.vocab * h) + 3 * h + 2 * h * h + layer + moe
        return (
            2 * self.vocab * h
            + self.layers * layer
            + self.dense_layers * dense
            + moe_layers * moe
            + h
            + self.mtp_layers * mtp
        )

    def active_params(self) -> int:
        """Parameters one token uses: all but the ``experts - top_k`` routed experts it skips per MoE layer."""
        skipped = (self.experts - self.top_k) * 3 * self.hidden * self.moe_ffn_hidden
        return self.num_params() - (self.layers - self.dense_layers + self.mtp_layers) * skipped

    def __str__(self) -> str:
        return (
            f"deepseek(layers={self.layers}, dense_layers={self.dense_layers}, hidden={self.hidden}, "
            f"heads={self.heads}, experts={self.experts}+{self.shared_experts} shared, top_k={self.top_k}, "
            f"moe_ffn_hidden={self.moe_ffn_hidden}, seq={self.seq}, vocab={self.vocab})"
        )


def int_tuple(name: str, value) -> tuple[int, ...]:
    """``2,2,6,2`` (as ``--model-arg depths=2,2,6,2`` gives it), an int or a sequence -> ints."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} is not a list of integers like 2,2,6,2")
    if isinstance(value, int):
        return (value,)
    if isinstance(value, str):
        parts = [p.strip() for p in value.replace("(", "").replace(")", "").split(",") if p.strip()]
        try:
            return tuple(int(p) for p in parts)
        except ValueError:
            raise ConfigError(f"{name}={value!r} is not a list of integers like 2,2,6,2") from None
    if isinstance(value, (tuple, list)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value)
    raise ConfigError(f"{name}={value!r} is not a list of integers like 2,2,6,2")


@dataclass(frozen=True)
class SwinConfig:
    """Sizes of a Swin Transformer for image classification.

    ``embed`` channels after the patch embedding (doubled by each patch merging), ``depths``
    blocks per stage, ``num_heads`` attention heads per stage, ``image`` the square input's side
    in pixels, ``patch`` the patch side, ``window`` the attention window's side in tokens,
    ``classes`` the classifier's outputs, ``channels`` the input's colour channels,
    ``mlp_ratio`` the MLP's width over the block's. ``depths`` and ``num_heads`` also accept a
    string ``"2,2,6,2"`` (the ``--model-arg`` form).
    """

    embed: int
    depths: tuple[int, ...]
    num_heads: tuple[int, ...]
    image: int = 224
    patch: int = 4
    window: int = 7
    classes: int = 1000
    channels: int = 3
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        object.__setattr__(self, "depths", int_tuple("depths", self.depths))
        object.__setattr__(self, "num_heads", int_tuple("num_heads", self.num_heads))

    @property
    def stages(self) -> int:
        return len(self.depths)

    @property
    def layers(self) -> int:
        """Swin blocks over all stages (what pipeline stages divide)."""
        return sum(self.depths)

    @property
    def heads(self) -> int:
        """The number of groups every stage's heads split into evenly: the gcd of the stages'
        heads (3 for Swin-T's 3, 6, 12, 24). Tensor parallelism must divide it."""
        return math.gcd(*self.num_heads)

    def dim(self, stage: int) -> int:
        """Channels of ``stage``'s blocks."""
        return self.embed * 2**stage

    def resolution(self, stage: int) -> int:
        """Side of ``stage``'s token map."""
        return self.image // self.patch // 2**stage

    def window_at(self, stage: int) -> int:
        """The window side in ``stage``: the configured one, or the whole map if that is smaller."""
        return min(self.window, self.resolution(stage))

    def num_params(self) -> int:
        """Parameter count of the module: patch embedding, blocks, patch merging, norm and head."""
        c, r = self.embed, self.mlp_ratio
        n = self.channels * self.patch**2 * c + c + 2 * c  # conv weight and bias, LayerNorm
        for s, (depth, heads) in enumerate(zip(self.depths, self.num_heads)):
            d, w = self.dim(s), self.window_at(s)
            attn = 4 * (d * d + d) + (2 * w - 1) ** 2 * heads  # q, k, v, proj; relative position bias
            n += depth * (attn + 2 * r * d * d + r * d + d + 4 * d)  # + MLP, two LayerNorms
            if s < self.stages - 1:
                n += 8 * d + 8 * d * d  # patch merging: LayerNorm(4d), Linear(4d, 2d) without bias
        d = self.dim(self.stages - 1)
        return n + 2 * d + d * self.classes + self.classes

    def __str__(self) -> str:
        return (
            f"swin(embed={self.embed}, depths={','.join(map(str, self.depths))}, "
            f"num_heads={','.join(map(str, self.num_heads))}, image={self.image}, patch={self.patch}, "
            f"window={self.window}, classes={self.classes})"
        )


def check_swin(cfg: SwinConfig) -> None:
    """ConfigError, naming the value, unless every stage's sizes divide as Swin needs."""
    for name in ("embed", "image", "patch", "window", "classes", "channels", "mlp_ratio"):
        v = getattr(cfg, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"{name}={v!r} must be a positive integer")
    if not cfg.depths or any(d < 1 for d in cfg.depths):
        raise ConfigError(f"depths={','.join(map(str, cfg.depths))} must be one or more positive block counts")
    if len(cfg.num_heads) != cfg.stages or any(h < 1 for h in cfg.num_heads):
        raise ConfigError(
            f"num_heads={','.join(map(str, cfg.num_heads))} must give positive heads for each of "
            f"the {cfg.stages} stages of depths={','.join(map(str, cfg.depths))}"
        )
    if cfg.image % cfg.patch:
        raise ConfigError(f"image={cfg.image} is not divisible by patch={cfg.patch}")
    grid, merges = cfg.image // cfg.patch, 2 ** (cfg.stages - 1)
    if grid % merges:
        raise ConfigError(
            f"the {grid}x{grid} patch grid (image={cfg.image}, patch={cfg.patch}) does not halve "
            f"{cfg.stages - 1} times for {cfg.stages} stages"
        )
    for s, heads in enumerate(cfg.num_heads):
        if cfg.dim(s) % heads:
            raise ConfigError(
                f"stage {s}'s {cfg.dim(s)} channels (embed={cfg.embed} x {2**s}) are not "
                f"divisible by its num_heads={heads}"
            )
        if cfg.resolution(s) % cfg.window_at(s):
            raise ConfigError(
                f"stage {s}'s {cfg.resolution(s)}x{cfg.resolution(s)} token map is not divisible "
                f"into windows of window={cfg.window}"
            )


@dataclass(frozen=True)
class UserModelConfig:
    """What search spaces may know of a user's model, read off the module.

    ``layers`` is the length of a ``blocks`` ModuleList (1 without one), ``heads`` and
    ``kv_heads`` the first integer attribute named like a head count on any submodule
    (``heads``, ``n_heads``, ``num_heads``, ...; 1 and None without one).
    """

    name: str
    layers: int
    heads: int
    kv_heads: int | None
    params: int

    def num_params(self) -> int:
        return self.params

    def __str__(self) -> str:
        return f"{self.name}(layers={self.layers}, heads={self.heads})"
