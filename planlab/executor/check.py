"""The numeric check: a single-process run of the same model from the same seed."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from planlab.models.registry import ModelSpec, build_model


@dataclass(frozen=True)
class Reference:
    """Losses of ``steps`` single-process Adam steps and the first step's gradients."""

    losses: tuple[float, ...]
    grads: dict[str, torch.Tensor]


def reference_run(spec: ModelSpec, *, global_batch: int, steps: int, lr: float, seed: int = 0) -> Reference:
    """Train the whole model in one process on the whole batch."""
    model, inputs = build_model(spec, batch=global_batch, device="cpu", seed=seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses, grads = [], {}
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(*inputs)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(float(loss.detach()))
    return Reference(tuple(losses), grads)


def max_grad_error(captured: dict[str, torch.Tensor], boxes: dict[str, tuple], ref: Reference) -> float:
    """Largest absolute difference between local gradient shards and the reference's slices."""
    worst = 0.0
    for p, g in captured.items():
        r = ref.grads[p][tuple(slice(a, b) for a, b in boxes[p])]
        worst = max(worst, float((g - r).abs().max()) if g.numel() else 0.0)
    return worst
