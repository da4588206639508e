"""Gradients left as partial sums over the data-parallel ranks until they reach a weight.

An operator that every data-parallel rank runs whole on the same inputs (a position embedding's
lookup of ``arange(seq)``, Swin's relative position bias gathered from its table, T5's relative
attention bias: a weight, or a tensor made from weights alone, broadcast over the batch) gets from
its batch-split consumers a gradient that is a partial sum over those ranks: each rank's consumer
sums over its own rows of the batch. Backward is linear in the output gradient, so the operator's
backward run on that partial sum gives partial sums of its inputs' gradients, with no
communication; the sum over the ranks happens where the gradient reaches a weight, in the
once-a-step weight-gradient reduction (:mod:`planlab.plan.passes.gradients`, ZeRO's
reduce-scatter in :mod:`planlab.plan.zero`).

This is what PyTorch and Megatron-LM do: autograd sums the gradient over the local batch and the
embedding's backward scatters it into ``wpe.weight.grad`` locally; DDP's buckets (and Megatron's
``DistributedDataParallel`` / distributed optimizer) reduce that weight gradient once per step with
the others. Nothing is communicated per micro-batch for it (Megatron-LM's position ids are
``[batch, seq]``: ``megatron/core/models/common/embeddings/language_model_embedding.py``). Only the
data-parallel axes (those along which a consumer splits its batch) are deferred: tensor
parallelism's reductions stay where Megatron-LM puts them (the backward of its ``f`` operator).
"""

from __future__ import annotations

from planlab.graph.ir import Graph, Operator
from planlab.plan.layout import Mesh


def deferred_axes(
    graph: Graph,
    mesh: dict[str, Mesh],
    dims: dict[str, tuple[str | None, ...]],
) -> dict[str, frozenset[int]]:
    """Per operator with any, the mesh axes along which its outputs' gradients stay partial sums
    (and so do its inputs' gradient contributions, its weights' among them): axes of size > 1 along
    which it splits nothing and along which every consumer of every floating output, on the same
    mesh, either splits its batch where the tensor has no batch axis (its contribution is a partial
    sum over the data-parallel ranks) or defers the axis itself. Not for the operator that makes the
    loss. Co-located operators (coshard) are no exception: their chunks add their contributions into
    the same partial sums (:func:`planlab.plan.coshard.groups` hands them on as they are).
    Operators are walked in reverse topological order, so a consumer is decided before its producers."""
    batch = graph.batch_label
    out: dict[str, frozenset[int]] = {}
    batch_dim: dict[str, str | None] = {}
    for op in reversed(graph.operators):
        m, od = mesh[op.name], dims[op.name]
        axes = [a for a, (d, s) in enumerate(zip(od, m.shape)) if d is None and s > 1]
        if not axes or graph.loss in op.outputs:
            continue
        uses = [
            (c, k)
            for t in op.outputs
            if graph.tensors[t].is_float
            for c in graph.consumers.get(t, ())
            for k, x in enumerate(c.inputs)
            if x == t
        ]
        if not uses:
            continue
        keep = frozenset(
            a
            for a in axes
            if all(_partial_over_replicas(graph, c, k, a, m, mesh, dims, out, batch_dim, batch) for c, k in uses)
        )
        if keep:
            out[op.name] = keep
    return out


def _partial_over_replicas(
    graph: Graph, c: Operator, k: int, a: int, m: Mesh, mesh, dims, out, batch_dim: dict, batch: str
) -> bool:
    """Whether consumer ``c``'s gradient contribution to its ``k``-th input is a partial sum over
    the data-parallel ranks along mesh axis ``a`` of ``m``."""
    if mesh[c.name] != m:
        return False
    if a in out.get(c.name, ()):
        return True
    d = dims[c.name][a]
    if d is None:
        return False
    if c.name not in batch_dim:
        batch_dim[c.name] = graph.dim_with_label(c, batch)
    return d == batch_dim[c.name] and not any(ax and ax[0] == d for ax in c.signature.inputs[k])
