"""Activation recomputation: a recompute group's forward runs again before its backward."""

from __future__ import annotations


from planlab.plan.buffer import Buffer, BufferKind
from planlab.plan.passes.draft import Draft, Idents, Part, Parts, SlotKey, add, by_block
from planlab.plan.program import Recompute, TaskKind


def recompute(d: Draft) -> Draft:
    """Per device and recompute group (``OpPlan.recompute``; co-located operators are recomputed
    chunk by chunk by :mod:`planlab.plan.coshard` instead, and a recycling pass without backward
    keeps nothing to recompute): the group's forward tasks run without keeping activations
    (``Recompute.DROP``) and are copied, without their sends and receives, into the backward
    block's slot of the group's last operator (``Part.RECOMPUTE``: before the gradients of its
    outputs), writing ``RECOMPUTED`` buffers that the group's backward tasks keep instead. A copied
    collective is another collective: it takes a new identity, the same on every device. A buffer
    a receive fills (in part: the pieces of a batch-split producer) is not made again: receives are
    not redone, so the copies read it as the forward left it, and a task that writes only such
    buffers is not copied.

    A group whose outputs are discarded too (``Plan.discard_outputs``, Megatron-Core's
    ``CheckpointWithoutOutput``) hands its remade outputs to the operators outside every recompute
    group that read them: their backward keeps the remade buffers instead of the forward's, which
    are then freed once the last of those forwards has read them, and the copies run in the
    backward slot of the latest of those operators (before the first of their backwards)."""
    groups_of = {
        p.op: p.recompute
        for p in d.plan.ops
        if p.recompute and p.op not in d.layouts.chunks and not (d.nograd and p.op in d.dead)
    }
    if not groups_of:
        return d
    discard = frozenset(d.plan.discard_outputs)
    names = [op.name for op in d.graph.operators]
    parts, sizes = dict(d.parts), d.copy_sizes()
    fresh = Idents(d.next_ident)
    for (dev, (st, _)), keys in by_block(d.parts, "F").items():
        received = frozenset(w for k in keys for t in d.parts[k] if t.kind is TaskKind.RECV for w in t.writes if w)
        by_group: dict[int, list[SlotKey]] = {}
        for k in keys:
            g = groups_of.get(names[k[2]])
            if g and k[3] in (Part.INPUTS, Part.COMPUTE) and any(_redone(t, received) for t in d.parts[k]):
                by_group.setdefault(g, []).append(k)
        for g, members in by_group.items():
            readers = _readers(parts, keys, members, names, groups_of, received) if g in discard else ()
            _redo(parts, sizes.setdefault(dev, {}), members, names, fresh, received, readers)
    return d.replace(parts=parts, sizes=sizes, next_ident=fresh.next)


def _redo(
    parts: Parts,
    sizes: dict[Buffer, int],
    members: list[SlotKey],
    names: list[str],
    fresh: Idents,
    received: frozenset[Buffer],
    readers: tuple[int, ...] = (),
) -> None:
    """Mark one group's forward tasks (in the slot parts ``members``, in the order they run) DROP
    and copy them, but their sends and receives and what writes only ``received`` buffers, into
    the backward block; the backward of the operators ``readers`` (indices, outside the group)
    keeps the remade outputs too (see :func:`recompute`)."""
    dev, (st, _), _, _ = members[0]
    tasks = [t for k in members for t in parts[k] if _redone(t, received)]
    remade = {w: w.with_kind(BufferKind.RECOMPUTED) for t in tasks for w in t.writes if w and w not in received}
    for w, r in remade.items():
        if w in sizes:
            sizes[r] = sizes[w]

    def ren(bufs):
        return tuple(remade.get(b, b) if b else b for b in bufs)

    for k in members:
        parts[k] = tuple(
            t.but(recompute=Recompute.DROP, saved=()) if t.kind is TaskKind.FORWARD and _redone(t, received) else t
            for t in parts[k]
        )
    redo = tuple(
        t.but(
            name=f"re:{t.name}",
            reads=ren(t.reads),
            writes=ren(t.writes),
            saved=ren(t.saved),
            recompute=Recompute.REDO,
            ident=fresh(t.ident) if t.ident >= 0 else -1,
        )
        for t in tasks
    )
    add(parts, dev, (st, "B"), max([k[2] for k in members] + list(readers)), Part.RECOMPUTE, *redo)
    for i in {k[2] for k in members} | set(readers):
        k = (dev, (st, "B"), i, Part.COMPUTE)
        if k in parts:
            parts[k] = tuple(
                t.but(saved=ren(t.saved)) if t.kind is TaskKind.BACKWARD and t.op == names[i] else t for t in parts[k]
            )


def _readers(
    parts: Parts,
    keys: list[SlotKey],
    members: list[SlotKey],
    names: list[str],
    groups_of: dict[str, int],
    received: frozenset[Buffer],
) -> tuple[int, ...]:
    """The operators (indices) of a forward block's slots ``keys`` outside every recompute group
    whose forward reads a buffer that the group of slot parts ``members`` writes."""
    made = {w for k in members for t in parts[k] if _redone(t, received) for w in t.writes if w and w not in received}
    return tuple(
        sorted(
            {
                k[2]
                for k in keys
                if k[3] is Part.COMPUTE
                and names[k[2]] not in groups_of
                and any(t.kind is TaskKind.FORWARD and made.intersection(t.reads) for t in parts[k])
            }
        )
    )


def _redone(t, received: frozenset[Buffer]) -> bool:
    """Whether a forward block's task runs again: not a send or receive (the recomputation has the
    data already), nor a task that writes only buffers a receive fills."""
    return t.kind not in (TaskKind.SEND, TaskKind.RECV) and not all(w in received for w in t.writes if w)
