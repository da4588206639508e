"""Gradient reduction without ZeRO: the partial weight gradients of data-parallel (and other)
replicas summed by all-reduces, in buckets overlapped with the backward as Megatron-LM and DDP do,
or in one all-reduce per group after the backward."""

from __future__ import annotations

from collections import defaultdict

from planlab.plan.layout import Partial, box_numel
from planlab.plan.passes.draft import Draft, Idents, Part, add, update_blocks
from planlab.plan.program import Role, Task, TaskKind

# Megatron-LM's default gradient bucket (--ddp-bucket-size: 40M elements).
BUCKET_ELEMENTS = 40_000_000

Reduction = list[tuple[int, str, int]]  # (topological index of the owner, parameter, bytes of its gradient)


def reduction_groups(d: Draft) -> dict[int, dict[tuple[int, ...], Reduction]]:
    """Per device and reduction group, the weight gradients the group sums: those whose owner's
    contribution is a partial sum along mesh axes where the weight itself is not (its replicas).
    Every member of a group finds the same parameters."""
    out: dict[int, dict[tuple[int, ...], Reduction]] = defaultdict(lambda: defaultdict(list))
    L = d.layouts
    # layers repeat: a few (contribution, weight) layouts and shapes, each reduced alike at every position
    reduced: dict[tuple, tuple[tuple[int, tuple[int, ...], int], ...]] = {}
    for p, (op, k) in d.owner.items():
        key = (L.contributes(op, k), L.needs(op, k), L.shapes[p])
        got = reduced.get(key)
        if got is None:
            got = reduced[key] = _reductions(d, *key)
        for dev, group, nbytes in got:
            out[dev][group].append((d.topo[op.name], p, nbytes))
    return out


def _reductions(d: Draft, contrib, target, shape: tuple[int, ...]) -> tuple[tuple[int, tuple[int, ...], int], ...]:
    """``(device, group, bytes)`` of the reduction of a weight of ``shape`` whose gradient comes
    in layout ``contrib`` and is wanted in ``target``, at each position built (none where
    ``contrib`` is partial along no mesh axis where ``target`` is not)."""
    axes = tuple(
        a
        for a, (c, t) in enumerate(zip(contrib.placements, target.placements))
        if isinstance(c, Partial) and not isinstance(t, Partial) and contrib.mesh.shape[a] > 1
    )
    if not axes:
        return ()
    mesh = contrib.mesh
    return tuple(
        (dev, tuple(sorted(mesh.group_of(flat, axes))), box_numel(target.box(flat, shape)) * d.precision.grad_bytes)
        for flat, dev in d.positions(mesh)
    )


def reduce_gradients(d: Draft) -> Draft:
    """Without ZeRO (``plan.zero == 0``; ZeRO is :mod:`planlab.plan.zero`'s), per device and group:
    with ``overlap``, gradient buckets (:func:`overlapped_buckets`); without, one all-reduce of the
    group's gradients in the update block, after the backward (DeepSpeed without bucketing)."""
    if d.plan.zero != 0:
        return d
    parts = dict(d.parts)
    idents = Idents(d.next_ident)
    groups = reduction_groups(d)
    for dev, update in sorted(update_blocks(d).items()):
        for group in sorted(groups[dev]):
            items = groups[dev][group]
            if d.overlap:
                overlapped_buckets(d, parts, idents, dev, group, items)
                continue
            ordered = sorted(items)
            ident = idents(("grad-reduce", params_of(ordered)))
            task = all_reduce(d, ordered, group, f"grad-reduce{list(group)}", ident)
            add(parts, dev, update, 0, Part.REDUCE, task)
    return d.replace(parts=parts, next_ident=idents.next)


def overlapped_buckets(d: Draft, parts, idents: Idents, dev: int, group: tuple[int, ...], items: Reduction) -> None:
    """Data-parallel gradient reduction overlapped with the backward, as Megatron-LM and DDP do it:
    per stage, gradients in buckets of at most the software's ``grad_bucket_elements`` (without a
    software :data:`BUCKET_ELEMENTS`), filled in the order the
    backward completes them (then by parameter name); each bucket's all-reduce is issued, with the
    last micro-batch (``final``), right after the backward task that completes it (the ``after``
    part of that operator's slot: ``Part.AFTER``), and runs on the communication stream (``overlap``)."""
    ops = d.graph.operators
    by_stage: dict[int, Reduction] = defaultdict(list)
    for item in items:
        by_stage[d.stage[ops[item[0]].name]].append(item)
    bucket_elements = d.software.grad_bucket_elements if d.software is not None else BUCKET_ELEMENTS
    cap = bucket_elements * d.precision.grad_bytes
    for st in sorted(by_stage):
        ordered = sorted(by_stage[st], key=lambda x: (-x[0], x[1]))  # backward order
        bucket: Reduction = []
        filled = 0  # bytes in the bucket
        for k, item in enumerate(ordered):
            bucket.append(item)
            filled += item[2]
            if filled < cap and k < len(ordered) - 1:
                continue
            last = min(i for i, _, _ in bucket)  # the bucket is complete after this operator's backward
            name = f"grad-reduce{list(group)}#{bucket[0][1]}"
            task = all_reduce(d, bucket, group, name, idents(("bucket", params_of(bucket))), final=True, overlap=True)
            add(parts, dev, (st, "B"), last, Part.AFTER, task)
            bucket, filled = [], 0


def all_reduce(d: Draft, items: Reduction, group: tuple[int, ...], name: str, ident: int, **extra) -> Task:
    """The all-reduce of the weight gradients ``items`` over ``group`` as one flat buffer."""
    bufs = tuple(d.names.weight_grad(p) for _, p, _ in items)
    return Task(
        name,
        TaskKind.COLLECTIVE,
        bufs,
        bufs,
        collective="all_reduce",
        group=group,
        nbytes=sum(n for _, _, n in items),
        role=Role.BUCKET,
        ident=ident,
        **extra,
    )


def params_of(items: Reduction) -> tuple[str, ...]:
    """The parameters of a reduction's gradients, in its order (what identifies its collective)."""
    return tuple(p for _, p, _ in items)
