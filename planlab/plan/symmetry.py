"""Device classes from the plan alone, and the Program reduced to their representatives.

At cluster scale most devices are copies of each other: data-parallel replicas,
tensor-parallel peers, and the members of a stage that every device shares (an interlaced
pipeline's embedding and output layer, an alpa stage's all-to-all exchanges).
:func:`plan_classes` groups devices by their position relative to their groups (the meshes
they belong to, how the groups along each mesh axis spread over nodes, their schedule)
without building anyone's tasks; ``materialize(..., symmetric=True)`` then builds tasks for one
representative per class and one more member, and :func:`reduce_program` checks the two agree
before it keeps the representatives only. They agree when their programs are the same with
each peer named relative to the device: by its class and whether it shares the device's node,
a run of messages sent (or received) back to back compared as a set, since the simulator starts
a run's sends at once and ends a run of receives with its last arrival (materialize puts a
receiver's own pieces after the messages, at the same place on every member). When they do not
agree, the caller builds every device's tasks instead.

The simulator runs the representatives; a representative's messages to the members of a class
of as many devices go through the port of that class's representative (the members receive as
many messages at the same times), so the reduced and the full simulations agree
(tests/test_symmetry.py). Not yet with a software whose host issue time bounds the device's
(``CostModel.host_bound``, Megatron-LM's): a collective inside one class joins the segment of tasks
around it, while the full simulation meets it apart, which moves the host's issue times.
"""

from __future__ import annotations

from collections import Counter
from itertools import combinations
from typing import Callable, Iterable

from planlab.plan.layout import Mesh
from planlab.plan.passes.order import block_order
from planlab.plan.plan import Plan
from planlab.plan.program import DeviceProgram, Program, TaskKind


def _spread(group: Iterable[int], node_of: Callable[[int], int]) -> tuple[int, ...]:
    """How a group spreads over nodes: its members per node, sorted."""
    return tuple(sorted(Counter(node_of(d) for d in group).values()))


def _mesh_roles(mesh: Mesh, node_of: Callable[[int], int]) -> list[tuple]:
    """Per mesh position, the node spread of its group along every set of (non-trivial) mesh axes."""
    axes = [a for a, s in enumerate(mesh.shape) if s > 1]
    roles: list[list] = [[] for _ in mesh.devices]
    for k in range(1, len(axes) + 1):
        for subset in combinations(axes, k):
            spread = {key: _spread(g, node_of) for key, g in mesh.group_map(subset).items()}
            for flat, c in enumerate(mesh._coords):
                roles[flat].append(spread[tuple(x for a, x in enumerate(c) if a not in subset)])
    return [tuple(r) for r in roles]


def plan_classes(plan: Plan, meshes: Iterable[Mesh], node_of: Callable[[int], int]) -> tuple[int, ...]:
    """``classes[d]``: the lowest device whose share of the plan matches device ``d``'s.

    ``meshes`` are the operators' meshes in graph order. Two devices match when they
    sit in the same meshes, their groups along each set of mesh axes spread over nodes
    alike, the devices at their positions in the neighbouring mesh (where data moves
    between stages) are on their node or not alike, and their schedules are equal.
    """
    order = list(meshes)
    unique = list(dict.fromkeys(order))
    index = {m: i for i, m in enumerate(unique)}
    parts: list[list] = [[] for _ in range(plan.num_devices)]
    for i, mesh in enumerate(unique):
        for flat, role in enumerate(_mesh_roles(mesh, node_of)):
            parts[mesh.devices[flat]].append((i, role))
    partners: list[list[int]] = [[] for _ in range(plan.num_devices)]
    for a, b in dict.fromkeys((x, y) for x, y in zip(order, order[1:]) if x != y):
        if a.shape != b.shape:
            continue
        for da, db in zip(a.devices, b.devices):
            same = node_of(da) == node_of(db)
            parts[da].append(("to", index[b], same))
            parts[db].append(("from", index[a], same))
            partners[da].append(db)
            partners[db].append(da)
    schedule = plan.schedule or ()
    by_object: dict[int, int] = {}  # a schedule object shared by many devices is hashed once
    distinct: dict[tuple, int] = {}
    first: dict = {}
    out = []
    for d in range(plan.num_devices):
        sched = schedule[d] if d < len(schedule) else ()
        k = by_object.get(id(sched))
        if k is None:
            k = by_object[id(sched)] = distinct.setdefault(tuple(sched), len(distinct))
        key = (tuple(parts[d]), k)
        out.append(first.setdefault(key, d))
    return _refined(out, partners)


def _refined(classes: list[int], partners: list[list[int]]) -> tuple[int, ...]:
    """``classes`` split until the devices of a class pass data to and from devices of the same
    classes. DualPipe's mirrored ranks (r and pp - 1 - r hold the same two stages, in opposite
    directions) look alike by their meshes, but the middle pair exchange messages, which a class
    cannot (:mod:`planlab.simulator.classes`), so the mirror symmetry must not merge them."""
    while True:
        first: dict = {}
        new = [first.setdefault((classes[d], tuple(classes[p] for p in partners[d])), d) for d in range(len(classes))]
        if len(first) == len(set(classes)):
            return tuple(new)
        classes = new


def _row(key, t, peer, group, alloc, free) -> tuple:
    """One task of an outline: what it does, with its peer or group named by class, and its
    allocations and frees (``alloc``, ``free``: its own, or those its device's lifetimes give it)."""
    return (
        key,
        t.kind,
        t.op,
        t.collective,
        group,
        peer,
        t.channel,
        t.nbytes,
        t.flops,
        t.bytes_moved,
        t.shape,
        t.recompute,
        tuple([n for _, n in alloc]),
        len(free),
    )


# Messages issued back to back: the simulator starts every send of a run at once (their flows share
# links fairly whatever their order) and a run of receives ends when the last message has arrived,
# so the order inside a run does not change a prediction; a device's peers in it, named relative
# to the device, come in another order on every member of a class (all-to-all exchanges).
_RUNS = (TaskKind.SEND, TaskKind.RECV)


def _outline(
    dp: DeviceProgram,
    classes: tuple[int, ...],
    node_of: Callable[[int], int],
    groups: dict,
    life: tuple[dict, dict] | None = None,
) -> tuple:
    """A device's program with its peers named relative to it: by their classes and whether they
    share its node, the messages of a run of sends (or of receives) as a sorted run (``groups``
    caches the outline of each collective group). ``life``: the lifetimes of a device built without
    its tasks' allocations and frees (:func:`~planlab.plan.passes.liveness.assemble_bare`), which
    give each task those :func:`~planlab.plan.passes.liveness.with_lifetimes` would."""
    me = node_of(dp.device)
    out: list = [dp.schedule, dp.static_bytes]
    allocs, frees = life if life is not None else ({}, {})
    start = {}  # the lifetimes' position of each block's first task (they walk the blocks in block order)
    pos = 0
    for key in sorted(dp.blocks, key=block_order):
        start[key] = pos
        pos += len(dp.blocks[key].tasks)
    for key in sorted(dp.blocks):
        run: list = []
        run_kind = None
        for at, t in enumerate(dp.blocks[key].tasks, start[key]):
            if run and t.kind is not run_kind:
                out.append(_run(run))
                run = []
            peer = (classes[t.peer], node_of(t.peer) == me) if t.peer >= 0 else None
            group = None
            if t.group:
                group = groups.get(t.group)
                if group is None:
                    group = groups[t.group] = (tuple(sorted(classes[d] for d in t.group)), _spread(t.group, node_of))
            if life is None:
                row = _row(key, t, peer, group, t.alloc, t.free)
            else:
                row = _row(key, t, peer, group, allocs.get(at, ()), frees.get(at, ()))
            if t.kind in _RUNS:
                run.append(row)
                run_kind = t.kind
            else:
                out.append(row)
        if run:
            out.append(_run(run))
    return tuple(out)


def _run(rows: list[tuple]) -> tuple:
    """A run of messages as a set: its rows sorted, and the bytes its tasks allocate apart (the first
    receive of a buffer allocates it, whichever peer's message it is: the run's peak is the same)."""
    allocs = sorted(n for r in rows for n in r[12])
    return tuple(sorted((r[:12] + r[13:] for r in rows), key=repr)), tuple(allocs)


def reduce_program(
    program: Program,
    classes: tuple[int, ...],
    witnesses: dict[int, int],
    node_of: Callable[[int], int],
    lives: dict[int, tuple[dict, dict]] | None = None,
) -> Program | None:
    """The Program of the representatives alone, or None when a witness (another member of
    a class) differs from its representative or the classes' messages do not pair up. ``lives``:
    the lifetimes of the witnesses built without their tasks' allocations and frees
    (:func:`~planlab.plan.passes.liveness.assemble_bare`)."""
    by_dev = {dp.device: dp for dp in program.devices}
    lives = lives or {}
    groups: dict = {}
    for rep, other in witnesses.items():
        if by_dev[rep].schedule != by_dev[other].schedule or _outline(
            by_dev[rep], classes, node_of, groups, lives.get(rep)
        ) != _outline(by_dev[other], classes, node_of, groups, lives.get(other)):
            return None
    reps = sorted(set(classes))
    balance: Counter = Counter()  # per (sender class, receiver class, channel): sends - receives per micro-batch
    for r in reps:
        for block in by_dev[r].blocks.values():
            for t in block.tasks:
                if t.kind is TaskKind.SEND:
                    balance[(r, classes[t.peer], t.channel)] += 1
                elif t.kind is TaskKind.RECV:
                    balance[(classes[t.peer], r, t.channel)] -= 1
    if any(balance.values()):
        return None
    keep = tuple(by_dev[r] for r in reps)
    groups = {tuple(sorted(t.group)) for dp in keep for b in dp.blocks.values() for t in b.tasks if len(t.group) > 1}
    return Program(
        devices=keep,
        microbatches=program.microbatches,
        precision=program.precision,
        groups=tuple(sorted(groups)),
        loss_holders=program.loss_holders,
        classes=classes,
    )
