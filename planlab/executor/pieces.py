"""Running one operator piece on local tensors (:func:`run_piece`), as the interpreter's forward
and backward tasks do: the call's arguments bound to the piece's tensors, and the pieces whose
operator needs more than its call: an embedding or a loss split along the vocabulary, a mean's
share, and the tensors sized when the model was traced, of which a micro-batch takes its rows.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from planlab.executor.piece_check import check_piece_shapes
from planlab.executor.ring_attention import ring_attention
from planlab.executor.vocab_parallel import vocab_parallel_cross_entropy
from planlab.graph.ir import Graph, Operator, TensorArg
from planlab.models.vocab_parallel import VOCAB_EMBEDDINGS
from planlab.plan.passes.layouts import NARROWED_TO_MICROBATCH
from planlab.plan.program import Task


@functools.lru_cache(maxsize=4096)  # per CallSpec (hashed by identity, held while cached)
def _binder(call) -> tuple | bool:
    """``((input index or -1, constant) per positional argument, (name, index, constant) per
    keyword)`` when no argument nests others (a list, tuple, dict or slice), else False."""
    values = list(call.args) + list(call.kwargs.values())
    if any(isinstance(v, (tuple, list, dict, slice)) for v in values):
        return False
    slot = lambda v: (v.index, None) if isinstance(v, TensorArg) else (-1, v)  # noqa: E731
    return tuple(slot(a) for a in call.args), tuple((k,) + slot(v) for k, v in call.kwargs.items())


def run_piece(
    op: Operator,
    task: Task,
    tensors: list[torch.Tensor],
    graph: Graph,
    microbatches: int,
    vocab_offset: int = 0,
    group=None,
    mb: int = 0,
):
    """Run one piece of ``op`` for micro-batch ``mb`` on local tensors; returns the output
    tensor(s). A constant or a factory (a tensor a Hugging Face model made from sizes alone, at the
    traced batch: :data:`SIZED_AT_TRACE`) gives micro-batch ``mb``'s rows of its batch axes. A piece of an
    embedding whose table holds rows ``vocab_offset ..`` of the vocabulary only (split along ``v``)
    looks up the ids in its rows and gives zeros for the others (the pieces add up). A piece of a
    vocabulary-parallel loss (``vocab_cross_entropy``) scores its logits, vocabulary entries
    ``vocab_offset ..``, with the other slices' pieces on the process group ``group``
    (:mod:`planlab.executor.vocab_parallel`). A piece of a ring attention runs the ring on ``group``
    (:mod:`planlab.executor.ring_attention`)."""
    if task.ring is not None:  # a ring attention's piece: its ring is the process group ``group``
        return ring_attention(
            *tensors[:3], ring=task.ring, ranks=task.group, group=group, scale=op.call.kwargs.get("scale")
        )
    if op.kind in VOCAB_EMBEDDINGS and tensors[1].shape[0] != op.dim_sizes["v"]:
        return vocab_piece_embedding(tensors[0], tensors[1], vocab_offset)
    if op.kind == "vocab_cross_entropy":
        loss = vocab_parallel_cross_entropy(
            tensors[0], tensors[1], offset=vocab_offset, count=op.dim_sizes["n"], group=group
        )
        return loss.reshape(task.shape)
    if op.kind == "kept_mean":  # one micro-batch's share of HF's mean over kept targets (planlab.graph.ops_hf)
        return tensors[0] / (tensors[1] * microbatches)
    if op.kind == "reshape":
        return tensors[0].reshape(task.shape)
    if op.kind == "expand":  # the call's sizes are the whole tensor's; expand to the piece's
        return tensors[0].expand(task.shape)
    if not task.lead and op.add_once:
        tensors = [None if k in op.add_once else x for k, x in enumerate(tensors)]
    if op.kind == "cross_entropy" and op.call.kwargs.get("reduction", "mean") == "mean":
        # A piece of a mean: sum its share and divide by the full count, so pieces add up.
        full = 1
        for name in op.signature.reduce:
            full *= op.dim_sizes[name]
        kwargs = dict(op.call.kwargs, reduction="sum")
        args = [tensors[a.index] if isinstance(a, TensorArg) else a for a in op.call.args]
        return F.cross_entropy(*args, **kwargs) / full
    bind = _binder(op.call)
    if bind:  # a flat call: tensors go straight into their slots
        args = [tensors[i] if i >= 0 else c for i, c in bind[0]]
        kwargs = {k: tensors[i] if i >= 0 else c for k, i, c in bind[1]}
    else:
        sub = lambda a: tensors[a.index] if isinstance(a, TensorArg) else a  # noqa: E731
        args = [torch.fx.node.map_aggregate(a, sub) for a in op.call.args]
        kwargs = {k: torch.fx.node.map_aggregate(v, sub) for k, v in op.call.kwargs.items()}
    target = op.call.target
    out = getattr(args[0], target)(*args[1:], **kwargs) if isinstance(target, str) else target(*args, **kwargs)
    if op.kind in SIZED_AT_TRACE and microbatches > 1:
        out = microbatch_rows(out, graph, op.outputs[0], mb, microbatches)
    check_piece_shapes(op, task, out)  # a size fixed at trace time fails here, naming the operator
    return out


# Operators whose sizes were fixed when the model was traced, at the whole batch: a constant (a
# tensor made from sizes alone) and a factory (``torch.zeros(8, 7)``, ``x.new_zeros(x.shape)``: its
# size is the traced one even when ``x`` is one micro-batch's). Each gives the whole batch's value;
# a micro-batch takes its rows of it (:func:`microbatch_rows`).
SIZED_AT_TRACE = NARROWED_TO_MICROBATCH


def microbatch_rows(x: torch.Tensor, graph: Graph, t: str, mb: int, microbatches: int) -> torch.Tensor:
    """Micro-batch ``mb``'s rows of ``x``, the whole batch's value of tensor ``t``: each axis of
    ``t`` that carries the batch, and that ``x`` holds whole, narrowed to its ``mb``-th of
    ``microbatches`` equal parts (as a micro-batch's load narrows the model's inputs)."""
    whole = graph.tensors[t].shape
    for a in range(x.dim()):
        if graph.labels.get((t, a)) == graph.batch_label and x.shape[a] == whole[a]:
            size = x.shape[a] // microbatches
            x = x.narrow(a, mb * size, size)
    return x


def vocab_piece_embedding(idx: torch.Tensor, rows: torch.Tensor, offset: int) -> torch.Tensor:
    """Megatron's VocabParallelEmbedding: the embedding of ``idx`` in ``rows`` (rows ``offset ..
    offset + len(rows)`` of the table), zero where an id is outside them."""
    local = idx - offset
    outside = (local < 0) | (local >= rows.shape[0])
    out = F.embedding(local.masked_fill(outside, 0), rows)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)
