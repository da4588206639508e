"""Liveness and the finished Program: when each buffer is allocated and freed, each device's
schedule and static memory, the loss holders."""

from __future__ import annotations

from collections import defaultdict

from planlab.plan.buffer import Buffer, BufferKind
from planlab.plan.layout import Replicate, box_numel
from planlab.plan.passes.draft import RING_BLOCKS_IN_FLIGHT, Draft, ring_in_flight
from planlab.plan.passes.order import as_blocks, block_order, schedule_of
from planlab.plan.passes.act_offload import host_activation_bytes
from planlab.plan.passes.offload import host_bytes_per_param
from planlab.plan.program import Block, DeviceProgram, Program, Role, TaskKind
from planlab.plan.saved import CAST_WEIGHT_BYTES, cached_fp8_weights


def assemble(d: Draft) -> Program:
    """The Program of the devices built: per device its blocks with each task's allocations and
    frees (:func:`liveness`), its schedule (:func:`~planlab.plan.passes.order.schedule_of`), its
    pieces of parameters and its static bytes (weights, gradients and optimizer states, less what
    ZeRO shards, and, offloaded, the optimizer states and the activations, which live in host memory:
    ``host_bytes``; the weights' FP8 casts a software keeps across micro-batches:
    ``cast_weight_bytes``); the collective groups; the devices holding the loss."""
    return assemble_bare(d, frozenset())[0]


def assemble_bare(d: Draft, bare: frozenset[int]) -> tuple[Program, dict[int, tuple[dict, dict]]]:
    """:func:`assemble`, but the devices in ``bare`` keep their tasks without allocations and frees:
    their lifetimes (:func:`lifetimes`) come apart, per device. A symmetric build's witnesses
    (:func:`planlab.plan.symmetry.reduce_program` compares them with their representatives and drops
    them) need no copy of every task to carry them."""
    plan, pr = d.plan, d.precision
    lives: dict[int, tuple[dict, dict]] = {}
    programs = []
    groups: set[tuple[int, ...]] = set()
    checked: dict = {}
    # the lifetimes found so far, with what they were found from: a class's members (a representative
    # and its witness) name the same buffers in the same tasks, so their lifetimes are found once
    found: list[tuple[list, dict, tuple, tuple]] = []
    cached = cached_fp8_weights(d.graph, d.software, pr)  # kept FP8 casts of these weights (static)
    for dev in range(plan.num_devices) if d.keep is None else sorted(d.keep):
        blocks = as_blocks(d.blocks.get(dev, {}))
        groups.update(tuple(sorted(t.group)) for b in blocks.values() for t in b.tasks if t.group)
        schedule = schedule_of(plan, dev, blocks, checked)
        sizes, together, read = d.sizes.get(dev, {}), d.together.get(dev, ()), liveness_inputs(blocks)
        life = next((f[3] for f in found if f[0] == read and f[2] == together and f[1] == sizes), None)
        if life is None:
            life = lifetimes(blocks, sizes, together)
            found.append((read, sizes, together, life))
        if dev in bare:
            lives[dev] = life
        else:
            blocks = with_lifetimes(blocks, life)
        params = d.params.get(dev, ())
        nparams = sum(box_numel(b) for _, b in params)
        saved_grads, saved_states, saved_weights = d.zero_saved.get(dev, (0, 0, 0))
        offloaded = sum(t.params for b in blocks.values() for t in b.tasks if t.role is Role.HOST_STEP)
        programs.append(
            DeviceProgram(
                device=dev,
                blocks=blocks,
                schedule=schedule,
                params=tuple(params),
                param_bytes=nparams * pr.param_bytes - saved_weights,
                grad_bytes=nparams * pr.grad_bytes - saved_grads,
                optimizer_bytes=0 if offloaded else nparams * pr.optimizer_bytes - saved_states,
                host_bytes=int(offloaded * host_bytes_per_param(pr)) + host_activation_bytes(blocks, schedule),
                cast_weight_bytes=CAST_WEIGHT_BYTES * sum(box_numel(b) for p, b in params if p in cached),
            )
        )
    lay = d.layouts.has(d.graph.producer[d.graph.loss], 0)
    holders = []
    for flat, dev in enumerate(lay.mesh.devices):
        c = lay.mesh.coord(flat)
        primary = all(c[a] == 0 for a, p in enumerate(lay.placements) if isinstance(p, Replicate))
        holders.append((dev, d.names.activation(d.graph.loss), int(primary)))
    program = Program(
        devices=tuple(programs),
        microbatches=plan.microbatches,
        precision=pr,
        groups=tuple(sorted(g for g in groups if len(g) > 1)),
        loss_holders=tuple(holders),
    )
    return program, lives


def liveness(blocks: dict, sizes: dict[Buffer, int], together: tuple | list = ()) -> dict:
    """``blocks`` with each task's ``alloc``/``free`` filled (:func:`lifetimes`)."""
    return with_lifetimes(blocks, lifetimes(blocks, sizes, together))


def liveness_inputs(blocks: dict) -> list:
    """What :func:`lifetimes` reads of ``blocks`` besides the sizes: per block in order, each task's
    kind, operator, ring and buffers (two devices alike in these have the same lifetimes)."""
    return [
        (bk, [(t.kind, t.op, t.ring, t.reads, t.writes, t.saved) for t in blocks[bk].tasks])
        for bk in sorted(blocks, key=block_order)
    ]


def lifetimes(blocks: dict, sizes: dict[Buffer, int], together: tuple | list = ()) -> tuple[dict, dict]:
    """Where each buffer is allocated (with its bytes) and freed, by the position of the task in
    the walk of ``blocks`` in order: a buffer is allocated by its first writer (an internal buffer,
    :mod:`planlab.plan.saved`, by the forward task that keeps it, or by zero-bubble's ``I`` task
    that makes the FP8 casts of its output gradients for its ``W``,
    :mod:`planlab.plan.backward_split`) and freed after its last reader, in the canonical block
    order (:func:`~planlab.plan.passes.order.block_order`), which every valid schedule preserves
    per micro-batch. Each group of buffers in ``together`` is
    freed at once, after the last reader of any of them (ZeRO-3 frees a layer's gathered weights
    together). Static buffers (weights, their gradients, shards, sources) live all along."""
    order = sorted(blocks, key=block_order)
    # positions are numbered across the blocks in that order: a task's is its index in the walk
    first: dict[Buffer, int] = {}
    last: dict[Buffer, int] = {}
    forward, internal, keep = TaskKind.FORWARD, BufferKind.INTERNAL, Role.KEEP_GRAPH
    pos = 0
    for bk in order:
        for t in blocks[bk].tasks:
            made = t.writes
            saved = t.saved
            if saved and (t.kind is forward or t.role is keep):  # internals kept from here (zero-bubble's I: FP8 casts)
                made = made + tuple(b for b in saved if b.kind is internal)
            for b in made:
                if b and not b.static and b not in first:
                    first[b] = pos
                    if b not in last:
                        last[b] = pos
            if t.ring is not None and t.kind in RING_BLOCKS_IN_FLIGHT:  # held while the task runs
                b = ring_in_flight(t.op, t.kind)
                if b not in first:
                    first[b] = pos
                    if b not in last:
                        last[b] = pos
            for b in t.reads:
                if b and not b.static:
                    last[b] = pos
            for b in saved:
                if b and not b.static:
                    last[b] = pos
            pos += 1
    for bufs in together:
        at = max((last[b] for b in bufs if b in last), default=None)
        for b in bufs:
            if b in last:
                last[b] = at
    allocs: dict[int, list] = defaultdict(list)
    frees: dict[int, list] = defaultdict(list)
    for b, at in first.items():
        allocs[at].append((b, sizes.get(b, 0)))
    for b, at in last.items():
        frees[at].append(b)
    return {at: tuple(a) for at, a in allocs.items()}, {at: tuple(f) for at, f in frees.items()}


def with_lifetimes(blocks: dict, life: tuple[dict, dict]) -> dict:
    """``blocks`` with each task's ``alloc`` and ``free`` from :func:`lifetimes`."""
    allocs, frees = life
    order = sorted(blocks, key=block_order)
    out = {}
    pos = 0
    for bk in order:
        tasks = []
        for t in blocks[bk].tasks:
            a, f = allocs.get(pos), frees.get(pos)
            if a or f:
                t = t.with_memory(a or (), f or ())
            tasks.append(t)
            pos += 1
        out[bk] = Block(bk[0], bk[1], tuple(tasks))
    return out
