"""The T5 encoder-decoder (version 1.1) as real torch modules, written so torch.fx traces it whole.

Raffel et al. 2020, "Exploring the Limits of Transfer Learning with a Unified Text-to-Text
Transformer", in the T5 v1.1 variant Google released later (the t5x gin files and the
google/t5-v1_1-* checkpoints): pre-norm layers with an RMS layer norm (scale only, no mean, no
bias), no biases anywhere, a gated-GELU feed-forward ``wo(gelu_tanh(wi_0 x) * wi_1 x)``, attention
scores without the ``1/sqrt(d)`` scale, a relative position bias per head (bucketed relative
distances, bidirectional in the encoder, causal in the decoder) learned in the first layer of each
stack and shared by the stack's other layers, cross-attention over the encoder's output, dropout,
and an output layer untied from the input embedding. The input embedding is shared by encoder and
decoder, as in T5.

Written for planlab:

* The shared embedding is looked up once, on the encoder's and the decoder's token ids joined
  along the sequence, and the result is sliced in two: the same numbers as two lookups, but one
  operator uses the parameter (planlab refuses a weight used by two operators).
* The relative position buckets are computed at build time into constant index buffers; the bias
  is an embedding lookup of such a buffer, added to the scores inside one fused operator
  (:func:`planlab.graph.ops_biased_attention.attention_with_bias`); the decoder's causal mask is a
  buffer added to its bias. No Python control flow depends on tensor sizes.
* All layers are in one list ``blocks``, the encoder's then the decoder's, so pipeline staging
  (which reads ``blocks.N`` from module paths) cuts the model in order; ``layers`` counts both.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from planlab.models.configs import T5Config  # noqa: F401 (re-exported)
from planlab.graph.ops_biased_attention import attention_with_bias
from planlab.models.vocab_parallel import vocab_cross_entropy, vocab_embedding


def relative_position_buckets(
    query_len: int, key_len: int, *, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """T5's bucket of each relative distance ``key - query``: a (query_len, key_len) long tensor.

    Half the buckets (of each direction, when bidirectional) hold exact distances 0, 1, ...;
    the rest grow logarithmically up to ``max_distance``, beyond which all distances share the
    last bucket. Causal (not bidirectional): keys after the query count as distance 0.
    """
    ctx = torch.arange(query_len, dtype=torch.long)[:, None]  # (S, 1)
    mem = torch.arange(key_len, dtype=torch.long)[None, :]  # (1, T)
    rel = mem - ctx  # (S, T)
    buckets = torch.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        buckets += (rel > 0).long() * num_buckets
        rel = rel.abs()
    else:
        rel = -rel.clamp(max=0)
    max_exact = num_buckets // 2
    is_small = rel < max_exact
    large = (
        max_exact
        + (
            torch.log(rel.float().clamp(min=1) / max_exact)
            / math.log(max_distance / max_exact)
            * (num_buckets - max_exact)
        ).long()
    )
    large = large.clamp(max=num_buckets - 1)
    return buckets + torch.where(is_small, rel, large)


class PositionBias(nn.Module):
    """A learned bias per head and relative-distance bucket, looked up for a fixed
    (query, key) grid: ``(1, heads, S, T)``, plus a causal mask in a decoder."""

    def __init__(self, cfg: T5Config, length: int, *, causal: bool) -> None:
        super().__init__()
        self.relative_attention_bias = nn.Embedding(cfg.rel_buckets, cfg.heads)
        buckets = relative_position_buckets(
            length, length, bidirectional=not causal, num_buckets=cfg.rel_buckets, max_distance=cfg.rel_max_distance
        )
        self.register_buffer("buckets", buckets, persistent=False)  # (S, S) long
        self.causal = causal
        if causal:  # 0 on and below the diagonal, the most negative float above (a key in the future)
            mask = torch.full((length, length), torch.finfo(torch.float32).min).triu(1)
            self.register_buffer("mask", mask, persistent=False)  # (S, S)

    def forward(self) -> torch.Tensor:
        bias = self.relative_attention_bias(self.buckets)  # (S, S, nh)
        bias = bias.permute(2, 0, 1).unsqueeze(0)  # (1, nh, S, S)
        return bias + self.mask if self.causal else bias


class Attention(nn.Module):
    """Multi-head attention without score scaling. Self-attention adds the stack's position bias
    (computed here in the stack's first layer); cross-attention (``cross=True``) attends from
    the decoder to the encoder's output without a bias."""

    def __init__(self, cfg: T5Config, *, length: int = 0, causal: bool = False, has_bias: bool = False) -> None:
        super().__init__()
        h, a = cfg.hidden, cfg.inner
        self.heads, self.head_dim, self.dropout = cfg.heads, cfg.head_dim, cfg.dropout
        self.q = nn.Linear(h, a, bias=False)
        self.k = nn.Linear(h, a, bias=False)
        self.v = nn.Linear(h, a, bias=False)
        self.o = nn.Linear(a, h, bias=False)
        self.position_bias = PositionBias(cfg, length, causal=causal) if has_bias else None

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)  # (B, T, nh*hs) -> (B, nh, T, hs)

    def forward(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, memory: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # x: (B, S, C); memory (cross-attention): (B, T, C); bias: (1, nh, S, S)
        kv = x if memory is None else memory
        q, k, v = self._heads(self.q(x)), self._heads(self.k(kv)), self._heads(self.v(kv))  # (B, nh, ., hs)
        p = self.dropout if self.training else 0.0
        if memory is not None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, scale=1.0)  # (B, nh, S, hs)
        else:
            if self.position_bias is not None:
                bias = self.position_bias()  # (1, nh, S, S), reused by the stack's later layers
            y = attention_with_bias(q, k, v, bias, 1.0, p)  # (B, nh, S, hs)
        return self.o(y.transpose(1, 2).flatten(-2)), bias  # (B, S, C)


class FeedForward(nn.Module):
    """T5 v1.1's gated-GELU feed-forward: ``wo(dropout(gelu_tanh(wi_0 x) * wi_1 x))``."""

    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.wi_0 = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False)
        self.wi_1 = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False)
        self.act = nn.GELU(approximate="tanh")
        self.drop = nn.Dropout(cfg.dropout)
        self.wo = nn.Linear(cfg.ffn_hidden, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, S, C) -> (B, S, F) -> (B, S, C)
        return self.wo(self.drop(self.act(self.wi_0(x)) * self.wi_1(x)))


class PlainFeedForward(nn.Module):
    """The original T5's two-matrix feed-forward with a GELU: ``wo(dropout(gelu_tanh(wi x)))``."""

    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.wi = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False)
        self.act = nn.GELU(approximate="tanh")
        self.drop = nn.Dropout(cfg.dropout)
        self.wo = nn.Linear(cfg.ffn_hidden, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, S, C) -> (B, S, F) -> (B, S, C)
        return self.wo(self.drop(self.act(self.wi(x))))


def feed_forward(cfg: T5Config) -> nn.Module:
    """The feed-forward ``cfg.gated_ffn`` names."""
    return FeedForward(cfg) if cfg.gated_ffn else PlainFeedForward(cfg)


class EncoderBlock(nn.Module):
    """Pre-norm encoder layer: bidirectional self-attention, feed-forward."""

    def __init__(self, cfg: T5Config, *, first: bool) -> None:
        super().__init__()
        self.self_attn_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.self_attn = Attention(cfg, length=cfg.seq, has_bias=first)
        self.ff_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.ff = feed_forward(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        y, bias = self.self_attn(self.self_attn_norm(x), bias)
        x = x + self.drop(y)
        return x + self.drop(self.ff(self.ff_norm(x))), bias


class DecoderBlock(nn.Module):
    """Pre-norm decoder layer: causal self-attention, cross-attention, feed-forward."""

    def __init__(self, cfg: T5Config, *, first: bool) -> None:
        super().__init__()
        self.self_attn_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.self_attn = Attention(cfg, length=cfg.decoder_seq, causal=True, has_bias=first)
        self.cross_attn_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.cross_attn = Attention(cfg)
        self.ff_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.ff = feed_forward(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(
        self, x: torch.Tensor, bias: torch.Tensor | None, memory: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        y, bias = self.self_attn(self.self_attn_norm(x), bias)
        x = x + self.drop(y)
        y, _ = self.cross_attn(self.cross_attn_norm(x), memory=memory)
        x = x + self.drop(y)
        return x + self.drop(self.ff(self.ff_norm(x))), bias


class T5(nn.Module):
    """T5 v1.1 whose forward returns the mean cross-entropy of the decoder's predictions."""

    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.shared = nn.Embedding(cfg.vocab, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(
            [EncoderBlock(cfg, first=i == 0) for i in range(cfg.encoder_layers)]
            + [DecoderBlock(cfg, first=i == 0) for i in range(cfg.decoder_layers)]
        )
        self.encoder_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.decoder_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        """T5's initialization: normal with standard deviation 1 for the shared embedding,
        ``hidden**-0.5`` for k, v, wi and the position tables, ``(hidden*head_dim)**-0.5`` for q
        (the folded ``1/sqrt(d)``), ``inner**-0.5`` for o and ``ffn_hidden**-0.5`` for wo (as
        Hugging Face's T5 draws them); norms at 1. The untied output layer gets ``hidden**-0.5``
        (fan-in scaling, as t5x's v1.1 models) rather than Hugging Face's 1, so the first loss is
        about ``log(vocab)``."""
        c = self.cfg
        self.shared.weight.normal_(0.0, 1.0)
        self.lm_head.weight.normal_(0.0, c.hidden**-0.5)
        for m in self.modules():
            if isinstance(m, Attention):
                m.q.weight.normal_(0.0, (c.hidden * c.head_dim) ** -0.5)
                m.k.weight.normal_(0.0, c.hidden**-0.5)
                m.v.weight.normal_(0.0, c.hidden**-0.5)
                m.o.weight.normal_(0.0, c.inner**-0.5)
                if m.position_bias is not None:
                    m.position_bias.relative_attention_bias.weight.normal_(0.0, c.hidden**-0.5)
            elif isinstance(m, (FeedForward, PlainFeedForward)):
                for w in (m.wi_0, m.wi_1) if isinstance(m, FeedForward) else (m.wi,):
                    w.weight.normal_(0.0, c.hidden**-0.5)
                m.wo.weight.normal_(0.0, c.ffn_hidden**-0.5)

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # input_ids: (B, S); decoder_input_ids, labels: (B, T) token ids
        c = self.cfg
        ids = torch.cat((input_ids, decoder_input_ids), dim=1)  # (B, S+T)
        tokens = self.drop(vocab_embedding(ids, self.shared.weight) if c.vocab_parallel else self.shared(ids))
        x, y = tokens[:, : c.seq], tokens[:, c.seq :]  # (B, S, C), (B, T, C)
        bias = None
        for block in self.blocks[: c.encoder_layers]:
            x, bias = block(x, bias)
        memory = self.drop(self.encoder_norm(x))  # (B, S, C)
        bias = None
        for block in self.blocks[c.encoder_layers :]:
            y, bias = block(y, bias, memory)
        logits = self.lm_head(self.drop(self.decoder_norm(y)))  # (B, T, V)
        if c.vocab_parallel:
            return vocab_cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1)).reshape(())
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))

    @staticmethod
    def example_inputs(
        cfg: T5Config, batch: int, device: str | torch.device = "meta", seed: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Encoder token ids (batch, seq), decoder input ids and labels (batch, decoder_seq): the
        decoder reads the labels shifted right behind T5's start token 0 (teacher forcing)."""
        if str(device) == "meta":
            enc = torch.empty(batch, cfg.seq, dtype=torch.long, device="meta")
            dec = torch.empty(batch, cfg.decoder_seq, dtype=torch.long, device="meta")
            return enc, dec, dec.clone()
        g = torch.Generator().manual_seed(0 if seed is None else seed)
        enc = torch.randint(0, cfg.vocab, (batch, cfg.seq), generator=g)
        labels = torch.randint(0, cfg.vocab, (batch, cfg.decoder_seq), generator=g)
        dec = torch.cat((torch.zeros(batch, 1, dtype=torch.long), labels[:, :-1]), dim=1)
        return enc.to(device), dec.to(device), labels.to(device)
