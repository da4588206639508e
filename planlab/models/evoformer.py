"""An AlphaFold2 Evoformer stack as real torch modules, written so torch.fx traces it whole.

The trunk of AlphaFold2 (Jumper et al. 2021, supplementary information: Algorithms 3-4 for the
input embedding, 6-15 for the Evoformer, 32 for recycling): an input embedder from one-hot-like
float features, the recycling embedder, a stack of Evoformer blocks (MSA row-wise gated
self-attention with pair bias, MSA column-wise gated self-attention, MSA transition, outer
product mean, triangle multiplicative updates with outgoing and incoming edges, triangle
self-attention around the starting and ending node, pair transition), and a distogram head
whose cross-entropy, averaged over the unmasked residue pairs of each example and then over the
batch, is the training loss.

Recycling (Algorithm 2, lines 3-8, and Algorithm 32): with ``recycles = R`` (default 1) one forward
runs the trunk R times with the same weights, as AlphaFold2's training does (R = 4 there, a
random number of iterations; nnScaler's "3F1B" experiments use R = 3). Pass r embeds the inputs,
adds the layer-normed first MSA row and pair representation of pass r - 1 (pass 0: the
``prev_msa_first_row`` / ``prev_pair`` inputs), runs the blocks, and hands its outputs on through
``detach``: passes 0..R-2 get no gradient, only the last pass's distogram is the loss. This is the
real recycling loop (R-1 forwards under ``torch.no_grad``, then one with gradients) written so
that torch.fx traces it: ``.detach()`` is a traced operator, ``torch.no_grad`` is not. Each pass
embeds the inputs again, as AlphaFold2 and OpenFold do (there the MSA is resampled per pass), so
each pass is a self-contained stretch of the graph that a pipeline can stage. The repeated calls
keep their module paths (``blocks.3`` in every pass); :func:`planlab.search_spaces.recycling.passes_of`
tells the passes apart by the detaches between them.

Left out, as they are not part of the Evoformer stack: templates, the extra-MSA stack, the
structure module (so Algorithm 32's embedding of the previous iteration's predicted
positions is left out too) and the other heads. Dropout is left out too (AlphaFold2's rates are
0.15 and 0.25 with rows or columns shared), so that distributed runs match one process
exactly. Masks follow the reference code: attention logits get ``1e9 * (mask - 1)``, the
triangle updates and the outer product mean multiply by the mask, and the outer product mean
divides by the number of unmasked sequence pairs plus 1e-3. Weights keep PyTorch's default
initialisation rather than AlphaFold2's zero-initialised output layers, so that every parameter
has a gradient in the first step.

Tracing-friendly: every contraction is an ``einsum`` (whose signature planlab reads from the
equation), head splits are ``unflatten`` (so splitting a projection's output splits heads),
the first-row selector of the recycling embedder is a buffer, and no Python control flow
depends on tensor values. Module names follow OpenFold's (``msa_att_row.mha.linear_q``,
``tri_mul_out.linear_a_p``, ...) except the pair-bias projections (``linear_bias``); the
blocks live in ``blocks`` so pipeline staging finds them.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from planlab.models.configs import EvoformerConfig  # noqa: F401 (re-exported)

INF = 1e9  # the reference code's masking constant


class _Masks(NamedTuple):
    """Mask-derived tensors computed once per forward and shared by every block."""

    msa_row_bias: torch.Tensor  # (B, S, 1, 1, R): row attention over residues
    msa_col_bias: torch.Tensor  # (B, R, 1, 1, S): column attention over sequences
    msa: torch.Tensor  # (B, S, R, 1)
    opm_norm: torch.Tensor  # (B, R, R, 1): unmasked sequence pairs per residue pair
    pair_start_bias: torch.Tensor  # (B, I, 1, 1, J): triangle attention around the starting node
    pair_end_bias: torch.Tensor  # (B, J, 1, 1, I): ... around the ending node (transposed)
    pair: torch.Tensor  # (B, R, R, 1)


def mask_bias(mask: torch.Tensor) -> torch.Tensor:
    """Attention-logit bias of a mask (B, A, K): 0 where kept, -1e9 where masked, as
    (B, A, 1, 1, K) to broadcast over heads and queries."""
    return ((mask - 1.0) * INF)[:, :, None, None, :]


class GatedAttention(nn.Module):
    """Gated multi-head self-attention along axis 2 of (B, A, Q, C), for every A (Algorithms 7, 8,
    13, 14): queries, keys and values without bias, a sigmoid gate and an output projection."""

    def __init__(self, c_in: int, c_hidden: int, heads: int) -> None:
        super().__init__()
        self.heads, self.c_hidden = heads, c_hidden
        self.scale = 1.0 / math.sqrt(c_hidden)
        self.linear_q = nn.Linear(c_in, heads * c_hidden, bias=False)
        self.linear_k = nn.Linear(c_in, heads * c_hidden, bias=False)
        self.linear_v = nn.Linear(c_in, heads * c_hidden, bias=False)
        self.linear_g = nn.Linear(c_in, heads * c_hidden)
        self.linear_o = nn.Linear(heads * c_hidden, c_in)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, pair_bias: torch.Tensor | None = None) -> torch.Tensor:
        hc = (self.heads, self.c_hidden)
        q = self.linear_q(x).unflatten(-1, hc) * self.scale  # (B, A, Q, H, c)
        k = self.linear_k(x).unflatten(-1, hc)  # (B, A, K, H, c)
        v = self.linear_v(x).unflatten(-1, hc)  # (B, A, K, H, c)
        logits = torch.einsum("baqhc,bakhc->bahqk", q, k) + mask  # (B, A, H, Q, K); mask: (B, A, 1, 1, K)
        if pair_bias is not None:  # the call's structure, not a tensor value
            logits = logits + pair_bias  # (B, 1, H, Q, K) broadcast over A
        weights = torch.softmax(logits, dim=-1)  # (B, A, H, Q, K)
        o = torch.einsum("bahqk,bakhc->baqhc", weights, v)  # (B, A, Q, H, c)
        g = torch.sigmoid(self.linear_g(x)).unflatten(-1, hc)  # (B, A, Q, H, c)
        return self.linear_o((g * o).flatten(-2))  # (B, A, Q, C)


class MSARowAttentionWithPairBias(nn.Module):
    """Algorithm 7: attention over residues within each sequence, biased by the pair representation."""

    def __init__(self, cfg: EvoformerConfig) -> None:
        super().__init__()
        self.layer_norm_m = nn.LayerNorm(cfg.c_m)
        self.layer_norm_z = nn.LayerNorm(cfg.c_z)
        self.linear_bias = nn.Linear(cfg.c_z, cfg.heads_msa, bias=False)
        self.mha = GatedAttention(cfg.c_m, cfg.c_att_msa, cfg.heads_msa)

    def forward(self, m: torch.Tensor, z: torch.Tensor, masks: _Masks) -> torch.Tensor:
        # m: (B, S, R, c_m), z: (B, R, R, c_z)
        pair_bias = self.linear_bias(self.layer_norm_z(z)).permute(0, 3, 1, 2).unsqueeze(1)  # (B, 1, H, R, R)
        return self.mha(self.layer_norm_m(m), masks.msa_row_bias, pair_bias)  # (B, S, R, c_m)


class MSAColumnAttention(nn.Module):
    """Algorithm 8: attention over sequences within each residue column."""

    def __init__(self, cfg: EvoformerConfig) -> None:
        super().__init__()
        self.layer_norm_m = nn.LayerNorm(cfg.c_m)
        self.mha = GatedAttention(cfg.c_m, cfg.c_att_msa, cfg.heads_msa)

    def forward(self, m: torch.Tensor, masks: _Masks) -> torch.Tensor:
        x = self.layer_norm_m(m).transpose(1, 2)  # (B, R, S, c_m)
        return self.mha(x, masks.msa_col_bias).transpose(1, 2)  # (B, S, R, c_m)


class Transition(nn.Module):
    """Algorithms 9 and 15: layer norm, a ReLU MLP widening ``n`` times, back to ``c``."""

    def __init__(self, c: int, n: int) -> None:
        super().__init__()
        self.layer_norm = nn.LayerNorm(c)
        self.linear_1 = nn.Linear(c, n * c)
        self.linear_2 = nn.Linear(n * c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (..., c) -> (..., n c) -> (..., c)
        return self.linear_2(F.relu(self.linear_1(self.layer_norm(x))))


class OuterProductMean(nn.Module):
    """Algorithm 10: the MSA's mean outer product over sequences, projected into the pair."""

    def __init__(self, cfg: EvoformerConfig, eps: float = 1e-3) -> None:
        super().__init__()
        self.eps = eps
        self.layer_norm = nn.LayerNorm(cfg.c_m)
        self.linear_1 = nn.Linear(cfg.c_m, cfg.c_opm)
        self.linear_2 = nn.Linear(cfg.c_m, cfg.c_opm)
        self.linear_out = nn.Linear(cfg.c_opm**2, cfg.c_z)

    def forward(self, m: torch.Tensor, masks: _Masks) -> torch.Tensor:
        x = self.layer_norm(m)  # (B, S, R, c_m)
        a = self.linear_1(x) * masks.msa  # (B, S, R, c)
        b = self.linear_2(x) * masks.msa  # (B, S, R, c)
        outer = torch.einsum("bsic,bsjd->bijcd", a, b).flatten(-2)  # (B, R, R, c*c)
        return self.linear_out(outer) / (masks.opm_norm + self.eps)  # (B, R, R, c_z)


class TriangleMultiplication(nn.Module):
    """Algorithms 11 (outgoing edges: ``z_ij <- sum_k a_ik b_jk``) and 12 (incoming edges:
    ``z_ij <- sum_k a_ki b_kj``), gated."""

    def __init__(self, cfg: EvoformerConfig, *, outgoing: bool) -> None:
        super().__init__()
        c = cfg.c_tri_mul
        self.equation = "bikc,bjkc->bijc" if outgoing else "bkic,bkjc->bijc"
        self.layer_norm_in = nn.LayerNorm(cfg.c_z)
        self.linear_a_p = nn.Linear(cfg.c_z, c)
        self.linear_a_g = nn.Linear(cfg.c_z, c)
        self.linear_b_p = nn.Linear(cfg.c_z, c)
        self.linear_b_g = nn.Linear(cfg.c_z, c)
        self.linear_g = nn.Linear(cfg.c_z, cfg.c_z)
        self.layer_norm_out = nn.LayerNorm(c)
        self.linear_z = nn.Linear(c, cfg.c_z)

    def forward(self, z: torch.Tensor, masks: _Masks) -> torch.Tensor:
        x = self.layer_norm_in(z)  # (B, R, R, c_z)
        a = torch.sigmoid(self.linear_a_g(x)) * self.linear_a_p(x) * masks.pair  # (B, R, R, c)
        b = torch.sigmoid(self.linear_b_g(x)) * self.linear_b_p(x) * masks.pair  # (B, R, R, c)
        p = torch.einsum(self.equation, a, b)  # (B, R, R, c)
        g = torch.sigmoid(self.linear_g(x))  # (B, R, R, c_z)
        return g * self.linear_z(self.layer_norm_out(p))  # (B, R, R, c_z)


class TriangleAttention(nn.Module):
    """Algorithms 13 (around the starting node: attention along j for each i, biased by
    ``b_jk``) and 14 (around the ending node: the same on the transposed pair)."""

    def __init__(self, cfg: EvoformerConfig, *, starting: bool) -> None:
        super().__init__()
        self.starting = starting
        self.layer_norm = nn.LayerNorm(cfg.c_z)
        self.linear_bias = nn.Linear(cfg.c_z, cfg.heads_pair, bias=False)
        self.mha = GatedAttention(cfg.c_z, cfg.c_att_pair, cfg.heads_pair)

    def forward(self, z: torch.Tensor, masks: _Masks) -> torch.Tensor:
        if not self.starting:  # a config constant: the ending node is the starting node of z^T
            z = z.transpose(1, 2)  # (B, J, I, c_z)
        x = self.layer_norm(z)  # (B, I, J, c_z)
        bias = self.linear_bias(x).permute(0, 3, 1, 2).unsqueeze(1)  # (B, 1, H, J, K)
        out = self.mha(x, masks.pair_start_bias if self.starting else masks.pair_end_bias, bias)  # (B, I, J, c_z)
        return out if self.starting else out.transpose(1, 2)


class EvoformerBlock(nn.Module):
    """Algorithm 6: one Evoformer block, residual updates of the MSA then the pair representation."""

    def __init__(self, cfg: EvoformerConfig) -> None:
        super().__init__()
        self.msa_att_row = MSARowAttentionWithPairBias(cfg)
        self.msa_att_col = MSAColumnAttention(cfg)
        self.msa_transition = Transition(cfg.c_m, cfg.transition_n)
        self.outer_product_mean = OuterProductMean(cfg)
        self.tri_mul_out = TriangleMultiplication(cfg, outgoing=True)
        self.tri_mul_in = TriangleMultiplication(cfg, outgoing=False)
        self.tri_att_start = TriangleAttention(cfg, starting=True)
        self.tri_att_end = TriangleAttention(cfg, starting=False)
        self.pair_transition = Transition(cfg.c_z, cfg.transition_n)

    def forward(self, m: torch.Tensor, z: torch.Tensor, masks: _Masks) -> tuple[torch.Tensor, torch.Tensor]:
        # m: (B, S, R, c_m), z: (B, R, R, c_z)
        m = m + self.msa_att_row(m, z, masks)
        m = m + self.msa_att_col(m, masks)
        m = m + self.msa_transition(m)
        z = z + self.outer_product_mean(m, masks)
        z = z + self.tri_mul_out(z, masks)
        z = z + self.tri_mul_in(z, masks)
        z = z + self.tri_att_start(z, masks)
        z = z + self.tri_att_end(z, masks)
        z = z + self.pair_transition(z)
        return m, z


class InputEmbedder(nn.Module):
    """Algorithms 3 and 4 (the one-hot relative positions are an input feature): the initial MSA and pair
    representations from the target, MSA and relative-position features."""

    def __init__(self, cfg: EvoformerConfig) -> None:
        super().__init__()
        self.linear_tf_z_i = nn.Linear(cfg.target_feat, cfg.c_z)
        self.linear_tf_z_j = nn.Linear(cfg.target_feat, cfg.c_z)
        self.linear_tf_m = nn.Linear(cfg.target_feat, cfg.c_m)
        self.linear_msa_m = nn.Linear(cfg.msa_feat, cfg.c_m)
        self.linear_relpos = nn.Linear(cfg.relpos_bins, cfg.c_z)

    def forward(
        self, msa_feat: torch.Tensor, target_feat: torch.Tensor, relpos_feat: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # msa_feat: (B, S, R, 49), target_feat: (B, R, 22), relpos_feat: (B, R, R, 65)
        z_i = self.linear_tf_z_i(target_feat).unsqueeze(2)  # (B, R, 1, c_z)
        z_j = self.linear_tf_z_j(target_feat).unsqueeze(1)  # (B, 1, R, c_z)
        z = z_i + z_j  # (B, R, R, c_z)
        z = z + self.linear_relpos(relpos_feat)  # (B, R, R, c_z)
        m = self.linear_msa_m(msa_feat) + self.linear_tf_m(target_feat).unsqueeze(1)  # (B, S, R, c_m)
        return m, z


class RecyclingEmbedder(nn.Module):
    """Algorithm 32 without the positions: add the layer-normed first MSA row and pair
    representation of the previous recycling iteration. The first row is selected by a (S, 1, 1)
    one-hot buffer, so the update is elementwise and stays splittable along every dimension."""

    def __init__(self, cfg: EvoformerConfig) -> None:
        super().__init__()
        self.layer_norm_m = nn.LayerNorm(cfg.c_m)
        self.layer_norm_z = nn.LayerNorm(cfg.c_z)
        first = torch.zeros(cfg.n_seq, 1, 1)
        first[0] = 1.0
        self.register_buffer("first_row", first, persistent=False)  # (S, 1, 1)

    def forward(
        self, m: torch.Tensor, z: torch.Tensor, prev_m1: torch.Tensor, prev_z: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # m: (B, S, R, c_m), z: (B, R, R, c_z), prev_m1: (B, R, c_m), prev_z: (B, R, R, c_z)
        m = m + self.first_row * self.layer_norm_m(prev_m1).unsqueeze(1)  # (B, S, R, c_m)
        return m, z + self.layer_norm_z(prev_z)


class Evoformer(nn.Module):
    """AlphaFold2's trunk run ``cfg.recycles`` times (recycling, the first passes without
    gradients) whose forward returns the last pass's distogram loss."""

    def __init__(self, cfg: EvoformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.input_embedder = InputEmbedder(cfg)
        self.recycling_embedder = RecyclingEmbedder(cfg)
        self.blocks = nn.ModuleList(EvoformerBlock(cfg) for _ in range(cfg.blocks))
        self.distogram = nn.Linear(cfg.c_z, cfg.dist_bins)

    def forward(
        self,
        msa_feat: torch.Tensor,
        target_feat: torch.Tensor,
        relpos_feat: torch.Tensor,
        msa_mask: torch.Tensor,
        pair_mask: torch.Tensor,
        prev_msa_first_row: torch.Tensor,
        prev_pair: torch.Tensor,
        dist_bins: torch.Tensor,
    ) -> torch.Tensor:
        # msa_mask: (B, S, R), pair_mask: (B, R, R), dist_bins: (B, R, R) bin indices
        masks = _Masks(
            msa_row_bias=mask_bias(msa_mask),
            msa_col_bias=mask_bias(msa_mask.transpose(1, 2)),
            msa=msa_mask.unsqueeze(-1),
            opm_norm=torch.einsum("bis,bsj->bij", msa_mask.transpose(1, 2), msa_mask).unsqueeze(-1),
            pair_start_bias=mask_bias(pair_mask),
            pair_end_bias=mask_bias(pair_mask.transpose(1, 2)),
            pair=pair_mask.unsqueeze(-1),
        )
        prev_m1, prev_z = prev_msa_first_row, prev_pair
        for r in range(self.cfg.recycles):  # a config constant, unrolled by the tracer
            if r:  # the previous pass gets no gradient (Algorithm 2: its outputs are stop-gradient)
                prev_m1, prev_z = m[:, 0].detach(), z.detach()  # noqa: F821 (m, z: the previous pass) (B, R, c_m), (B, R, R, c_z)
            m, z = self.input_embedder(msa_feat, target_feat, relpos_feat)
            m, z = self.recycling_embedder(m, z, prev_m1, prev_z)
            for block in self.blocks:
                m, z = block(m, z, masks)
        logits = self.distogram(z)  # (B, R, R, bins)
        logits = logits + logits.transpose(1, 2)  # symmetric in i, j
        # the distogram loss (supplement 1.9.8): cross-entropy averaged over the unmasked residue
        # pairs of each example, then over the batch
        ce = F.cross_entropy(logits.permute(0, 3, 1, 2), dist_bins, reduction="none")  # (B, R, R)
        per_example = torch.einsum("bij,bij->b", ce, pair_mask) / (torch.einsum("bij->b", pair_mask) + 1e-6)  # (B,)
        return torch.einsum("b->", per_example / per_example.shape[0])

    @staticmethod
    def example_inputs(
        cfg: EvoformerConfig, batch: int, device: str | torch.device = "meta", seed: int | None = None
    ) -> tuple[torch.Tensor, ...]:
        """Synthetic features of ``batch`` cropped proteins, in ``forward``'s order.

        One-hot MSA and target features (with random extra MSA columns: deletions and
        profiles), one-hot relative positions clipped to +-32, masks with a few padded residues
        and sequences (sample b pads its last ``b % 3`` residues and ``b % 2`` sequences),
        random recycled representations and symmetric distogram bins. On ``meta`` no data is made.
        """
        b, s, r = batch, cfg.n_seq, cfg.n_res
        shapes = [
            (b, s, r, cfg.msa_feat),
            (b, r, cfg.target_feat),
            (b, r, r, cfg.relpos_bins),
            (b, s, r),
            (b, r, r),
            (b, r, cfg.c_m),
            (b, r, r, cfg.c_z),
        ]
        if str(device) == "meta":
            return (
                *(torch.empty(sh, device="meta") for sh in shapes),
                torch.empty(b, r, r, dtype=torch.long, device="meta"),
            )
        g = torch.Generator().manual_seed(0 if seed is None else seed)
        msa_feat = torch.rand(shapes[0], generator=g)
        classes = min(23, cfg.msa_feat)  # 20 amino acids, unknown, gap, mask
        msa_feat[..., :classes] = F.one_hot(torch.randint(0, classes, (b, s, r), generator=g), classes).float()
        aatype = torch.randint(0, min(21, cfg.target_feat), (b, r), generator=g)
        target_feat = F.one_hot(aatype, cfg.target_feat).float()
        k = (cfg.relpos_bins - 1) // 2
        offset = torch.arange(r)[:, None] - torch.arange(r)[None, :]  # (R, R)
        relpos = F.one_hot(offset.clamp(-k, k) + k, cfg.relpos_bins).float().expand(b, -1, -1, -1)
        res_mask = torch.ones(b, r)
        seq_mask = torch.ones(b, s)
        for i in range(b):
            if i % 3 and r > i % 3:
                res_mask[i, r - i % 3 :] = 0.0
            if i % 2 and s > 1:
                seq_mask[i, -1] = 0.0
        msa_mask = seq_mask[:, :, None] * res_mask[:, None, :]  # (B, S, R)
        pair_mask = res_mask[:, :, None] * res_mask[:, None, :]  # (B, R, R)
        prev_m1 = torch.randn(shapes[5], generator=g)
        prev_z = torch.randn(shapes[6], generator=g)
        bins = torch.randint(0, cfg.dist_bins, (b, r, r), generator=g)
        bins = torch.minimum(bins, bins.transpose(1, 2))  # symmetric, like distances
        out = (msa_feat, target_feat, relpos.contiguous(), msa_mask, pair_mask, prev_m1, prev_z, bins)
        return tuple(t.to(device) for t in out)
