"""Gradient reduction without ZeRO: the partial weight gradients of data-parallel (and other)
replicas summed by all-reduces, in buckets overlapped with the backward as Megatron-LM and DDP do,
or in one all-reduce per group after the backward."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from planlab.plan.layout import Partial, Shard, box_numel
from planlab.plan.passes.draft import Draft, Idents, Part, add, update_blocks
from planlab.plan.program import Role, Task, TaskKind

# Megatron-LM's default gradient bucket (--ddp-bucket-size: 40M elements).
BUCKET_ELEMENTS = 40_000_000

Reduction = list[tuple[int, str, int]]  # (topological index of the owner, parameter, bytes of its gradient)


def reduction_groups(d: Draft) -> dict[int, dict[tuple[int, ...], Reduction]]:
    """Per device and reduction group, the weight gradients the group sums: those whose owner's
    contribution is a partial sum along mesh axes where the weight itself is not (its replicas).
    Every member of a group finds the same parameters."""
    return _grouped(_reduced(d, split=False), lambda r: r.group)


def zero_groups(
    d: Draft,
) -> tuple[dict[int, dict[tuple[int, ...], Reduction]], dict[int, dict[tuple[int, ...], Reduction]]]:
    """Per device, the weight gradients ZeRO shards, by shard group, and those a tensor-parallel
    group sums before ZeRO shards them, by that group (one walk over the weights for both).

    The shard group is a weight's reduction group less its tensor-parallel ranks: its data-parallel
    group. FSDP2 shards over the data-parallel mesh it is given and keeps a weight Replicate on the
    tensor-parallel mesh (torchtitan's ``parallelize_llama``: ``fully_shard`` on the ``fsdp`` mesh,
    ``dp_shard x cp``); DeepSpeed's ZeRO-3 partitions over ``mpu.get_data_parallel_group()``
    (``deepspeed.zero.Init(data_parallel_group=...)``) and Megatron-Core's distributed optimizer over
    ``get_data_parallel_group(with_context_parallel=True)``.

    The tensor-parallel ranks (a norm's weight under sequence parallelism, whose pieces of the
    sequence each give a partial sum) are the reduction axes along which the owner splits a
    dimension other than the batch and along whose devices some weight is sharded (context
    parallelism shards no weight, expert parallelism splits the dense operators' batch). FSDP2
    all-reduces such a gradient over the tensor-parallel mesh in its post-backward hook, before the
    reduce-scatter (``FSDPParam._get_grad_inner_tensor`` redistributes the Partial gradient to the
    parameter's Replicate placement on the non-data-parallel mesh dims); Megatron-Core all-reduces
    the sequence-parallel weights' gradients over the tensor-parallel group after the backward
    (``finalize_model_grads``: ``_allreduce_non_tensor_model_parallel_grads``)."""
    items = _reduced(d, split=True)
    return _grouped(items, lambda r: r.shard), _grouped(items, lambda r: r.tp, skip_empty=True)


@dataclass(frozen=True)
class _Reduced:
    """One position's reduction of a weight's gradient: its device, the whole reduction group, the
    data-parallel (shard) and tensor-parallel parts of it (``tp`` empty without one), its bytes."""

    device: int
    group: tuple[int, ...]
    shard: tuple[int, ...]
    tp: tuple[int, ...]
    nbytes: int


def _reduced(d: Draft, split: bool) -> list[tuple[_Reduced, int, str]]:
    """Every position's reduction of every weight's gradient, with its owner's topological index and
    the parameter; ``split``: tell the tensor-parallel ranks from the data-parallel ones (ZeRO;
    without it ``shard`` is the whole group and ``tp`` empty)."""
    out = []
    L = d.layouts
    # layers repeat: a few (contribution, weight, splits) layouts and shapes, each reduced alike at every position
    reduced: dict[tuple, tuple[_Reduced, ...]] = {}
    sharding = weight_sharding_groups(d) if split else None
    batch = d.graph.batch_label
    for p, (op, k) in d.owner.items():
        key = (L.contributes(op, k), L.needs(op, k), L.shapes[p], L.dims[op.name], d.graph.dim_with_label(op, batch))
        got = reduced.get(key)
        if got is None:
            got = reduced[key] = _reductions(d, *key, sharding)
        out.extend((r, d.topo[op.name], p) for r in got)
    return out


def _grouped(items, which, skip_empty: bool = False) -> dict[int, dict[tuple[int, ...], Reduction]]:
    """Per device, the weight gradients of ``items`` (:func:`_reduced`) grouped by ``which`` group of
    their :class:`_Reduced`."""
    out: dict[int, dict[tuple[int, ...], Reduction]] = defaultdict(lambda: defaultdict(list))
    for r, topo, p in items:
        group = which(r)
        if group or not skip_empty:
            out[r.device][group].append((topo, p, r.nbytes))
    return out


def weight_sharding_groups(d: Draft) -> set[tuple[int, ...]]:
    """The device groups (sorted) along which some weight is split: the tensor-parallel (and expert-
    parallel) ranks of the plan's meshes."""
    out: set[tuple[int, ...]] = set()
    seen: set = set()
    for op, k in d.owner.values():
        lay = d.layouts.needs(op, k)
        if lay in seen:
            continue
        seen.add(lay)
        for a, pl in enumerate(lay.placements):
            if isinstance(pl, Shard) and lay.mesh.shape[a] > 1:
                out.update(tuple(sorted(g)) for g in lay.mesh.group_map((a,)).values())
    return out


def _reductions(
    d: Draft, contrib, target, shape: tuple[int, ...], dims: tuple, batch: str | None, sharding: set | None
) -> tuple[_Reduced, ...]:
    """The reductions (:class:`_Reduced`) of a weight of ``shape`` whose gradient comes in layout
    ``contrib`` and is wanted in ``target`` from an owner splitting ``dims`` along the mesh axes
    (``batch``: its batch dimension), at each position built (none where ``contrib`` is partial
    along no mesh axis where ``target`` is not); ``sharding``: :func:`weight_sharding_groups` (None:
    the whole group is the shard group)."""
    axes = tuple(
        a
        for a, (c, t) in enumerate(zip(contrib.placements, target.placements))
        if isinstance(c, Partial) and not isinstance(t, Partial) and contrib.mesh.shape[a] > 1
    )
    if not axes:
        return ()
    mesh = contrib.mesh
    tp = tuple(
        a
        for a in axes
        if sharding is not None
        and dims[a] != batch
        and any(tuple(sorted(g)) in sharding for g in mesh.group_map((a,)).values())
    )
    dp = tuple(a for a in axes if a not in tp)
    if not dp:  # no data-parallel replicas to shard over: ZeRO shards over the whole group, as before
        tp, dp = (), axes
    out = []
    for flat, dev in d.positions(mesh):
        group = tuple(sorted(mesh.group_of(flat, axes)))
        shard = tuple(sorted(mesh.group_of(flat, dp)))
        tp_group = tuple(sorted(mesh.group_of(flat, tp))) if tp else ()
        out.append(_Reduced(dev, group, shard, tp_group, box_numel(target.box(flat, shape)) * d.precision.grad_bytes))
    return tuple(out)


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
