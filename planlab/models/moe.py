"""A mixture-of-experts decoder (Mixtral-style) as real torch modules, written so torch.fx traces it whole.

The architecture of Mistral AI's Mixtral (Jiang et al. 2024, "Mixtral of Experts"): a LLaMA
decoder (RMSNorm, rotary embeddings, grouped-query attention, imported from
:mod:`planlab.models.llama`) whose feed-forward is a sparse mixture of SwiGLU experts. A router
linear scores the experts, softmax turns the scores into probabilities, each token keeps its
top-k experts with the kept probabilities renormalised to sum to one, and its output is the
weighted sum of those experts' outputs.

Static shapes, as GShard (Lepikhin et al. 2020) and Switch (Fedus et al. 2021) route: each
sequence is a group whose tokens queue for every expert, first choices ahead of second choices,
and an expert takes at most ``capacity`` tokens of a group, ``capacity_factor * seq * top_k /
experts`` rounded up (at most ``seq``); assignments past it are dropped (their token keeps the
residual only). ``capacity_factor >= experts / top_k`` drops nothing and computes exactly what
Mixtral's dropless routing computes. The dispatch is index based: ``scatter_add`` writes each
kept assignment into its slot of a ``(B, experts * capacity, H)`` buffer, the experts run as
batched matmuls over stacked weights ``(experts, hidden, ffn)`` (splitting the expert axis is
expert parallelism, splitting ``ffn`` tensor parallelism), and ``gather`` reads each
assignment's result back. Every index addresses an axis of its own sequence, so any split along
the batch (or the hidden axis) leaves the indices valid in each piece.

The load-balancing loss is Mixtral's (Switch's with top-k, as Hugging Face's
``load_balancing_loss_func``): ``experts * sum_e f_e * P_e`` with ``f_e`` the fraction of tokens
routed to expert ``e`` and ``P_e`` its mean router probability, here per group (sequence) and
averaged over the batch as GShard does, so the loss is a sum over samples and splits over data
parallel replicas and micro-batches exactly.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from planlab.models.configs import MoEConfig, expert_capacity  # noqa: F401 (re-exported)
from planlab.models.llama import Attention, add_decoder_modules
from planlab.models.tokens import token_batch


class Experts(nn.Module):
    """``experts`` SwiGLU MLPs as stacked weights: ``w2(silu(w1 x) * w3 x)`` per expert."""

    def __init__(self, experts: int, hidden: int, ffn_hidden: int) -> None:
        super().__init__()
        e, h, f = experts, hidden, ffn_hidden
        self.w1 = nn.Parameter(torch.empty(e, h, f))  # (E, H, F)
        self.w3 = nn.Parameter(torch.empty(e, h, f))  # (E, H, F)
        self.w2 = nn.Parameter(torch.empty(e, f, h))  # (E, F, H)
        for w, fan_in in ((self.w1, h), (self.w3, h), (self.w2, f)):  # as nn.Linear draws its weights
            nn.init.uniform_(w, -(fan_in**-0.5), fan_in**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (E, T, H) -> (E, T, F) -> (E, T, H), each expert on its own T tokens
        return torch.matmul(F.silu(torch.matmul(x, self.w1)) * torch.matmul(x, self.w3), self.w2)


class SparseMoE(nn.Module):
    """Top-k routed experts with a per-sequence capacity; returns the output and the
    per-sequence load-balancing loss."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.capacity = cfg.experts, cfg.top_k, cfg.capacity
        self.balance = cfg.aux_loss_coef > 0  # a config constant: no load-balancing operators without it
        self.gate = nn.Linear(cfg.hidden, cfg.experts, bias=False)  # the router
        self.experts = Experts(cfg.experts, cfg.hidden, cfg.ffn_hidden)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        E, K = self.num_experts, self.top_k
        S = x.shape[1]
        # routing: probabilities, top-k, renormalised weights
        probs = F.softmax(self.gate(x), dim=-1)  # (B, S, E)
        top = torch.topk(probs, K, dim=-1)
        top_p, top_i = top[0], top[1]  # (B, S, K) probabilities and experts
        weight = top_p / top_p.sum(dim=-1, keepdim=True)  # (B, S, K)
        choice = F.one_hot(top_i, E)  # (B, S, K, E)
        y = route_to_experts(x, top_i, choice, weight, self.experts, num_experts=E, capacity=self.capacity)  # (B, S, H)
        if not self.balance:
            return y, None
        # load balancing per sequence: E * sum_e (tokens routed to e / S) * (mean probability of e)
        routed = choice.sum(dim=(1, 2)).to(probs.dtype) / S  # (B, E)
        mean_p = probs.sum(dim=1) / S  # (B, E)
        aux = (routed * mean_p).sum(dim=-1) * E  # (B,)
        return y, aux


def route_to_experts(
    x: torch.Tensor,
    top_i: torch.Tensor,
    choice: torch.Tensor,
    weight: torch.Tensor,
    experts: nn.Module,
    *,
    num_experts: int,
    capacity: int,
) -> torch.Tensor:
    """Dispatch each token to its ``top_i`` experts (at most ``capacity`` tokens of a sequence per
    expert, first choices first), run ``experts`` on ``(E, B*C, H)`` and combine their outputs
    weighted by ``weight``: x (B, S, H), top_i and weight (B, S, K), ``choice`` the one-hot
    ``(B, S, K, E)`` of ``top_i`` -> (B, S, H).

    Plain tensor operations, so torch.fx traces it into the caller's module (its ``experts``
    weights keep their names)."""
    E, C, K, S = num_experts, capacity, top_i.shape[-1], x.shape[1]
    # queue positions per sequence: first choices (k = 0) of every token, then second ones
    order = choice.transpose(1, 2).flatten(1, 2)  # (B, K*S, E)
    pos = (torch.cumsum(order, dim=1) * order).sum(dim=-1) - 1  # (B, K*S) place in its expert's queue
    keep = pos < C  # (B, K*S) within capacity
    expert = top_i.transpose(1, 2).flatten(1, 2)  # (B, K*S)
    slot = ((expert * C + pos) * keep).unsqueeze(-1).expand(-1, -1, x.shape[-1])  # (B, K*S, H)
    # dispatch: each kept assignment's token into its slot (dropped ones add zeros to slot 0)
    src = x.unsqueeze(1).expand(-1, K, -1, -1).flatten(1, 2) * keep.unsqueeze(-1)  # (B, K*S, H)
    empty = torch.zeros_like(x[:, :1]).expand(-1, E * C, -1)  # (B, E*C, H)
    slots = torch.scatter_add(empty, 1, slot, src)  # (B, E*C, H)
    xe = slots.unflatten(1, (E, C)).transpose(0, 1).flatten(1, 2)  # (E, B*C, H)
    ye = experts(xe)  # (E, B*C, H)
    yo = ye.unflatten(1, (-1, C)).transpose(0, 1).flatten(1, 2)  # (B, E*C, H)
    # combine: each assignment reads its slot, weighted (zero when dropped), summed over k
    wk = (weight.transpose(1, 2).flatten(1, 2) * keep).unsqueeze(-1)  # (B, K*S, 1)
    return (torch.gather(yo, 1, slot) * wk).unflatten(1, (K, S)).sum(dim=1)  # (B, S, H)


class Block(nn.Module):
    """Pre-norm decoder layer: grouped-query attention, then the sparse mixture of experts."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.feed_forward = SparseMoE(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = x + self.attention(self.attention_norm(x), cos, sin)  # (B, T, C)
        y, aux = self.feed_forward(self.ffn_norm(x))  # (B, T, C), (B,) or None
        return x + y, aux


class MoE(nn.Module):
    """Mixture-of-experts decoder whose forward returns the mean next-token cross-entropy plus
    ``aux_loss_coef`` times the load-balancing loss summed over layers."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        add_decoder_modules(self, cfg, Block)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return decoder_loss(self, idx, targets)

    @staticmethod
    def example_inputs(
        cfg: MoEConfig, batch: int, device: str | torch.device = "meta", seed: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and next-token targets of shape (batch, seq)."""
        return token_batch(cfg.vocab, cfg.seq, batch, device, seed)


def decoder_loss(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The forward of a decoder whose blocks return ``(x, balance loss or None)``: the mean
    next-token cross-entropy plus ``aux_loss_coef`` times the balance losses summed over layers.
    ``model`` has ``tok_embeddings``, ``blocks``, ``rope_cos``/``rope_sin``, ``norm``, ``output`` and
    ``cfg`` (:class:`MoE`, :class:`planlab.models.deepseek.DeepSeek`)."""
    # idx, targets: (B, T) token ids
    x, aux = decoder_states(model, idx)  # (B, T, C), (B,) or None
    logits = model.output(model.norm(x))  # (B, T, V)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
    return with_balance_loss(model, loss, aux, idx.shape[0])


def decoder_states(model: nn.Module, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The last layer's output (B, T, C) for token ids ``idx`` (B, T), and the balance losses
    summed over the layers ((B,), None without any); ``model`` as in :func:`decoder_loss`."""
    x = model.tok_embeddings(idx)  # (B, T, C)
    aux = None
    for block in model.blocks:
        x, a = block(x, model.rope_cos, model.rope_sin)  # (B, T, C), (B,) or None
        aux = add_balance(aux, a)
    return x, aux


def add_balance(aux: torch.Tensor | None, a: torch.Tensor | None) -> torch.Tensor | None:
    """Two per-sample balance losses summed (None for dense layers and without a balance loss:
    config constants, so the traced graph has no branch)."""
    if a is None:
        return aux
    return a if aux is None else aux + a


def with_balance_loss(model: nn.Module, loss: torch.Tensor, aux: torch.Tensor | None, batch: int) -> torch.Tensor:
    """``loss`` plus ``aux_loss_coef`` times the balance losses ``aux`` (B,) averaged over the batch."""
    if aux is None:
        return loss
    # the batch mean as a sum over samples divided by the whole batch, so pieces add up
    return loss + aux.sum() * (model.cfg.aux_loss_coef / batch)
