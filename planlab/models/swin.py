"""Swin Transformer (Liu et al. 2021) as real torch modules, written so torch.fx traces it whole.

The architecture of the paper's reference code (microsoft/Swin-Transformer): a 4x4 patch
embedding (a Conv2d with stride 4, then LayerNorm), stages of pre-norm blocks with window
multi-head self-attention and a relative position bias (a ``(2w-1)^2 x heads`` table indexed by a
constant index buffer), every second block shifting its windows by half a window (``torch.roll``
and an additive mask buffer, so tokens only attend within their original region), an MLP with
ratio 4, patch merging between stages (2x2 neighbours concatenated, LayerNorm, a linear layer
halving the channels), and a final LayerNorm, average pooling over tokens and a classifier head.

Differences from the reference code that keep the parameters and the function the same:
queries, keys and values are three ``nn.Linear`` modules instead of one fused ``qkv`` (so tensor
parallelism splits heads without permuting a weight), patch merging gathers the 2x2 neighbours
with a view and a permute (the order of the reference's four strided slices), the blocks of
all stages sit in one ``blocks`` list (patch merging in ``merges``) so pipeline stages and
recomputation find them by index, and stochastic depth and dropout are left out (both are
the identity at their rate 0). When a window covers a whole feature map (Swin-T's last stage
at 224x224: 7x7 tokens, window 7), the window partition is the identity and is skipped, and
the block does not shift, as the reference code does.

Sizes are config constants: no Python control flow depends on tensor sizes.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from planlab.models.configs import SwinConfig, check_swin  # noqa: F401 (re-exported)


# ---- windows -------------------------------------------------------------------------


def window_partition(x: torch.Tensor, window: int, res: int, dim: int) -> torch.Tensor:
    """(B, H, W, C) -> (B * nW, w * w, C), windows in row-major order, tokens row-major inside."""
    n = res // window
    if n == 1:
        return x.view(-1, window * window, dim)
    x = x.view(-1, n, window, n, window, dim)  # (B, nH, w, nW, w, C)
    x = x.permute(0, 1, 3, 2, 4, 5).contiguous()  # (B, nH, nW, w, w, C)
    return x.view(-1, window * window, dim)  # (B * nH * nW, w * w, C)


def window_reverse(windows: torch.Tensor, window: int, res: int, dim: int) -> torch.Tensor:
    """(B * nW, w * w, C) -> (B, H, W, C), the inverse of :func:`window_partition`."""
    n = res // window
    if n == 1:
        return windows.view(-1, res, res, dim)
    x = windows.view(-1, n, n, window, window, dim)  # (B, nH, nW, w, w, C)
    x = x.permute(0, 1, 3, 2, 4, 5).contiguous()  # (B, nH, w, nW, w, C)
    return x.view(-1, res, res, dim)  # (B, H, W, C)


def relative_position_index(window: int) -> torch.Tensor:
    """(w*w * w*w,) index into the (2w-1)^2 bias table for each (query, key) pair of a window."""
    ax = torch.arange(window)
    coords = torch.stack(torch.meshgrid(ax, ax, indexing="ij")).flatten(1)  # (2, N)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0)  # (N, N, 2), each in [-w+1, w-1]
    return ((rel[..., 0] + window - 1) * (2 * window - 1) + rel[..., 1] + window - 1).flatten()  # (N * N,)


def shift_mask(res: int, window: int, shift: int) -> torch.Tensor:
    """(nW, N, N) additive mask of a shifted block: 0 between tokens of the same region of the
    unshifted map, -100 between tokens the cyclic shift brought together."""
    regions = torch.zeros(1, res, res, 1)
    cuts = (slice(0, -window), slice(-window, -shift), slice(-shift, None))
    for i, (h, w) in enumerate((h, w) for h in cuts for w in cuts):
        regions[:, h, w, :] = i
    ids = window_partition(regions, window, res, 1).squeeze(-1)  # (nW, N)
    diff = ids[:, None, :] - ids[:, :, None]  # (nW, N, N)
    return torch.zeros_like(diff).masked_fill(diff != 0, -100.0)


# ---- modules -------------------------------------------------------------------------


class PatchEmbed(nn.Module):
    """Non-overlapping patches to tokens: Conv2d(kernel = stride = patch), then LayerNorm."""

    def __init__(self, cfg: SwinConfig) -> None:
        super().__init__()
        self.proj = nn.Conv2d(cfg.channels, cfg.embed, kernel_size=cfg.patch, stride=cfg.patch)
        self.norm = nn.LayerNorm(cfg.embed)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.proj(images)  # (B, C, H/p, W/p)
        return self.norm(x.flatten(2).transpose(1, 2))  # (B, L, C)


class WindowAttention(nn.Module):
    """Multi-head self-attention inside windows of ``window x window`` tokens, with a learned
    relative position bias per head and an optional additive mask per window."""

    def __init__(self, dim: int, heads: int, window: int, windows: int = 1) -> None:
        super().__init__()
        self.heads, self.head_dim, self.window, self.windows = heads, dim // heads, window, windows
        self.tokens = window * window
        self.scale = self.head_dim**-0.5
        self.q, self.k, self.v, self.proj = (nn.Linear(dim, dim) for _ in range(4))
        self.relative_position_bias_table = nn.Parameter(torch.empty((2 * window - 1) ** 2, heads))
        nn.init.trunc_normal_(self.relative_position_bias_table, std=0.02)
        self.register_buffer("relative_position_index", relative_position_index(window), persistent=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        # x: (B_, N, C) with B_ = B * windows; mask: (nW, 1, N, N), shaped in advance: torch.fx
        # would run a buffer's own reshapes once while tracing and keep the result as a constant
        n, h = self.tokens, self.heads
        q = self.q(x).unflatten(-1, (h, self.head_dim)).transpose(1, 2) * self.scale  # (B_, h, N, d)
        k = self.k(x).unflatten(-1, (h, self.head_dim)).transpose(1, 2)  # (B_, h, N, d)
        v = self.v(x).unflatten(-1, (h, self.head_dim)).transpose(1, 2)  # (B_, h, N, d)
        attn = q @ k.transpose(-2, -1)  # (B_, h, N, N)
        bias = self.relative_position_bias_table[self.relative_position_index]  # (N * N, h)
        attn = attn + bias.view(n, n, h).permute(2, 0, 1).unsqueeze(0)  # + (1, h, N, N)
        if mask is not None:  # windows of one image share their masks
            attn = attn.view(-1, self.windows, h, n, n) + mask  # (B, nW, h, N, N) + (nW, 1, N, N)
            attn = attn.view(-1, h, n, n)  # (B_, h, N, N)
        attn = attn.softmax(dim=-1)
        y = (attn @ v).transpose(1, 2).flatten(2)  # (B_, N, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, dim: int, ratio: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, ratio * dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(ratio * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))  # (B, L, C) -> (B, L, rC) -> (B, L, C)


class SwinBlock(nn.Module):
    """Pre-norm block: (shifted) window attention, then MLP, each with a residual."""

    def __init__(self, cfg: SwinConfig, stage: int, shifted: bool) -> None:
        super().__init__()
        self.dim, self.res, self.window = cfg.dim(stage), cfg.resolution(stage), cfg.window_at(stage)
        self.shift = self.window // 2 if shifted and self.res > self.window else 0
        self.norm1 = nn.LayerNorm(self.dim)
        self.attn = WindowAttention(self.dim, cfg.num_heads[stage], self.window, (self.res // self.window) ** 2)
        self.norm2 = nn.LayerNorm(self.dim)
        self.mlp = MLP(self.dim, cfg.mlp_ratio)
        if self.shift:
            mask = shift_mask(self.res, self.window, self.shift).unsqueeze(1)  # (nW, 1, N, N)
            self.register_buffer("attn_mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, L, C) with L = H * W
        res, w, c, s = self.res, self.window, self.dim, self.shift
        h = self.norm1(x).view(-1, res, res, c)  # (B, H, W, C)
        if s:
            h = torch.roll(h, shifts=(-s, -s), dims=(1, 2))
        h = window_partition(h, w, res, c)  # (B * nW, N, C)
        h = self.attn(h, self.attn_mask if s else None)  # (B * nW, N, C)
        h = window_reverse(h, w, res, c)  # (B, H, W, C)
        if s:
            h = torch.roll(h, shifts=(s, s), dims=(1, 2))
        x = x + h.view(-1, res * res, c)  # (B, L, C)
        return x + self.mlp(self.norm2(x))


class PatchMerging(nn.Module):
    """2x2 neighbouring tokens concatenated (4C), LayerNorm, a linear layer to 2C: half the side."""

    def __init__(self, dim: int, res: int) -> None:
        super().__init__()
        self.dim, self.res = dim, res
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, H * W, C); the reference's x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2],
        # x[:, 1::2, 1::2] concatenated = neighbours ordered (column offset, row offset)
        half, c = self.res // 2, self.dim
        x = x.view(-1, half, 2, half, 2, c)  # (B, H/2, dy, W/2, dx, C)
        x = x.permute(0, 1, 3, 4, 2, 5).reshape(-1, half * half, 4 * c)  # (B, H/2 * W/2, 4C)
        return self.reduction(self.norm(x))  # (B, L/4, 2C)


class Swin(nn.Module):
    """Swin Transformer classifier whose forward returns the mean cross-entropy of the labels."""

    def __init__(self, cfg: SwinConfig) -> None:
        super().__init__()
        check_swin(cfg)
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(
            SwinBlock(cfg, s, shifted=j % 2 == 1) for s, depth in enumerate(cfg.depths) for j in range(depth)
        )
        self.merges = nn.ModuleList(PatchMerging(cfg.dim(s), cfg.resolution(s)) for s in range(cfg.stages - 1))
        ends = [sum(cfg.depths[: s + 1]) - 1 for s in range(cfg.stages - 1)]
        self._merge_after = {block: s for s, block in enumerate(ends)}  # last block of a stage -> merge
        d = cfg.dim(cfg.stages - 1)
        self.norm = nn.LayerNorm(d)
        self.avgpool = nn.AdaptiveAvgPool1d(1)
        self.head = nn.Linear(d, cfg.classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # images: (B, 3, H, W); labels: (B,) class ids
        x = self.patch_embed(images)  # (B, L, C)
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i in self._merge_after:
                x = self.merges[self._merge_after[i]](x)  # (B, L/4, 2C)
        x = self.norm(x)  # (B, L, C)
        x = torch.flatten(self.avgpool(x.transpose(1, 2)), 1)  # (B, C, L) -> (B, C, 1) -> (B, C)
        return F.cross_entropy(self.head(x), labels)

    @staticmethod
    def example_inputs(
        cfg: SwinConfig, batch: int, device: str | torch.device = "meta", seed: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Images (batch, channels, image, image) from a standard normal and uniform labels (batch,)."""
        shape = (batch, cfg.channels, cfg.image, cfg.image)
        if str(device) == "meta":
            return torch.empty(shape, device="meta"), torch.empty(batch, dtype=torch.long, device="meta")
        g = torch.Generator().manual_seed(0 if seed is None else seed)
        images = torch.randn(shape, generator=g)
        labels = torch.randint(0, cfg.classes, (batch,), generator=g)
        return images.to(device), labels.to(device)
