"""A DeepSeek-V3-style decoder as real torch modules, written so torch.fx traces it whole.

The architecture of DeepSeek-V3 (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report",
arXiv:2412.19437, section 2.1; the released ``config.json`` and ``modeling_deepseek.py`` of
deepseek-ai/DeepSeek-V3 on Hugging Face):

- multi-head latent attention (MLA, section 2.1.1): queries through a low-rank latent
  (``wq_a`` to ``q_lora_rank``, RMSNorm, ``wq_b`` to ``heads x (nope + rope)``), keys and values
  through a shared latent of ``kv_lora_rank`` (``wkv_a``, RMSNorm, ``wkv_b`` to
  ``heads x (nope + v)``) plus one decoupled rotary key of ``rope_head_dim`` shared by every head;
  attention over ``nope + rope`` query/key channels and ``v_head_dim`` value channels;
- DeepSeekMoE (section 2.1.2): the first ``dense_layers`` layers keep a dense SwiGLU MLP of
  ``ffn_hidden``; the others have ``shared_experts`` experts every token passes through (one
  SwiGLU of ``shared_experts x moe_ffn_hidden``) and ``experts`` fine-grained routed experts of
  ``moe_ffn_hidden`` of which each token takes ``top_k``. The router scores experts with a
  sigmoid; the selection adds a per-expert bias (the auxiliary-loss-free balancing of section
  2.1.2, a buffer that training adjusts outside the gradient; zeros here) and the kept scores are
  normalised to sum to one and scaled by ``routed_scale``. The complementary sequence-wise
  balance loss (equations 17-20, weight ``aux_loss_coef``) is added to the loss.

Routing uses the static-shape dispatch of :mod:`planlab.models.moe` (per sequence, at most
``capacity`` tokens per expert, first choices first): ``capacity_factor >= experts / top_k``
drops nothing (DeepSeek-V3 drops no token during training, section 2.1.2), and ``1.0`` sizes
each expert for an even load, which is what the big preset prices (the experts' GEMMs then
cost ``seq x top_k`` tokens, as dropless routing with a balanced load does).

Node-limited routing (section 2.1.2; ``route_groups`` and ``route_group_topk``, the released
``modeling_deepseek.py``'s ``n_group`` and ``topk_group``): a group's score is the sum of its two
best biased affinities, and the experts outside the best ``route_group_topk`` groups are ranked
at 0, as that file masks them.

Multi-token prediction (section 2.2; ``mtp_layers`` modules, Megatron-Core core_r0.14.0's
``MultiTokenPredictionLayer`` in ``megatron/core/transformer/multi_token_prediction.py``): module
``k`` takes the previous depth's normalised output (the decoder's after its final norm), normalises
it again (``hnorm``) and joins it with the normalised embedding (``enorm``) of the tokens ``k``
places ahead (the ids rolled by one more place per depth), projects the ``2 x hidden`` join to
``hidden`` (``eh_proj``), runs one MoE decoder layer and its own final norm, and scores the result
with the main output head against the targets ``k`` places further on. Megatron-Core keeps a copy
of the embedding table on the module's pipeline stage (``GPTModel.embedding`` when
``mtp_process``), so each module has its own table here, unless ``mtp_shared_embedding=1``: the
modules then look their tokens up in the main table, one parameter read by two operators with one
gradient, as DeepSeek-V3's DualPipe puts the embedding and the modules on one pipeline rank and
shares the table physically (report section 3.2.3, "Shared Embedding and Output Head for
Multi-Token Prediction"; a plan must place both readers' pieces alike,
:mod:`planlab.plan.shared_params`). The output head is shared as there: the
main and the modules' states go through the one output layer together (stacked on an axis of
``1 + mtp_layers``). The modules' losses are weighted ``mtp_loss_coef / mtp_layers``
(``mtp_loss_scaling_factor / mtp_num_layers``). Megatron-Core masks the last ``k`` positions of
depth ``k``'s loss (their targets run past the sequence); here their targets wrap around (the
rolled targets), which changes the loss's value by a ``k / seq`` share and no cost. Left out: FP8
training (a software option, not the module).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from planlab.models.configs import DeepSeekConfig  # noqa: F401 (re-exported)
from planlab.models.llama import FeedForward, rotary_angles
from planlab.models.moe import MoE, Experts, add_balance, route_to_experts, with_balance_loss
from planlab.models.vocab_parallel import vocab_cross_entropy, vocab_embedding


class LatentAttention(nn.Module):
    """Causal multi-head latent attention with a decoupled rotary key shared by the heads."""

    def __init__(self, cfg: DeepSeekConfig) -> None:
        super().__init__()
        h, n = cfg.hidden, cfg.heads
        self.heads, self.nope, self.rope, self.v_dim = n, cfg.nope_head_dim, cfg.rope_head_dim, cfg.v_head_dim
        self.kv_rank, self.half = cfg.kv_lora_rank, cfg.rope_head_dim // 2
        self.wq_a = nn.Linear(h, cfg.q_lora_rank, bias=False)
        self.q_norm = nn.RMSNorm(cfg.q_lora_rank, eps=cfg.norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, n * (self.nope + self.rope), bias=False)
        self.wkv_a = nn.Linear(h, cfg.kv_lora_rank + self.rope, bias=False)
        self.kv_norm = nn.RMSNorm(cfg.kv_lora_rank, eps=cfg.norm_eps)
        self.wkv_b = nn.Linear(cfg.kv_lora_rank, n * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(n * self.v_dim, h, bias=False)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of x: (B, n, T, r) with cos, sin: (T, r)."""
        x1, x2 = x[..., : self.half], x[..., self.half :]  # (B, n, T, r/2) each
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin  # (B, n, T, r)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: (B, T, C); queries (B, nh, T, nope + rope), keys the same, values (B, nh, T, v)
        n, nope = self.heads, self.nope
        q = self.wq_b(self.q_norm(self.wq_a(x))).unflatten(-1, (n, nope + self.rope)).transpose(1, 2)
        latent = self.wkv_a(x)  # (B, T, kv_rank + rope)
        kv = self.wkv_b(self.kv_norm(latent[..., : self.kv_rank]))  # (B, T, nh * (nope + v))
        kv = kv.unflatten(-1, (n, nope + self.v_dim)).transpose(1, 2)  # (B, nh, T, nope + v)
        k_pe = self.rotate(latent[..., self.kv_rank :].unsqueeze(1), cos, sin)  # (B, 1, T, rope)
        q = torch.cat((q[..., :nope], self.rotate(q[..., nope:], cos, sin)), dim=-1)  # (B, nh, T, nope + rope)
        k = torch.cat((kv[..., :nope], k_pe.expand(-1, n, -1, -1)), dim=-1)  # (B, nh, T, nope + rope)
        # the default scale 1/sqrt(nope + rope) is DeepSeek-V3's softmax_scale at 4K tokens (no YaRN)
        y = F.scaled_dot_product_attention(q, k, kv[..., nope:], is_causal=True)  # (B, nh, T, v)
        return self.wo(y.transpose(1, 2).flatten(-2))  # (B, T, C)


class DeepSeekMoE(nn.Module):
    """Shared experts plus sigmoid-routed fine-grained experts; returns the output and the
    per-sequence balance loss (None when ``aux_loss_coef`` is 0)."""

    def __init__(self, cfg: DeepSeekConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.capacity = cfg.experts, cfg.top_k, cfg.capacity
        self.scale, self.balance = cfg.routed_scale, cfg.aux_loss_coef > 0
        self.groups = (cfg.route_groups, cfg.route_group_topk) if cfg.route_group_topk < cfg.route_groups else None
        self.gate = nn.Linear(cfg.hidden, cfg.experts, bias=False)  # the router
        # the balancing bias: it steers the selection only, and training updates it outside the gradient
        self.register_buffer("gate_bias", torch.zeros(cfg.experts), persistent=False)  # (E,)
        self.experts = Experts(cfg.experts, cfg.hidden, cfg.moe_ffn_hidden)
        self.shared_experts = FeedForward(cfg.hidden, cfg.shared_experts * cfg.moe_ffn_hidden)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        E, K = self.num_experts, self.top_k
        S = x.shape[1]
        scores = torch.sigmoid(self.gate(x))  # (B, S, E) affinities
        biased = scores + self.gate_bias  # (B, S, E) what the selection ranks
        if self.groups is not None:  # node-limited: only the experts of the best M of G groups
            G, M = self.groups
            best = biased.unflatten(-1, (G, E // G)).topk(2, dim=-1)[0].sum(dim=-1)  # (B, S, G) top-2 sums
            kept = F.one_hot(torch.topk(best, M, dim=-1)[1], G).sum(dim=-2).to(biased.dtype)  # (B, S, G) 0/1
            biased = biased * kept.unsqueeze(-1).expand(-1, -1, -1, E // G).flatten(-2)  # the others at 0
        top_i = torch.topk(biased, K, dim=-1)[1]  # (B, S, K) experts chosen with the bias
        top_s = torch.gather(scores, -1, top_i)  # (B, S, K) their affinities, without it
        weight = top_s / top_s.sum(dim=-1, keepdim=True) * self.scale  # (B, S, K)
        choice = F.one_hot(top_i, E)  # (B, S, K, E)
        y = route_to_experts(x, top_i, choice, weight, self.experts, num_experts=E, capacity=self.capacity)
        y = y + self.shared_experts(x)  # (B, S, H)
        if not self.balance:
            return y, None
        # sequence-wise balance: sum_e f_e P_e, f_e = E / (K S) * tokens routed to e, P_e = mean normalised affinity
        routed = choice.sum(dim=(1, 2)).to(scores.dtype) * (E / (K * S))  # (B, E)
        mean_p = (scores / scores.sum(dim=-1, keepdim=True)).sum(dim=1) / S  # (B, E)
        return y, (routed * mean_p).sum(dim=-1)  # (B, S, H), (B,)


class Block(nn.Module):
    """Pre-norm decoder layer: latent attention, then a dense MLP or DeepSeekMoE."""

    def __init__(self, cfg: DeepSeekConfig, moe: bool) -> None:
        super().__init__()
        self.moe = moe  # a config constant
        self.attention_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.attention = LatentAttention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.feed_forward = DeepSeekMoE(cfg) if moe else FeedForward(cfg.hidden, cfg.ffn_hidden)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = x + self.attention(self.attention_norm(x), cos, sin)  # (B, T, C)
        if not self.moe:
            return x + self.feed_forward(self.ffn_norm(x)), None
        y, aux = self.feed_forward(self.ffn_norm(x))  # (B, T, C), (B,) or None
        return x + y, aux


class MultiTokenPrediction(nn.Module):
    """One multi-token-prediction module (see the module docstring): returns its normalised
    output, which the shared head scores and the next module reads, and its balance loss."""

    def __init__(self, cfg: DeepSeekConfig) -> None:
        super().__init__()
        h = cfg.hidden
        if not cfg.mtp_shared_embedding:  # Megatron-Core's copy on the module's stage
            self.embed = nn.Embedding(cfg.vocab, h)
        self.enorm = nn.RMSNorm(h, eps=cfg.norm_eps)
        self.hnorm = nn.RMSNorm(h, eps=cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = Block(cfg, moe=cfg.dense_layers < cfg.layers)
        self.norm = nn.RMSNorm(h, eps=cfg.norm_eps)

    def forward(
        self, h: torch.Tensor, e: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # h: (B, T, C) the previous depth's normalised states; e: (B, T, C) the embedding (in
        # self.embed or the main table, looked up by the model) of the tokens k places ahead
        x = torch.cat((self.enorm(e), self.hnorm(h)), dim=-1)  # (B, T, 2C)
        x, aux = self.block(self.eh_proj(x), cos, sin)  # (B, T, C), (B,) or None
        return self.norm(x), aux


class DeepSeek(nn.Module):
    """DeepSeek-V3-style decoder whose forward returns the mean next-token cross-entropy plus
    ``aux_loss_coef`` times the sequence-wise balance loss summed over the MoE layers."""

    def __init__(self, cfg: DeepSeekConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.hidden)
        cos, sin = rotary_angles(cfg.rope_head_dim, cfg.rope_theta, cfg.seq)
        self.register_buffer("rope_cos", cos, persistent=False)  # (T, rope)
        self.register_buffer("rope_sin", sin, persistent=False)  # (T, rope)
        self.blocks = nn.ModuleList(Block(cfg, i >= cfg.dense_layers) for i in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        # after the layers and the final norm (an empty list without multi-token prediction)
        self.mtp = nn.ModuleList(MultiTokenPrediction(cfg) for _ in range(cfg.mtp_layers))
        self.output = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # idx, targets: (B, T) token ids; the branches on the config are constants
        x, aux = self.embed(self.tok_embeddings, idx), None  # (B, T, C)
        for block in self.blocks:
            x, a = block(x, self.rope_cos, self.rope_sin)  # (B, T, C), (B,) or None
            aux = add_balance(aux, a)
        if not self.cfg.mtp_layers:
            loss = self.cross_entropy(self.output(self.norm(x)), targets)  # logits (B, T, V)
            return with_balance_loss(self, loss, aux, idx.shape[0])
        states, ids = [self.norm(x)], idx  # per depth (B, T, C): the main model's, then each module's
        for module in self.mtp:
            ids = torch.roll(ids, -1, dims=1)  # (B, T) the tokens one place further ahead
            table = self.tok_embeddings if self.cfg.mtp_shared_embedding else module.embed
            h, a = module(states[-1], self.embed(table, ids), self.rope_cos, self.rope_sin)
            states.append(h)  # (B, T, C)
            aux = add_balance(aux, a)
        # the shared head scores every depth at once: (B, T, 1 + D, V)
        logits = self.output(torch.cat([h.unsqueeze(2) for h in states], dim=2))
        loss = self.cross_entropy(logits[:, :, 0], targets)
        extra, later = None, targets
        for k in range(1, len(states)):
            later = torch.roll(later, -1, dims=1)  # (B, T) the targets k places further on
            term = self.cross_entropy(logits[:, :, k], later)
            extra = term if extra is None else extra + term
        loss = loss + extra * (self.cfg.mtp_loss_coef / self.cfg.mtp_layers)
        return with_balance_loss(self, loss, aux, idx.shape[0])

    def embed(self, table: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        """The embedding (B, T, C) of ``ids`` (B, T) in ``table``, vocabulary-parallel with ``vocab_parallel``."""
        return vocab_embedding(ids, table.weight) if self.cfg.vocab_parallel else table(ids)

    def cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross entropy of ``logits`` (B, T, V) against ``targets`` (B, T), as Megatron-Core's
        vocabulary-parallel loss with ``vocab_parallel``."""
        if self.cfg.vocab_parallel:
            return vocab_cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1)).reshape(())
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))

    # token ids and next-token targets of shape (batch, seq), as the MoE family's
    example_inputs = staticmethod(MoE.example_inputs)
