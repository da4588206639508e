"""Synthetic next-token batches shared by the language-model families."""

from __future__ import annotations

import torch


def token_batch(
    vocab: int, seq: int, batch: int, device: str | torch.device = "meta", seed: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token targets of shape (batch, seq); on ``meta`` no data is made."""
    if str(device) == "meta":
        z = torch.empty(batch, seq, dtype=torch.long, device="meta")
        return z, z.clone()
    g = torch.Generator().manual_seed(0 if seed is None else seed)
    toks = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return toks[:, :-1].contiguous().to(device), toks[:, 1:].contiguous().to(device)
