"""The numeric check: a single-process run of the same model from the same seed."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Sequence

import torch

from planlab.executor.randomness import reference_draws
from planlab.graph.ir import Graph
from planlab.models.init import build_full
from planlab.models.registry import ModelSpec


@dataclass(frozen=True)
class Reference:
    """Losses of ``steps`` single-process Adam steps, the first step's gradients (before
    clipping) and, with clipping, each step's global gradient norm."""

    losses: tuple[float, ...]
    grads: dict[str, torch.Tensor]
    grad_norms: tuple[float, ...] = ()


def reference_run(
    spec: ModelSpec,
    *,
    global_batch: int,
    steps: int,
    lr: float,
    seed: int = 0,
    batches: Sequence[tuple[torch.Tensor, ...]] | None = None,
    clip_grad_norm: float | None = None,
    graph: Graph | None = None,
) -> Reference:
    """Train the whole model in one process on the whole batch: the model's example inputs
    every step, or ``batches[step % len(batches)]``; with ``clip_grad_norm``, clip as
    ``torch.nn.utils.clip_grad_norm_`` does. The weights are drawn as every rank draws its
    pieces (:func:`planlab.models.init.build_full`). With the traced ``graph``, its random
    operators draw from the counter-based generator, whole, as the plan's pieces draw
    (:func:`planlab.executor.randomness.reference_draws`)."""
    model, inputs = build_full(spec, batch=global_batch, seed=seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses, grads, norms = [], {}, []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        with reference_draws(graph, seed, step) if graph is not None else contextlib.nullcontext():
            loss = model(*(batches[step % len(batches)] if batches else inputs))
        loss.backward()
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        if clip_grad_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)))
        opt.step()
        losses.append(float(loss.detach()))
    return Reference(tuple(losses), grads, tuple(norms))


def max_grad_error(captured: dict[str, torch.Tensor], boxes: dict[str, tuple], ref: Reference) -> float:
    """Largest absolute difference between local gradient shards and the reference's slices."""
    worst = 0.0
    for p, g in captured.items():
        r = ref.grads[p][tuple(slice(a, b) for a, b in boxes[p])]
        worst = max(worst, float((g - r).abs().max()) if g.numel() else 0.0)
    return worst
