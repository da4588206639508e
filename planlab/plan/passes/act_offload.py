"""Activation offload: the ``materialize`` pass :func:`offload_activations`, after recomputation.

An operator of offload group ``k`` (``OpPlan.offload``) keeps what its backward saves in host memory,
as Megatron-Core's activation offloading and torch's ``save_on_cpu`` do: after the group's forward,
each of its pieces' saved activations is copied device to host over the host link (``L``,
:attr:`~planlab.plan.program.Role.SAVE_TO_HOST`, writing ``HOST_ACTIVATION`` buffers), which frees
them on the device once the copy is done; ahead of the group's backward (one group's length of
operators earlier, so the copy overlaps the backward of the layer after it) they are copied back
(:attr:`~planlab.plan.program.Role.SAVE_TO_DEVICE`) into ``FETCHED`` buffers, which the group's
backward reads instead. Both copies run on a copy stream of their own (the simulator's
:class:`~planlab.simulator.units.HostCopy`): only what the computation does not cover is exposed.

A buffer moves only when every backward that keeps it belongs to an offloaded group (a layer's
input kept by a layer that is not offloaded stays), once (by the first piece that saves it).
Recomputed and co-located operators keep nothing of their own to offload and are left out.
"""

from __future__ import annotations

from planlab.plan.buffer import Buffer, BufferKind
from planlab.plan.passes.draft import Draft, Part, Parts, SlotKey, add, by_block
from planlab.plan.plan import Action
from planlab.plan.program import Block, Recompute, Role, Task, TaskKind


def offload_activations(d: Draft) -> Draft:
    """Per device and forward block, the copies of the offloaded groups' saved activations to the
    host and back, and their backward reading them back (see the module docstring)."""
    group_of = {
        p.op: p.offload
        for p in d.plan.ops
        if p.offload and not p.recompute and p.op not in d.layouts.chunks and p.op not in d.dead
    }
    if not group_of:
        return d
    names = [op.name for op in d.graph.operators]
    parts, sizes = dict(d.parts), d.copy_sizes()
    backward = by_block(d.parts, "B")
    for (dev, (st, _)), keys in by_block(d.parts, "F").items():
        bkeys = backward.get((dev, (st, "B")), [])
        movable = _movable(parts, bkeys, names, group_of)
        if movable:
            _offload_block(parts, sizes.setdefault(dev, {}), keys, bkeys, names, group_of, movable)
    return d.replace(parts=parts, sizes=sizes)


def _movable(parts: Parts, bkeys: list[SlotKey], names: list[str], group_of: dict[str, int]) -> set[Buffer]:
    """The buffers kept by offloaded backwards and by no other task of the backward block."""
    kept: dict[Buffer, bool] = {}
    for k in bkeys:
        for t in parts[k]:
            offloaded = t.kind is TaskKind.BACKWARD and names[k[2]] in group_of and t.recompute is Recompute.NONE
            for b in t.saved + t.reads:
                if b is not None and not b.static:
                    kept[b] = kept.get(b, True) and offloaded and b in t.saved
    return {b for b, ok in kept.items() if ok}


def _offload_block(parts, sizes, keys, bkeys, names, group_of, movable) -> None:
    """One forward block's copies to the host, its backward block's copies back and renamed reads."""
    fwd = [(k, t) for k in keys if k[3] is Part.COMPUTE and names[k[2]] in group_of for t in parts[k]]
    span: dict[int, list[int]] = {}
    for k, _ in fwd:
        span.setdefault(group_of[names[k[2]]], []).append(k[2])
    back_ops = sorted({k[2] for k in bkeys if k[3] is Part.COMPUTE})
    fetched: dict[Buffer, Buffer] = {}
    taken: set[Buffer] = set()
    for k, t in fwd:
        if t.kind is not TaskKind.FORWARD or t.recompute is not Recompute.NONE:
            continue
        mine = tuple(b for b in t.saved if b in movable and b not in taken and b in sizes)
        if not mine:
            continue
        taken.update(mine)
        on_host = tuple(b.with_kind(BufferKind.HOST_ACTIVATION) for b in mine)
        back = tuple(b.with_kind(BufferKind.FETCHED) for b in mine)
        fetched.update(zip(mine, back))
        for b, f in zip(mine, back):
            sizes[f] = sizes[b]
        nbytes = sum(sizes[b] for b in mine)
        ops = span[group_of[names[k[2]]]]
        dev, (st, _) = k[0], k[1]
        add(parts, dev, (st, "F"), max(ops), Part.AFTER, _copy("save-to-host", t, mine, on_host, nbytes))
        at = _fetch_slot(back_ops, min(ops), max(ops))
        add(parts, dev, (st, "B"), at, Part.PREFETCH, _copy("save-to-device", t, on_host, back, nbytes))
    for k in bkeys:
        parts[k] = tuple(_renamed(t, fetched) for t in parts[k])


def _fetch_slot(back_ops: list[int], first: int, last: int) -> int:
    """The operator whose backward slot issues a group's copy back: the first to run backward
    within one group's length after the group (the layer after it), so the copy overlaps that
    layer's backward; the group's own last operator when none is."""
    ahead = [i for i in back_ops if last <= i <= last + (last - first + 1)]
    return max(ahead, default=last)


def _copy(role: str, t: Task, reads: tuple[Buffer, ...], writes: tuple[Buffer, ...], nbytes: int) -> Task:
    """A copy of piece ``t``'s saved activations between device and host memory."""
    kind = Role.SAVE_TO_HOST if role == "save-to-host" else Role.SAVE_TO_DEVICE
    return Task(f"{role}:{t.name}", TaskKind.LOCAL, reads, writes, op=t.op, chunk=t.chunk, nbytes=nbytes, role=kind)


def _renamed(t: Task, fetched: dict[Buffer, Buffer]) -> Task:
    """A backward task reading the buffers brought back instead of the ones offloaded."""
    if t.kind is not TaskKind.BACKWARD or not any(b in fetched for b in t.saved):
        return t
    return t.but(saved=tuple(fetched.get(b, b) for b in t.saved))


def host_activation_bytes(blocks: dict[tuple[int, str], Block], schedule: tuple[Action, ...]) -> int:
    """Host memory a device's offloaded activations take at most: per stage, the bytes its forward
    copies to the host, held from that forward until the backward that copies them back, summed
    over the micro-batches in flight at once in ``schedule``."""
    per_stage = {
        st: sum(t.nbytes for t in b.tasks if t.role is Role.SAVE_TO_HOST)
        for (st, phase), b in blocks.items()
        if phase == "F"
    }
    held = peak = 0
    for a in schedule:
        if a.phase == "F":
            held += per_stage.get(a.stage, 0)
        elif a.phase in ("B", "I"):
            held -= per_stage.get(a.stage, 0)
        peak = max(peak, held)
    return peak
