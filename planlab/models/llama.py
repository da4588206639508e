"""A LLaMA decoder family as real torch modules, written so torch.fx traces it whole.

The architecture of Meta's LLaMA 2 and 3 (Touvron et al. 2023; Llama Team 2024): RMSNorm
before attention and MLP, rotary position embeddings on queries and keys, grouped-query
attention (``kv_heads`` key/value heads shared by groups of query heads), a SwiGLU MLP and an
untied output layer, no biases. Module names follow Meta's reference code (``attention.wq``,
``feed_forward.w1``, ...) with the layers in ``blocks`` so pipeline staging finds them.

Tracing-friendly: the rotary tables are buffers computed once, the rotation is written with
ordinary ops (slices, negation, concatenation, broadcast multiply), and grouped-query attention
reads the ``kv_heads`` key/value heads unrepeated (``scaled_dot_product_attention(...,
enable_gqa=True)``, as flash attention and PyTorch's SDPA compute it: query head ``i`` reads
key/value head ``i // rep``), so the keys and values kept for the backward and passed around a
ring are ``kv_heads`` wide, and splitting key/value heads splits their query heads with them.
No Python control flow depends on tensor sizes.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from planlab.models.configs import LlamaConfig  # noqa: F401 (re-exported)
from planlab.models.tokens import token_batch
from planlab.models.vocab_parallel import vocab_cross_entropy, vocab_embedding


def rotary_tables(cfg: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine of the rotary angles of ``cfg``'s heads, each ``(seq, head_dim)``."""
    return rotary_angles(cfg.head_dim, cfg.rope_theta, cfg.seq)


def rotary_angles(head_dim: int, theta: float, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine of the rotary angles, each ``(seq, head_dim)``.

    Frequency ``i`` of ``head_dim / 2`` is ``theta ** (-2i / head_dim)``; both halves of the
    head dimension use the same frequencies (the "rotate half" layout).
    """
    hd = head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))  # (hd/2,)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)  # (T, hd/2)
    angles = torch.cat((angles, angles), dim=-1)  # (T, hd)
    return angles.cos(), angles.sin()


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary embeddings on queries and keys."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        h, hd = cfg.hidden, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, hd
        self.rep = cfg.heads // cfg.kv_heads  # query heads per key/value head
        self.half = hd // 2
        self.wq = nn.Linear(h, cfg.heads * hd, bias=False)
        self.wk = nn.Linear(h, cfg.kv_heads * hd, bias=False)
        self.wv = nn.Linear(h, cfg.kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.heads * hd, h, bias=False)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of x: (B, n, T, hs) with cos, sin: (T, hs)."""
        x1 = x[..., : self.half]  # (B, n, T, hs/2)
        x2 = x[..., self.half :]  # (B, n, T, hs/2)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin  # (B, n, T, hs)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: (B, T, C) -> q: (B, nh, T, hs); k, v: (B, nkv, T, hs)
        q = self.wq(x).unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)
        k = self.wk(x).unflatten(-1, (self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.wv(x).unflatten(-1, (self.kv_heads, self.head_dim)).transpose(1, 2)
        q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        if self.rep > 1:  # a config constant: grouped heads, each key/value head read by rep query heads
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (B, nh, T, hs)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        return self.wo(y.transpose(1, 2).flatten(-2))  # (B, T, C)


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, hidden: int, ffn_hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn_hidden, bias=False)
        self.w3 = nn.Linear(hidden, ffn_hidden, bias=False)
        self.w2 = nn.Linear(ffn_hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, T, C) -> (B, T, F) -> (B, T, C)
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm LLaMA layer."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.hidden, cfg.ffn_hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


def add_decoder_modules(model: nn.Module, cfg, block: Callable[[Any], nn.Module]) -> None:
    """Give ``model`` a LLaMA-style decoder's modules (``cfg`` as :class:`LlamaConfig`'s fields):
    token embeddings, the rotary tables as buffers, ``cfg.layers`` blocks made by ``block(cfg)``,
    the final RMSNorm and the output layer (LLaMA's and the mixture-of-experts decoder's)."""
    model.cfg = cfg
    model.tok_embeddings = nn.Embedding(cfg.vocab, cfg.hidden)
    cos, sin = rotary_tables(cfg)
    model.register_buffer("rope_cos", cos, persistent=False)  # (T, hs)
    model.register_buffer("rope_sin", sin, persistent=False)  # (T, hs)
    model.blocks = nn.ModuleList(block(cfg) for _ in range(cfg.layers))
    model.norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
    model.output = nn.Linear(cfg.hidden, cfg.vocab, bias=False)


class Llama(nn.Module):
    """LLaMA decoder whose forward returns the mean next-token cross-entropy."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        add_decoder_modules(self, cfg, Block)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # idx, targets: (B, T) token ids
        vp = self.cfg.vocab_parallel
        x = vocab_embedding(idx, self.tok_embeddings.weight) if vp else self.tok_embeddings(idx)  # (B, T, C)
        for block in self.blocks:
            x = block(x, self.rope_cos, self.rope_sin)
        logits = self.output(self.norm(x))  # (B, T, V)
        if vp:  # torchtitan's loss_parallel with tensor parallelism, Megatron-LM's vocabulary-parallel loss
            return vocab_cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1)).reshape(())
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))

    @staticmethod
    def example_inputs(
        cfg: LlamaConfig, batch: int, device: str | torch.device = "meta", seed: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and next-token targets of shape (batch, seq)."""
        return token_batch(cfg.vocab, cfg.seq, batch, device, seed)
