"""A GPT decoder family as real torch modules, written so torch.fx traces it whole.

Separate q, k and v projections (so tensor parallelism splits heads without a
weight permutation), a position-id buffer (no size-dependent Python), fused
causal attention, untied embedding and output layers.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from planlab.models.configs import GPTConfig  # noqa: F401 (re-exported)
from planlab.models.tokens import token_batch
from planlab.models.vocab_parallel import vocab_cross_entropy, vocab_embedding


class Attention(nn.Module):
    """Causal multi-head self-attention."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        h = cfg.hidden
        self.q, self.k, self.v, self.proj = (nn.Linear(h, h) for _ in range(4))
        self.drop = nn.Dropout(cfg.dropout)
        self.heads, self.head_dim = cfg.heads, cfg.head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, T, C) -> q, k, v: (B, nh, T, hs)
        shape = (self.heads, self.head_dim)
        q = self.q(x).unflatten(-1, shape).transpose(1, 2)
        k = self.k(x).unflatten(-1, shape).transpose(1, 2)
        v = self.v(x).unflatten(-1, shape).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        return self.drop(self.proj(y.transpose(1, 2).flatten(-2)))  # (B, T, C)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.hidden, cfg.ffn_mult * cfg.hidden)
        self.act = nn.GELU()
        self.proj = nn.Linear(cfg.ffn_mult * cfg.hidden, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    """Pre-norm transformer layer."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT decoder whose forward returns the mean next-token cross-entropy."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.hidden)
        self.wpe = nn.Embedding(cfg.seq, cfg.hidden)
        self.register_buffer("pos", torch.arange(cfg.seq), persistent=False)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # idx, targets: (B, T) token ids
        vp = self.cfg.vocab_parallel
        tokens = vocab_embedding(idx, self.wte.weight) if vp else self.wte(idx)
        x = self.drop(tokens + self.wpe(self.pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        if vp:
            return vocab_cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1)).reshape(())
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))

    @staticmethod
    def example_inputs(
        cfg: GPTConfig, batch: int, device: str | torch.device = "meta", seed: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and next-token targets of shape (batch, seq)."""
        return token_batch(cfg.vocab, cfg.seq, batch, device, seed)
