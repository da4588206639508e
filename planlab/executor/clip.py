"""Gradient clipping across shards: the global norm of a model whose gradients are split,
replicated and sharded over ranks, each element counted once.

A rank's gradient buffers at the optimizer are its pieces' final gradients (``WEIGHT_GRAD``) and,
under ZeRO, its shard of each reduced bucket (``SHARD_GRAD``). An element held by ``c`` ranks
(data- or tensor-parallel replicas hold the same piece) is weighted ``1/c`` in each rank's
sum of squares; in a ZeRO bucket reduce-scattered over ``n`` replicas only one of each ``n``
holds it, so it is weighted ``n/c``. The weighted sums, all-reduced over every rank, give the
squared norm of the whole model's gradient, as ``torch.nn.utils.clip_grad_norm_`` computes
it in one process; every gradient is then scaled by ``min(1, max_norm / (norm + 1e-6))``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence, Union

import torch

from planlab.plan.layout import Box
from planlab.plan.buffer import Buffer, weight_grad
from planlab.plan.program import Program

Weight = Union[float, torch.Tensor]  # one weight for a whole buffer, or one per element
EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_


def _overlap(a: Box, b: Box) -> Box | None:
    box = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return box if all(lo < hi for lo, hi in box) else None


def holders(program: Program) -> dict[str, list[Box]]:
    """Per parameter, the box held by each device that holds a piece of it."""
    out: dict[str, list[Box]] = defaultdict(list)
    for dp in program.devices:
        for p, box in dp.params:
            out[p].append(tuple(tuple(b) for b in box))
    return dict(out)


def copies(box: Box, others: Sequence[Box]) -> Weight:
    """How many of ``others`` (this box among them) hold each element of ``box``: a number when
    it is the same for every element, else a tensor of the box's shape."""
    overlaps = [ov for ov in (_overlap(box, o) for o in others) if ov is not None]
    if all(ov == box for ov in overlaps):
        return float(len(overlaps))
    count = torch.zeros(tuple(hi - lo for lo, hi in box), dtype=torch.float64)
    for ov in overlaps:
        count[tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(ov, box))] += 1
    return count


def norm_weights(program: Program, device: int, zero_buckets: dict) -> dict[Buffer, Weight]:
    """The weight of each gradient buffer's elements in ``device``'s sum of squares (see the
    module docstring): the weight gradients of pieces updated whole, the shard gradients of ZeRO shards
    (``zero_buckets`` as the Interpreter keeps them: params, n, me, chunk)."""
    held = holders(program)
    boxes = {p: tuple(tuple(b) for b in box) for p, box in program.devices[device].params}
    count = {p: copies(box, held[p]) for p, box in boxes.items()}
    zeroed = {p for z in zero_buckets.values() for p in z.params}
    out: dict[Buffer, Weight] = {weight_grad(p): 1.0 / c for p, c in count.items() if p not in zeroed}
    for name, z in zero_buckets.items():
        per = [count[p] for p in z.params]
        if all(isinstance(c, float) for c in per) and len({c for c in per}) == 1:
            out[name] = z.n / per[0]  # padding elements have zero gradients: their weight is moot
            continue
        flat = torch.cat(
            [
                (z.n / c).reshape(-1)
                if isinstance(c, torch.Tensor)
                else torch.full((_numel(boxes[p]),), z.n / c, dtype=torch.float64)
                for p, c in zip(z.params, per)
            ]
        )
        flat = torch.nn.functional.pad(flat, (0, z.chunk * z.n - flat.numel()))
        out[name] = flat[z.me * z.chunk : (z.me + 1) * z.chunk].clone()
    return out


def _numel(box: Box) -> int:
    n = 1
    for lo, hi in box:
        n *= hi - lo
    return n


def local_square_sum(grads: dict[Buffer, torch.Tensor], weights: dict[Buffer, Weight]) -> torch.Tensor:
    """``sum(weight * grad**2)`` over this device's buffers, in float64 (a 0-d tensor)."""
    total = torch.zeros((), dtype=torch.float64)
    for name, w in weights.items():
        g = grads.get(name)
        if g is None:
            continue  # a piece that received no gradient contribution this step
        sq = g.detach().to(torch.float64).square()
        total = total + (sq.sum() * w if isinstance(w, float) else (sq * w.to(sq.device)).sum()).cpu()
    return total


def clip_coefficient(norm: float, max_norm: float) -> float:
    """The factor every gradient is scaled by, as ``clip_grad_norm_`` computes it."""
    return min(1.0, max_norm / (norm + EPS))
