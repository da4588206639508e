"""Hugging Face ``transformers`` models as planlab user models, built from a config (no download).

``--model planlab.models.hf:llama`` (or ``gpt2``, ``t5``, ``mixtral``, ``swin``, ``vit``) builds
the unmodified HF model from its config class and wraps it only to return the training loss
(:class:`HFLoss`). ``--model-arg size=full`` picks the published size of the family (the config
class's defaults: Llama-2 7B, GPT-2 124M, t5-small, Mixtral 8x7B, Swin-T, ViT-B/16); the default
``size=tiny`` is a model of a few thousand parameters for tests. Other ``--model-arg`` values
override one size each (``layers=2``, ``hidden=..``, ``heads=..``, ``seq=..``, ...).

Settings for planning and checking a training step, each overridable: dropout and stochastic
depth as the config class sets them (GPT-2's dropouts 0.1, T5's 0.1, Swin's stochastic depth
0.1; ``dropout=P`` sets every one of them to P): their masks come from planlab's counter-based
generator (:mod:`planlab.executor.randomness`), so a run under any plan still matches one
process; no key/value cache, untied output embeddings
(planlab plans one tensor per parameter; see :func:`untie_t5`), and mixture-of-experts layers computed with HF's
``batched_mm`` experts (static shapes; the default loops over the experts a batch hits).

Needs the ``hf`` extra: ``pip install 'planlab[hf]'``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn

from planlab.errors import ConfigError
from planlab.inputs import model_arg

EXAMPLE_BATCH = 2  # samples in the example inputs; planlab rescales them to the global batch


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "the Hugging Face models need the transformers package: install planlab's hf extra "
            "(pip install 'planlab[hf]', or pip install 'torch==2.13.0' 'transformers>=5')"
        ) from None
    return transformers


class HFLoss(nn.Module):
    """An HF model called with ``{input_name: inputs, "labels": labels}``, returning ``.loss``.

    ``heads`` and ``kv_heads`` repeat the config's attention head counts where planlab's search
    spaces look for them (tensor parallelism must divide them).
    """

    def __init__(self, model: nn.Module, input_name: str, heads: int, kv_heads: int | None = None) -> None:
        super().__init__()
        self.model = model
        self.input_name = input_name
        self.heads = heads
        if kv_heads is not None:
            self.kv_heads = kv_heads

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(**{self.input_name: inputs}, labels=labels).loss


def _pick(size: str, tiny: dict[str, Any], full: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    if size not in ("tiny", "full"):
        raise ConfigError(f"size={size!r}: choose 'tiny' or 'full'")
    base = dict(tiny if size == "tiny" else full)
    unknown = [k for k, v in overrides.items() if v is not None and k not in base]
    if unknown:
        raise ConfigError(f"unknown model argument {unknown[0]!r}; choose {', '.join(repr(k) for k in base)}")
    for k, v in overrides.items():
        if v is not None and k != "dropout":
            model_arg(k, v, base[k])  # an integer size >= 1 within planlab's limits (planlab.inputs)
    base.update({k: v for k, v in overrides.items() if v is not None})
    return base


def _dropouts(a: dict[str, Any], *fields: str) -> dict[str, float]:
    """The config's dropout ``fields`` set to ``dropout=P`` when given, else left at the config's defaults."""
    p = a["dropout"]
    if p is None:
        return {}
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
        raise ConfigError(f"dropout={p!r}: expected a probability at least 0 and less than 1")
    return {f: float(p) for f in fields}


def _tokens(vocab: int, batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq))  # (B, S) token ids


def _divides(name: str, n: int, what: str, m: int) -> None:
    if m < 1 or n % m:
        raise ConfigError(f"{name}={m} does not divide {what}={n}")


def _causal_lm(cls_name: str, cfg_name: str, a: dict[str, Any], **extra) -> tuple[nn.Module, tuple]:
    tf = _transformers()
    _divides("heads", a["hidden"], "hidden", a["heads"])
    _divides("kv_heads", a["heads"], "heads", a["kv_heads"])
    cfg = getattr(tf, cfg_name)(
        vocab_size=a["vocab"],
        hidden_size=a["hidden"],
        intermediate_size=a["ffn_hidden"],
        num_hidden_layers=a["layers"],
        num_attention_heads=a["heads"],
        num_key_value_heads=a["kv_heads"],
        max_position_embeddings=a["seq"],
        **_dropouts(a, "attention_dropout"),
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation=a["attn"],
        **extra,
    )
    model = getattr(tf, cls_name)(cfg)
    ids = _tokens(a["vocab"], EXAMPLE_BATCH, a["seq"])
    return HFLoss(model, "input_ids", a["heads"], a["kv_heads"]), (ids, ids.clone())


def llama(
    size: str = "tiny",
    *,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    ffn_hidden: int | None = None,
    seq: int | None = None,
    vocab: int | None = None,
    dropout: float | None = None,
    attn: str | None = None,
):
    """``LlamaForCausalLM`` with its causal-LM loss; ``size=full`` is Llama-2 7B at 4,096 tokens."""
    a = _pick(
        size,
        dict(layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=64, seq=16, vocab=64, dropout=None, attn="sdpa"),
        dict(
            layers=32,
            hidden=4096,
            heads=32,
            kv_heads=32,
            ffn_hidden=11008,
            seq=4096,
            vocab=32000,
            dropout=None,
            attn="sdpa",
        ),
        dict(
            layers=layers,
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads,
            ffn_hidden=ffn_hidden,
            seq=seq,
            vocab=vocab,
            dropout=dropout,
            attn=attn,
        ),
    )
    return _causal_lm("LlamaForCausalLM", "LlamaConfig", a)


def mixtral(
    size: str = "tiny",
    *,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    ffn_hidden: int | None = None,
    seq: int | None = None,
    vocab: int | None = None,
    experts: int | None = None,
    top_k: int | None = None,
    dropout: float | None = None,
    attn: str | None = None,
    experts_impl: str | None = None,
):
    """``MixtralForCausalLM`` (top-k routed SwiGLU experts); ``size=full`` is Mixtral 8x7B at 4,096 tokens."""
    a = _pick(
        size,
        dict(
            layers=2,
            hidden=32,
            heads=4,
            kv_heads=2,
            ffn_hidden=48,
            seq=16,
            vocab=64,
            experts=4,
            top_k=2,
            dropout=None,
            attn="sdpa",
            experts_impl="batched_mm",
        ),
        dict(
            layers=32,
            hidden=4096,
            heads=32,
            kv_heads=8,
            ffn_hidden=14336,
            seq=4096,
            vocab=32000,
            experts=8,
            top_k=2,
            dropout=None,
            attn="sdpa",
            experts_impl="batched_mm",
        ),
        dict(
            layers=layers,
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads,
            ffn_hidden=ffn_hidden,
            seq=seq,
            vocab=vocab,
            experts=experts,
            top_k=top_k,
            dropout=dropout,
            attn=attn,
            experts_impl=experts_impl,
        ),
    )
    if not 1 <= a["top_k"] <= a["experts"]:
        raise ConfigError(f"top_k={a['top_k']} must be between 1 and experts={a['experts']}")
    return _causal_lm(
        "MixtralForCausalLM",
        "MixtralConfig",
        a,
        num_local_experts=a["experts"],
        num_experts_per_tok=a["top_k"],
        experts_implementation=a["experts_impl"],
    )


def gpt2(
    size: str = "tiny",
    *,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    seq: int | None = None,
    vocab: int | None = None,
    dropout: float | None = None,
    attn: str | None = None,
):
    """``GPT2LMHeadModel`` (Conv1D layers, fused q/k/v); ``size=full`` is GPT-2 124M at 1,024 tokens."""
    tf = _transformers()
    a = _pick(
        size,
        dict(layers=2, hidden=32, heads=4, seq=16, vocab=64, dropout=None, attn="sdpa"),
        dict(layers=12, hidden=768, heads=12, seq=1024, vocab=50257, dropout=None, attn="sdpa"),
        dict(layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=vocab, dropout=dropout, attn=attn),
    )
    _divides("heads", a["hidden"], "hidden", a["heads"])
    cfg = tf.GPT2Config(
        vocab_size=a["vocab"],
        n_positions=a["seq"],
        n_embd=a["hidden"],
        n_layer=a["layers"],
        n_head=a["heads"],
        **_dropouts(a, "resid_pdrop", "embd_pdrop", "attn_pdrop"),
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation=a["attn"],
    )
    ids = _tokens(a["vocab"], EXAMPLE_BATCH, a["seq"])
    return HFLoss(tf.GPT2LMHeadModel(cfg), "input_ids", a["heads"]), (ids, ids.clone())


def t5(
    size: str = "tiny",
    *,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    head_dim: int | None = None,
    ffn_hidden: int | None = None,
    seq: int | None = None,
    target_seq: int | None = None,
    vocab: int | None = None,
    dropout: float | None = None,
    attn: str | None = None,
):
    """``T5ForConditionalGeneration`` (encoder-decoder, relative position bias); ``size=full`` is
    t5-small (60M) at 512 input and 128 target tokens."""
    tf = _transformers()
    a = _pick(
        size,
        dict(
            layers=2,
            hidden=32,
            heads=4,
            head_dim=8,
            ffn_hidden=64,
            seq=16,
            target_seq=8,
            vocab=64,
            dropout=None,
            attn="eager",
        ),
        dict(
            layers=6,
            hidden=512,
            heads=8,
            head_dim=64,
            ffn_hidden=2048,
            seq=512,
            target_seq=128,
            vocab=32128,
            dropout=None,
            attn="eager",
        ),
        dict(
            layers=layers,
            hidden=hidden,
            heads=heads,
            head_dim=head_dim,
            ffn_hidden=ffn_hidden,
            seq=seq,
            target_seq=target_seq,
            vocab=vocab,
            dropout=dropout,
            attn=attn,
        ),
    )
    cfg = tf.T5Config(
        vocab_size=a["vocab"],
        d_model=a["hidden"],
        d_kv=a["head_dim"],
        d_ff=a["ffn_hidden"],
        num_layers=a["layers"],
        num_decoder_layers=a["layers"],
        num_heads=a["heads"],
        **_dropouts(a, "dropout_rate"),
        use_cache=False,
        decoder_start_token_id=0,
        attn_implementation=a["attn"],
    )
    model = tf.T5ForConditionalGeneration(cfg)
    untie_t5(model)
    ids = _tokens(a["vocab"], EXAMPLE_BATCH, a["seq"])
    labels = _tokens(a["vocab"], EXAMPLE_BATCH, a["target_seq"])
    return HFLoss(model, "input_ids", a["heads"]), (ids, labels)


def untie_t5(model: nn.Module) -> None:
    """Give T5's decoder embedding and output layer their own copies of the shared embedding
    (transformers 5 always ties the three; planlab plans one tensor per parameter). The encoder
    keeps the shared module itself, so every parameter is used."""
    model.config.tie_word_embeddings = False
    model.encoder.embed_tokens = model.shared
    model.decoder.embed_tokens.weight = nn.Parameter(model.shared.weight.detach().clone())
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())


def _images(channels: int, image: int, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    pixels = torch.randn(EXAMPLE_BATCH, channels, image, image)  # (B, C, H, W)
    return pixels, torch.randint(0, classes, (EXAMPLE_BATCH,))  # (B,) class ids


def vit(
    size: str = "tiny",
    *,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    ffn_hidden: int | None = None,
    image: int | None = None,
    patch: int | None = None,
    classes: int | None = None,
    dropout: float | None = None,
    attn: str | None = None,
):
    """``ViTForImageClassification``; ``size=full`` is ViT-B/16 (86M) on 224x224 images, 1,000 classes."""
    tf = _transformers()
    a = _pick(
        size,
        dict(layers=2, hidden=32, heads=4, ffn_hidden=64, image=16, patch=4, classes=10, dropout=None, attn="sdpa"),
        dict(
            layers=12,
            hidden=768,
            heads=12,
            ffn_hidden=3072,
            image=224,
            patch=16,
            classes=1000,
            dropout=None,
            attn="sdpa",
        ),
        dict(
            layers=layers,
            hidden=hidden,
            heads=heads,
            ffn_hidden=ffn_hidden,
            image=image,
            patch=patch,
            classes=classes,
            dropout=dropout,
            attn=attn,
        ),
    )
    _divides("heads", a["hidden"], "hidden", a["heads"])
    _divides("patch", a["image"], "image", a["patch"])
    cfg = tf.ViTConfig(
        hidden_size=a["hidden"],
        num_hidden_layers=a["layers"],
        num_attention_heads=a["heads"],
        intermediate_size=a["ffn_hidden"],
        image_size=a["image"],
        patch_size=a["patch"],
        num_labels=a["classes"],
        **_dropouts(a, "hidden_dropout_prob", "attention_probs_dropout_prob"),
        attn_implementation=a["attn"],
    )
    return HFLoss(tf.ViTForImageClassification(cfg), "pixel_values", a["heads"]), _images(3, a["image"], a["classes"])


def swin(
    size: str = "tiny",
    *,
    embed: int | None = None,
    depth: int | None = None,
    heads: int | None = None,
    image: int | None = None,
    patch: int | None = None,
    window: int | None = None,
    classes: int | None = None,
    dropout: float | None = None,
):
    """``SwinForImageClassification`` (shifted windows, patch merging); ``size=full`` is Swin-T (28M)
    on 224x224 images. ``depth`` and ``heads`` set every stage (tiny: 2 stages of 2 blocks)."""
    tf = _transformers()
    a = _pick(
        size,
        dict(embed=16, depth=2, heads=2, image=32, patch=4, window=4, classes=10, dropout=None),
        dict(embed=96, depth=0, heads=0, image=224, patch=4, window=7, classes=1000, dropout=None),
        dict(
            embed=embed,
            depth=depth,
            heads=heads,
            image=image,
            patch=patch,
            window=window,
            classes=classes,
            dropout=dropout,
        ),
    )
    if size == "full" and not a["depth"] and not a["heads"]:
        depths, heads_per = [2, 2, 6, 2], [3, 6, 12, 24]  # Swin-T (Liu et al. 2021, table 1)
    else:
        stages = 2 if size == "tiny" else 4
        depths, heads_per = [a["depth"] or 2] * stages, [(a["heads"] or 3) * 2**i for i in range(stages)]
    _divides("patch", a["image"], "image", a["patch"])
    cfg = tf.SwinConfig(
        image_size=a["image"],
        patch_size=a["patch"],
        embed_dim=a["embed"],
        depths=depths,
        num_heads=heads_per,
        window_size=a["window"],
        num_labels=a["classes"],
        **_dropouts(a, "hidden_dropout_prob", "attention_probs_dropout_prob", "drop_path_rate"),
    )
    for i, h in enumerate(heads_per):
        _divides(f"heads of stage {i}", a["embed"] * 2**i, "its width", h)
    model = tf.SwinForImageClassification(cfg)
    return HFLoss(model, "pixel_values", math.gcd(*heads_per)), _images(3, a["image"], a["classes"])


FAMILIES = ("llama", "gpt2", "t5", "mixtral", "swin", "vit")
