"""The Program under construction: what ``materialize``'s passes read and make.

A :class:`Draft` holds the inputs of one materialization (the plan, the graph, the layouts, the
precision, the devices to build) and what the passes have made so far. Each pass is a function
from a draft to a new draft: it copies the containers it changes (``dict(d.parts)``,
:meth:`Draft.copy_sizes`, :meth:`Draft.copy_blocks`) and returns them with
:meth:`Draft.replace`, so the draft it was given is left as it was and nothing else is touched.

Until the ordering pass, a block is kept per operator: each operator (by its topological index)
has a *slot* in each block, whose tasks come in named :class:`Part` s (``parts[(device, block,
operator, part)]``, tuples: a pass replaces them, never changes them). The ordering pass
(:mod:`planlab.plan.passes.order`) writes each block out as the list of its tasks in the order
they run (:func:`run_order`): a forward block runs its operators in topological order, a backward
block in reverse, and each operator's parts in :class:`Part` order.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from enum import IntEnum
from itertools import product
from typing import Iterable

from planlab.costmodel.software import SoftwareSpec
from planlab.graph.ir import DTYPE_BYTES, Graph, Operator
from planlab.plan import buffer as buf_
from planlab.plan.buffer import Buffer
from planlab.plan.layout import Layout, Mesh, box_numel, positions
from planlab.plan.passes.layouts import Layouts
from planlab.plan.plan import RING_DIM, Plan, causal_attention
from planlab.plan.program import Precision, Ring, Task, TaskKind
from planlab.plan.redistribute import plan_conversion
from planlab.plan.shared_params import forward_only_of, no_grad_of
from planlab.plan.template import BlockMap, block_map

BlockKey = tuple[int, str]  # (stage, phase)


class Part(IntEnum):
    """The parts of an operator's slot in a forward or backward block, and of the update block, in
    the order a block runs them:

    - ``PREFETCH``: ZeRO-3's gathers of a unit's weights, issued as the operator starts;
    - ``RECOMPUTE``: (backward) the forward of the operator's recompute group, run again;
    - ``INPUTS``: (forward) the loads and conversions of its inputs, and the sends of its inputs'
      conversions on the producer's stage; (backward) the local sums and conversions of its
      outputs' gradients, and the sends of them on the consumers' stages;
    - ``COMPUTE``: the forward or backward task of its piece on this device;
    - ``AFTER``: (backward) the gradient reductions its backward completes (a bucket's all-reduce,
      a ZeRO-3 unit's reduce-scatter);
    - the update block's: ``REDUCE`` (gradient all-reduces after the backward, ZeRO-1/2's
      reduce-scatters), ``SHARD_STEPS`` (the optimizer on ZeRO shards), ``STEP`` (the optimizer on
      the weights held whole), ``GATHER`` (ZeRO-1/2's all-gathers of the updated shards).
    """

    PREFETCH = 0
    RECOMPUTE = 1
    INPUTS = 2
    COMPUTE = 3
    AFTER = 4
    REDUCE = 5
    SHARD_STEPS = 6
    STEP = 7
    GATHER = 8


# (device, block, operator's topological index (0 in the update block), part)
SlotKey = tuple[int, BlockKey, int, Part]
Parts = dict[SlotKey, tuple[Task, ...]]


class Names:
    """The buffers every device names alike (a parameter's pieces and their gradients, a tensor as
    its producer makes it and its gradient, a consumer's contribution to it), each made once per
    materialization, when first named: the passes share one object where each device would make
    its own (a memo of values: a buffer is the same whoever makes it)."""

    def __init__(self) -> None:
        self._made: dict[tuple, Buffer] = {}
        # one tensor's buffer of each kind, a dict per kind (no key to build per call)
        self._weights: dict[str, Buffer] = {}
        self._weight_grads: dict[str, Buffer] = {}
        self._activations: dict[str, Buffer] = {}
        self._grads: dict[str, Buffer] = {}

    def _get(self, key: tuple, make) -> Buffer:
        got = self._made.get(key)
        if got is None:
            got = self._made[key] = make(*key[1:])
        return got

    def weight(self, param: str) -> Buffer:
        got = self._weights.get(param)
        return got if got is not None else self._weights.setdefault(param, buf_.weight(param))

    def weight_grad(self, param: str) -> Buffer:
        got = self._weight_grads.get(param)
        return got if got is not None else self._weight_grads.setdefault(param, buf_.weight_grad(param))

    def activation(self, tensor: str) -> Buffer:
        got = self._activations.get(tensor)
        return got if got is not None else self._activations.setdefault(tensor, buf_.activation(tensor))

    def grad(self, tensor: str) -> Buffer:
        got = self._grads.get(tensor)
        return got if got is not None else self._grads.setdefault(tensor, buf_.grad(tensor))

    def contribution(self, tensor: str, consumer: str, index: int) -> Buffer:
        return self._get(("gc", tensor, consumer, index), buf_.contribution)


@dataclass(frozen=True)
class Draft:
    """A Program under construction (see the module docstring).

    Inputs: ``plan``, ``graph``, ``layouts``, ``precision``, ``keep`` (the devices to build; None:
    all), ``overlap`` (gradient buckets overlapped with the backward), ``software`` (the training
    software whose implementation decides what is kept, the bucket size and ZeRO-3's gathers; None:
    planlab's own), and what follows from them:
    ``topo`` (each operator's topological index), ``stage`` (each operator's stage), ``nograd``
    (tensors a detach cuts off from the loss), ``forward_only`` (operators without a backward
    because of it), ``names``, the buffers every device names alike (:class:`Names`), and ``repeats``,
    the repeated blocks the piece passes build once and map (:mod:`planlab.plan.template`).

    Products: ``parts``, the tasks of each part of each operator's slot in each device's block
    (until the ordering pass), then ``blocks`` per device and block (task lists in order);
    ``sizes`` (bytes of each buffer a device allocates); ``params`` (the pieces of parameters each
    device holds); ``owner`` (per parameter, the operator and input
    index whose backward makes its gradient); ``reads`` (per operator, the buffer each input is read
    from); ``saved`` (per operator, what its backward keeps from its forward); ``piece_shapes``
    (per operator, its pieces' local shapes); ``grads`` (per operator, the gradient buffer of each
    output, None where it gets none); ``dead`` (operators without a backward); ``sharded`` (per
    device, the parameters kept in ZeRO shards); ``zero_saved`` (per device, the bytes of
    gradients, optimizer states and weights ZeRO no longer holds whole); ``together`` (per device,
    groups of buffers freed at once); ``next_channel``, ``next_tag`` and ``next_ident``: the first
    conversion channel, message tag and collective identity not yet used.
    """

    plan: Plan
    graph: Graph
    layouts: Layouts
    precision: Precision
    keep: frozenset[int] | None
    overlap: bool
    software: SoftwareSpec | None
    topo: dict[str, int]
    stage: dict[str, int]
    nograd: frozenset[str]
    forward_only: frozenset[str]
    names: Names
    repeats: BlockMap
    parts: Parts = field(default_factory=dict)
    blocks: dict[int, dict[BlockKey, list[Task]]] = field(default_factory=dict)
    sizes: dict[int, dict[Buffer, int]] = field(default_factory=dict)
    params: dict[int, tuple[tuple[str, tuple], ...]] = field(default_factory=dict)
    owner: dict[str, tuple[Operator, int]] = field(default_factory=dict)
    reads: dict[str, tuple[Buffer, ...]] = field(default_factory=dict)
    saved: dict[str, tuple[Buffer, ...]] = field(default_factory=dict)
    piece_shapes: dict[str, tuple[tuple[int, ...], ...]] = field(default_factory=dict)
    grads: dict[str, tuple[Buffer | None, ...]] = field(default_factory=dict)
    dead: frozenset[str] = frozenset()
    sharded: dict[int, frozenset[str]] = field(default_factory=dict)
    zero_saved: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    together: dict[int, tuple[tuple[Buffer, ...], ...]] = field(default_factory=dict)
    next_channel: int = 0
    next_tag: int = 0
    next_ident: int = 0

    @classmethod
    def start(
        cls,
        plan: Plan,
        graph: Graph,
        layouts: Layouts,
        precision: Precision,
        *,
        keep: frozenset[int] | None,
        overlap: bool,
        software: SoftwareSpec | None = None,
    ) -> Draft:
        """The draft before any pass: the inputs and what follows from them."""
        # recycling: what a detach cuts off from the loss (empty without one); the graph's, kept by it
        nograd = no_grad_of(graph)
        return cls(
            plan=plan,
            graph=graph,
            layouts=layouts,
            precision=precision,
            keep=keep,
            overlap=overlap,
            software=software,
            topo=graph.memo(("topological_index",), lambda: {op.name: i for i, op in enumerate(graph.operators)}),
            stage={p.op: p.stage for p in plan.ops},
            nograd=nograd,
            forward_only=forward_only_of(graph),
            names=Names(),
            repeats=block_map(graph, layouts),
        )

    @property
    def microbatches(self) -> int:
        return self.plan.microbatches

    def positions(self, mesh: Mesh) -> Iterable[tuple[int, int]]:
        """``(flat, device)`` of a mesh's devices being built."""
        return positions(mesh, self.keep)

    def elem_bytes(self, tensor: str) -> int:
        """Bytes per element of ``tensor`` (activations in the precision's width)."""
        spec = self.graph.tensors[tensor]
        return self.precision.activation_bytes if spec.is_float else DTYPE_BYTES.get(spec.dtype, 4)

    def copy_blocks(self) -> dict[int, dict[BlockKey, list[Task]]]:
        """A copy of ``blocks`` whose task lists a pass may change."""
        return {dev: {key: list(tasks) for key, tasks in blocks.items()} for dev, blocks in self.blocks.items()}

    def copy_sizes(self) -> dict[int, dict[Buffer, int]]:
        """A copy of ``sizes`` a pass may add to."""
        return {dev: dict(s) for dev, s in self.sizes.items()}

    def replace(self, **changes) -> Draft:
        """This draft with ``changes`` (what a pass made)."""
        return dataclasses.replace(self, **changes)


def add(parts: Parts, dev: int, key: BlockKey, op_index: int, part: Part, *tasks: Task) -> None:
    """Append ``tasks`` to a part of operator ``op_index``'s slot in ``dev``'s block ``key``."""
    k = (dev, key, op_index, part)
    parts[k] = parts.get(k, ()) + tasks


def update_blocks(d: Draft) -> dict[int, BlockKey]:
    """Each device's update block: it runs once per iteration, in the device's first stage (the
    lowest of its blocks; 0 for a device without any)."""
    first: dict[int, int] = {}
    for dev, (st, _) in {k[:2] for k in d.parts}:  # each (device, block) once
        if st < first.get(dev, st + 1):
            first[dev] = st
    return {dev: (first.get(dev, 0), "U") for dev in set(first) | set(d.params)}


def by_block(parts: Parts, phases: str = "FB") -> dict[tuple[int, BlockKey], list[SlotKey]]:
    """The keys of ``parts`` in blocks of ``phases``, grouped by (device, block), each group in the
    order the block runs them (operators in topological order in a forward block, in reverse in
    a backward one; parts in :class:`Part` order)."""
    out: dict[tuple[int, BlockKey], list[SlotKey]] = {}
    for k in parts:
        if k[1][1] in phases:
            out.setdefault((k[0], k[1]), []).append(k)
    for (_, key), keys in out.items():
        keys.sort(key=run_order)
    return out


def run_order(k: SlotKey) -> tuple[int, int]:
    """Where a slot part runs in its block: operators in topological order in a forward block, in
    reverse in a backward one (and its ``I``/``W`` parts), then parts in :class:`Part` order."""
    return (k[2] if k[1][1] == "F" else -k[2], k[3])


def shares(d: Draft, op: Operator) -> tuple[int, int]:
    """How many pieces ``op`` is split into, and the micro-batches: what divides its work."""
    return d.layouts.form(op).pieces, d.microbatches


def piece_task(
    op: Operator, kind: TaskKind | Task, flat: int, reads: tuple, writes: tuple, flops: float, share: tuple, **fields
) -> Task:
    """The ``kind`` task (forward or backward) of ``op``'s piece at position ``flat`` of its mesh:
    ``flops`` (the whole operator's, for the whole batch) and its memory traffic divided by its
    ``share`` (:func:`shares`: its pieces, then micro-batches). ``kind`` may be a :func:`piece_base`
    instead, the fields the piece shares with others at its position (``flat`` is then its ``coord``):
    the task is that one's copy with the piece's own fields, made without checking them again
    (materialize makes tens of thousands of pieces at cluster scale)."""
    own = piece_fields(op, reads, writes, flops, share, **fields)
    if isinstance(kind, Task):
        return kind.with_changes(own)
    return Task(kind=kind, coord=flat, **own)


def piece_fields(op: Operator, reads: tuple, writes: tuple, flops: float, share: tuple, **fields) -> dict:
    """The fields of ``op``'s pieces that are the operator's own, alike at every position (see
    :func:`piece_task`): a pass makes them once per operator and copies a :func:`piece_base` with them
    (:meth:`~planlab.plan.program.Task.with_changes`) at each position."""
    pieces, m = share
    return dict(
        name=op.name,
        reads=reads,
        writes=writes,
        op=op.name,
        flops=flops / pieces / m,
        bytes_moved=op.bytes_moved / pieces / m,
        op_kind=op.kind,
        causal=op.kind == "attention" and causal_attention(op),
        **fields,
    )


def piece_base(kind: TaskKind, flat: int, **fields) -> Task:
    """What the ``kind`` tasks of pieces at position ``flat`` share besides their operator's own
    fields (for :func:`piece_task`): ``fields`` such as their local shapes, lead or group."""
    return Task("", kind, coord=flat, **fields)


def record_size(sizes: dict[int, dict[Buffer, int]], dev: int, task: Task, elem_bytes: int) -> None:
    """Register the bytes of the buffers ``task`` writes on ``dev`` (unless known already):
    its local shape times ``elem_bytes`` (static buffers are counted apart)."""
    mine = sizes.setdefault(dev, {})
    for w in task.writes:
        if w and not w.static and task.shape is not None:
            mine.setdefault(w, math.prod(task.shape) * elem_bytes)


def line(mesh: Mesh, flat: int, axes: list[int]) -> tuple[int, ...]:
    """The devices of ``mesh`` whose coordinates differ from ``flat``'s along ``axes`` only, in
    row-major order of those axes; () without such axes (or when they are of size one)."""
    if not axes or math.prod(mesh.shape[a] for a in axes) == 1:
        return ()
    base = list(mesh.coord(flat))
    out = []
    for idx in product(*(range(mesh.shape[a]) for a in axes)):
        for a, j in zip(axes, idx):
            base[a] = j
        out.append(mesh.devices[mesh.flat(tuple(base))])
    return tuple(out)


@dataclass
class Counters:
    """The next conversion channel, message tag and collective identity a pass gives out."""

    channel: int
    tag: int
    ident: int

    @classmethod
    def of(cls, d: Draft) -> Counters:
        return cls(d.next_channel, d.next_tag, d.next_ident)

    def fields(self) -> dict[str, int]:
        """The draft fields that carry them on."""
        return dict(next_channel=self.channel, next_tag=self.tag, next_ident=self.ident)


def convert(
    d: Draft,
    parts: Parts,
    sizes: dict[int, dict[Buffer, int]],
    counters: Counters,
    have: Layout,
    need: Layout,
    tensor: str,
    bufs: tuple[Buffer, Buffer],
    at: tuple[BlockKey, BlockKey, int],
    accumulate: bool = False,
    name: str = "",
) -> None:
    """Plan the conversion of ``tensor`` from layout ``have`` (buffer ``bufs[0]``) into ``need``
    (``bufs[1]``, added into with ``accumulate``) for the devices built
    (:func:`~planlab.plan.redistribute.plan_conversion`, with the next channel, tags and
    identities of ``counters``) and put its tasks in slot ``at[2]``'s ``INPUTS``: the sending
    side's in block ``at[0]``, the receiving side's in ``at[1]``."""
    eb = d.elem_bytes(tensor)
    conv = plan_conversion(
        have,
        need,
        d.layouts.shapes[tensor],
        eb,
        src_buf=bufs[0],
        dst_buf=bufs[1],
        accumulate=accumulate,
        first_tag=counters.tag,
        name=name,
        dtype=d.graph.tensors[tensor].dtype,
        only=d.keep,
        channel=counters.channel,
        ident=counters.ident,
        memo=d.graph.memo(("conversions",), dict),
    )
    counters.channel, counters.tag, counters.ident = (
        counters.channel + 1,
        counters.tag + conv.tags,
        counters.ident + conv.idents,
    )
    for side, key in (("src", at[0]), ("dst", at[1])):
        for dev, tasks in getattr(conv, side).items():
            add(parts, dev, key, at[2], Part.INPUTS, *tasks)
            for task in tasks:
                record_size(sizes, dev, task, eb)


class Idents:
    """The collective identities one pass gives out: ``first``, ``first + 1``, ... one per key (a
    value every device taking part in the collective computes alike), in the order keys are first
    seen; ``next`` is the first identity left."""

    def __init__(self, first: int) -> None:
        self.first = first
        self.table: dict[object, int] = {}

    def __call__(self, key: object) -> int:
        got = self.table.get(key)
        if got is None:
            got = self.table[key] = self.first + len(self.table)
        return got

    @property
    def next(self) -> int:
        return self.first + len(self.table)


def ring_fields(d: Draft, op: Operator, flat: int) -> dict:
    """The fields of the forward and backward tasks of piece ``flat`` of a ring attention (``OpPlan.ring``):
    its ring, the devices along the mesh axis that splits its queries' sequence in chunk order
    (``group``), and its :class:`Ring`; empty for any other operator."""
    L = d.layouts
    if not L.op_plan[op.name].ring:
        return {}
    group = line(L.mesh[op.name], flat, [L.dims[op.name].index(RING_DIM)])
    ring = Ring(len(group), causal_attention(op), zigzag=L.zigzag is not None, gather=L.kv_gather)
    return {"group": group, "ring": ring} if group else {}


# key/value blocks a ring attention's piece holds besides its own while it runs: forward, the block
# in use and the one arriving; backward, those two and the key/value gradients travelling with them
RING_BLOCKS_IN_FLIGHT = {TaskKind.FORWARD: 2, TaskKind.BACKWARD: 4}


def ring_in_flight(op: str, kind: TaskKind) -> Buffer:
    """The internal buffer that stands for the key/value blocks in flight in a ring attention's
    ``kind`` task (allocated and freed by that task: liveness)."""
    return buf_.internal(op, f"ring-{kind.value}")


def record_ring_in_flight(d: Draft, sizes: dict, dev: int, op: Operator, flat: int, kind: TaskKind) -> None:
    """Size the key/value blocks in flight (:func:`ring_in_flight`) of piece ``flat`` of a ring attention."""
    L = d.layouts
    block = sum(
        box_numel(L.needs(op, k).box(flat, L.shapes[op.inputs[k]])) * d.elem_bytes(op.inputs[k]) for k in (1, 2)
    )
    p = L.op_plan[op.name]
    gathered = math.prod(s for x, s in zip(p.dims, p.sizes) if x == RING_DIM) if L.kv_gather else 0
    sizes.setdefault(dev, {})[ring_in_flight(op.name, kind)] = blocks_in_flight(kind, block, gathered)


def blocks_in_flight(kind: TaskKind, block: int, gathered: int = 0) -> int:
    """Bytes of the key/value blocks (``block`` bytes each) a ring attention's ``kind`` task holds besides its
    own: :data:`RING_BLOCKS_IN_FLIGHT` passed around a ring; with an all-gather ring of ``gathered`` devices
    (0: none), all of theirs, and in the backward their gradients too before the reduce-scatter."""
    if not gathered:
        return RING_BLOCKS_IN_FLIGHT[kind] * block
    return (1 if kind is TaskKind.FORWARD else 2) * gathered * block
