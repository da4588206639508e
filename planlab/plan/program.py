"""The Program: per device, blocks of tasks and the schedule that runs them.

A Program is plain data consumed by both the simulator and the executor.
Each device holds blocks keyed by ``(stage, phase)``; a block's tasks are the
same for every micro-batch (buffers other than weights are per micro-batch).
The device's schedule lists :class:`~planlab.plan.plan.Action` s naming the
block and micro-batch to run next.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from planlab.enums import StrEnum
from planlab.costmodel.precision import FP32, MIXED_BF16, Precision  # noqa: F401 (re-exported)
from planlab.costmodel.software import Fusion
from planlab.plan.buffer import Buffer
from planlab.plan.layout import Box
from planlab.plan.plan import Action
from planlab.errors import InternalError


class TaskKind(StrEnum):
    """Kinds of task, with short codes as in pipelining's F/B/W."""

    FORWARD = "F"
    BACKWARD = "B"
    COLLECTIVE = "C"
    SEND = "S"
    RECV = "R"
    LOCAL = "L"
    OPTIMIZER = "O"

    @property
    def stream(self) -> str:
        """The stream a task runs on: ``compute`` or ``comm``."""
        return "comm" if self in (TaskKind.COLLECTIVE, TaskKind.SEND, TaskKind.RECV) else "compute"


class Role(StrEnum):
    """What a task does within its kind where the executor runs it differently (short codes)."""

    PLAIN = ""  # the kind says it all: a piece's forward or backward, a layout conversion, a copy, a step
    LOAD = "load"  # LOCAL: a micro-batch's slice (along ``axis``) of a source tensor
    BUCKET = "bucket"  # COLLECTIVE all_reduce: weight gradients summed as one flat buffer
    SHARD_GRADS = "shard-grads"  # COLLECTIVE reduce_scatter: a ZeRO-1/2 bucket's gradients into this device's shard
    GATHER_WEIGHTS = "gather-weights"  # COLLECTIVE all_gather: the updated ZeRO-1/2 shards back into the weights
    UNIT_GATHER = "unit-gather"  # COLLECTIVE all_gather: a ZeRO-3 unit's weights, whole, for a forward or backward
    UNIT_GRADS = "unit-grads"  # COLLECTIVE reduce_scatter: a ZeRO-3 unit's whole gradients into its shard
    SHARD_STEP = "shard-step"  # OPTIMIZER: Adam on a ZeRO shard (its reads: the shard gradient)
    TO_HOST = "to-host"  # LOCAL: gradients copied device to host memory over the host link (ZeRO-Offload)
    HOST_STEP = "host-step"  # OPTIMIZER: Adam on the host CPU, on host master weights (reads: host gradients)
    TO_DEVICE = "to-device"  # LOCAL: updated weights (or a ZeRO shard) copied host to device memory
    SAVE_TO_HOST = "save-to-host"  # LOCAL: a piece's saved activations copied to host memory after its forward
    SAVE_TO_DEVICE = "save-to-device"  # LOCAL: the same brought back to the device ahead of its backward
    KEEP_GRAPH = "keep-graph"  # BACKWARD: zero-bubble's input-gradient part of a piece whose W part follows


class Step(StrEnum):
    """How a device issues a task (:meth:`DeviceProgram.steps`): runs it, posts a receive ahead of
    the action that reads it (``Action.posts``), or waits for a receive posted before."""

    RUN = "run"
    POST = "post"
    WAIT = "wait"


class Recompute(StrEnum):
    """A task's part in activation recomputation."""

    NONE = ""
    DROP = "drop"  # a forward whose activations are not kept: it runs without an autograd graph
    REDO = "redo"  # a task of the recomputation, run again in the backward block before the gradients


@dataclass(frozen=True)
class Ring:
    """A ring attention's piece (context parallelism, ``cp_kind=ring``): ``steps`` block steps, one per
    device of the task's ``group`` (the ring, in the order of the sequence's pieces), each meeting one
    key/value block passed around it; ``causal`` masks each pair of chunks as full, diagonal or skipped.

    With ``zigzag`` (Megatron-Core's and Llama 3's causal load balancing) the sequence is cut into
    ``2 steps`` chunks and ring position ``r`` holds chunks ``r`` and ``2 steps - 1 - r`` (the tokens
    are permuted so at the input: :class:`Zigzag`); otherwise position ``r`` holds chunk ``r`` of
    ``steps``.

    With ``gather`` (context parallelism as Llama 3 runs it, ``cp_kind=allgather``) no block is passed
    around: a piece all-gathers every position's keys and values first and computes the same blocks as
    the ring's steps from them; its backward reduce-scatters the blocks' key/value gradients, each back
    to its position. Neither collective overlaps the computation."""

    steps: int
    causal: bool
    zigzag: bool = False
    gather: bool = False

    def __str__(self) -> str:
        kind = "allgather" if self.gather else "ring"
        return f"{kind}/{self.steps}{' causal' if self.causal else ''}{' zigzag' if self.zigzag else ''}"

    def chunks(self, rank: int) -> tuple[int, ...]:
        """The chunks of the sequence ring position ``rank`` holds, in the order it holds them."""
        return (rank, 2 * self.steps - 1 - rank) if self.zigzag else (rank,)

    def pair(self, query_chunk: int, key_chunk: int) -> "RingBlock":
        """The block of scores of a chunk of queries and a chunk of keys: full, its causal lower
        triangle (the same chunk) or nothing (causal, a later chunk)."""
        if not self.causal or key_chunk < query_chunk:
            return RingBlock.FULL
        return RingBlock.DIAGONAL if key_chunk == query_chunk else RingBlock.SKIPPED

    def blocks(self, rank: int, step: int) -> tuple[tuple[int, int, "RingBlock"], ...]:
        """What ring position ``rank`` computes at ``step``, when it holds the keys and values of
        position ``(rank - step) mod steps``: per (part of its queries, part of those keys), the
        indices of the two parts (:meth:`chunks`) and their block."""
        mine, theirs = self.chunks(rank), self.chunks((rank - step) % self.steps)
        return tuple((i, j, self.pair(q, k)) for i, q in enumerate(mine) for j, k in enumerate(theirs))

    def block(self, rank: int, step: int) -> "RingBlock":
        """The whole block ring position ``rank`` computes at ``step`` with contiguous chunks."""
        if self.zigzag:
            raise InternalError(f"{self}: a zigzag ring computes its blocks by parts (Ring.blocks)")
        return self.blocks(rank, step)[0][2]


@dataclass(frozen=True)
class Zigzag:
    """The zigzag order of a model input's sequence (axis ``axis``, cut into ``chunks`` chunks): chunk
    ``0, chunks - 1, 1, chunks - 2, ...`` one after another, so that piece ``r`` of ``chunks / 2``
    contiguous pieces holds chunks ``r`` and ``chunks - 1 - r`` (a zigzag :class:`Ring`'s layout,
    Megatron-Core's ``get_batch_on_this_cp_rank``). A load task with it permutes its source so before
    taking its piece."""

    axis: int
    chunks: int

    def order(self) -> tuple[int, ...]:
        """The chunks of the input, in the order the permuted sequence holds them."""
        n = self.chunks
        return tuple(c for r in range(n // 2) for c in (r, n - 1 - r))


class RingBlock(StrEnum):
    """A ring attention step's block of scores: all of it, its causal lower triangle, or none."""

    FULL = "full"
    DIAGONAL = "diagonal"
    SKIPPED = "skipped"


@dataclass(frozen=True)
class ExchangeAxis:
    """One mesh axis of an all-to-all's group, outermost first: ``size`` members along it; a member
    cuts its piece along tensor axis ``split`` (the axis the result is split on there) and joins the
    pieces it receives along ``gather`` (the axis the source was split on there)."""

    size: int
    split: int
    gather: int

    def __str__(self) -> str:
        return f"{self.size}:{self.split}->{self.gather}"


# Adam's step, counted as FLOPs per parameter (moments, bias corrections, update)
ADAM_FLOPS_PER_PARAM = 12.0


@dataclass(frozen=True, init=False)
class Task:
    """One step of a device: compute on a piece, a collective, a send or receive, or a local copy.

    ``reads``/``writes`` are :class:`~planlab.plan.buffer.Buffer` s. For a forward task they are the
    operator's inputs and outputs in signature order; for a backward task the
    gradients of its outputs (None: the loss seed or an unused output) and
    the gradient contributions for its inputs (None: no gradient). ``role`` says what the task
    does within its kind where the executor runs it differently (a bucket of gradients, a ZeRO
    shard, a load). A message has its ``tag``; a send or receive of a
    Program reduced to device classes carries its conversion's ``channel``, on which the
    simulator matches the messages of whole classes in order. A collective has its ``ident``,
    the same on every device that takes part in it and on the parallel groups of the same
    collective (the simulator matches collectives by it). An optimizer task steps ``params``
    parameters (a ZeRO shard's share: elements / replicas), counted as
    :data:`ADAM_FLOPS_PER_PARAM` flops each. A ``final`` task runs
    with the last micro-batch of its block only (a bucket of weight gradients is reduced
    once they are complete); an ``overlap`` collective runs on the communication stream
    while the device goes on, and the optimizer waits for it. ``saved``
    names the buffers its backward keeps alive; ``lead`` is False on pieces
    other than the first along a split reduction dimension, which leave out
    terms added once (a linear layer's bias) so the partial sums add up.
    ``recompute`` is :attr:`Recompute.DROP` on a forward whose activations are not kept
    and :attr:`Recompute.REDO` on its second run in the backward block. ``region`` is the slice of the
    written buffer (receive, local copy) or of the read buffer (send) moved;
    ``shape`` is the local shape of the written buffer. ``alloc``/``free`` are
    the memory effects, filled in by liveness analysis. A piece of a device's co-located pieces
    (:mod:`planlab.plan.coshard`) has its ``chunk`` index; ``slices`` gives, per read, the region
    of the buffer it uses (None: all of it) and ``places``, per write, ``(region, buffer shape)``
    where it adds its result (None: it writes the whole buffer). ``op_kind`` (the operator's kind,
    as ``Operator.kind``) and ``shapes`` (the local shapes of its inputs, then its outputs, per
    micro-batch) let the cost model price a compute task kernel by kernel; ``causal`` marks a causal
    attention's piece, whose fused kernel skips the blocks the mask hides; ``fused_widths``, on a piece
    of a projection that reads one input with others (an attention's query, key and value, a gated
    unit's gate and up projections: ``fusion`` says which), the group's local output widths
    (:func:`planlab.plan.fused_gemms.fused_fields`: a software that fuses them runs one GEMM).
    ``weight_matmul`` marks a piece of a matrix product with a weight, the experts' stacked weights
    (:func:`planlab.plan.saved.weight_matmul`: a software with ``fp8_weight_matmuls`` runs it in FP8);
    ``output_layer`` marks a piece of the model's output projection, which FP8 trainings keep in 16 bits
    (:func:`planlab.plan.saved.output_layer`). ``step_microbatches``, on the forward of a piece that
    multiplies by a weight (a linear layer's, a product with a weight), is the number of micro-batches
    of a step: a software that keeps a weight's FP8 cast across them (``fp8_weight_cache``) charges
    each forward its share of one cast a step; ``fp8_gathered`` marks a forward or backward piece whose
    weight a ZeRO-3 gather brought in FP8 (:func:`planlab.plan.saved.fp8_gathered_weights`: no cast in
    the forward, a transposing copy in the backward). ``merged_tensors``, on an optimizer step, gives per
    fusion how many of the weight tensors it steps a software fusing those projections keeps inside another's
    (Megatron's ``query_key_value`` holds the query's, key's and value's weights as one tensor and their biases
    as another: 2 of 3 each; :func:`planlab.plan.passes.optimizer.merged_tensors`). ``ring`` marks the forward
    and backward of a ring attention's piece, whose ring is ``group``. An all-to-all's ``exchange``
    says, per mesh axis of its group, how pieces are cut and joined, and ``node_share`` the share of
    its bytes for other nodes that crosses the network (below 1 where the software sends a token
    once to each node, :mod:`planlab.plan.expert_dispatch`). ``in_kernel`` marks a task that runs
    inside another task's kernel (a fused token permutation): it takes no time of its own. A load's ``order`` permutes its
    source's sequence before it takes its piece (a zigzag ring's layout). ``box`` is, on the
    forward task of a random operator (:mod:`planlab.graph.random_ops`), the box of its first output
    in the micro-batch's whole tensor: its random draws are keyed by it (:mod:`planlab.executor.randomness`).
    """

    name: str
    kind: TaskKind
    reads: tuple[Buffer | None, ...] = ()
    writes: tuple[Buffer | None, ...] = ()
    op: str = ""
    coord: int = -1
    flops: float = 0.0
    bytes_moved: float = 0.0
    collective: str = ""
    group: tuple[int, ...] = ()
    axis: int = -1
    peer: int = -1
    nbytes: int = 0
    region: Box | None = None
    src_region: Box | None = None
    shape: tuple[int, ...] = ()
    dtype: str = "float32"
    accumulate: bool = False
    lead: bool = True
    recompute: Recompute = Recompute.NONE
    channel: int = -1
    final: bool = False
    overlap: bool = False
    saved: tuple[Buffer, ...] = ()
    chunk: int = -1
    slices: tuple[Box | None, ...] = ()
    places: tuple[tuple[Box, tuple[int, ...]] | None, ...] = ()
    alloc: tuple[tuple[Buffer, int], ...] = ()
    free: tuple[Buffer, ...] = ()
    op_kind: str = ""
    shapes: tuple[tuple[int, ...], ...] = ()
    box: Box | None = None
    role: Role = Role.PLAIN
    tag: int = -1
    ident: int = -1
    params: float = 0.0
    ring: Ring | None = None
    causal: bool = False
    order: Zigzag | None = None
    exchange: tuple[ExchangeAxis, ...] = ()
    node_share: float = 1.0
    in_kernel: bool = False
    fused_widths: tuple[int, ...] = ()
    weight_matmul: bool = False
    fusion: Fusion | None = None
    output_layer: bool = False
    step_microbatches: int = 1
    fp8_gathered: bool = False
    merged_tensors: tuple[tuple[Fusion, int], ...] = ()

    def __init__(self, name: str, kind: TaskKind, *args, **fields) -> None:
        # Fields are written at once (a frozen dataclass's own __init__ sets them one by one, four
        # times slower): materialize makes tens of thousands of tasks at cluster scale.
        values = dict(_TASK_DEFAULTS, name=name, kind=kind)
        for field_name, value in zip(_TASK_FIELDS[2:], args):
            values[field_name] = value
        if len(args) > len(_TASK_FIELDS) - 2 or not fields.keys() <= _TASK_DEFAULTS.keys():
            raise InternalError(
                f"Task() takes the fields {_TASK_FIELDS}; got {len(args) + 2} positional and {sorted(fields)}"
            )
        values.update(fields)
        object.__setattr__(self, "__dict__", values)

    def __str__(self) -> str:
        if self.kind in (TaskKind.SEND, TaskKind.RECV):
            arrow = "->" if self.kind is TaskKind.SEND else "<-"
            return f"{self.kind}:{self.name}{arrow}{self.peer}"
        if self.kind is TaskKind.COLLECTIVE:
            return f"C:{self.collective}({self.name})@{list(self.group)}"
        return f"{self.kind}:{self.name}"

    @property
    def stream(self) -> str:
        return self.kind.stream

    def but(self, **changes) -> Task:
        """This task with ``changes``: ``dataclasses.replace`` without re-running ``__init__`` (passes
        copy tens of thousands of tasks at cluster scale; a Task checks nothing when it is made)."""
        return self.with_changes(changes)

    def with_changes(self, changes: dict) -> Task:
        """:meth:`but` of a dict of ``changes`` (read, not kept): a pass copying many tasks with the
        same changes makes that dict once."""
        fields = self.__dict__.copy()
        fields.update(changes)
        new = object.__new__(Task)
        object.__setattr__(new, "__dict__", fields)
        return new

    def with_memory(self, alloc: tuple[tuple[Buffer, int], ...], free: tuple[Buffer, ...]) -> Task:
        """This task with the memory effects liveness found (:meth:`but` of ``alloc`` and ``free``,
        without a dict of changes: liveness gives every task of a Program its own)."""
        fields = self.__dict__.copy()
        fields["alloc"] = alloc
        fields["free"] = free
        new = object.__new__(Task)
        object.__setattr__(new, "__dict__", fields)
        return new


_TASK_FIELDS = tuple(f.name for f in dataclasses.fields(Task))
_TASK_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Task) if f.default is not dataclasses.MISSING}


@dataclass(frozen=True)
class Block:
    """The tasks a device runs for one (stage, phase), the same for every micro-batch."""

    stage: int
    phase: str
    tasks: tuple[Task, ...]


@dataclass(frozen=True)
class DeviceProgram:
    """One device's blocks, schedule and static memory (weights, gradients, optimizer states, and the
    weights' FP8 casts where the software keeps them across micro-batches)."""

    device: int
    blocks: dict[tuple[int, str], Block]
    schedule: tuple[Action, ...]
    params: tuple[tuple[str, Box], ...] = ()  # (parameter, region of it held here)
    param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    host_bytes: int = (
        0  # host memory (a pool apart): offloaded master weights, optimizer states, gradients, activations
    )
    cast_weight_bytes: int = 0  # FP8 weight casts kept across micro-batches (saved.cached_fp8_weights)

    def steps(self):
        """Yield ``(action, task, Step)`` in the order the device issues them: each action's posted
        receives (``Action.posts``, in order, as :attr:`Step.POST`) before its own tasks, of which a
        receive posted before is :attr:`Step.WAIT` (``final`` tasks with the last micro-batch only)."""
        last = max((a.microbatch for a in self.schedule), default=0)
        posted: set[tuple[Action, int]] = set()
        for a in self.schedule:
            for x in a.posts:
                for i, t in enumerate(self.block(x).tasks):
                    if t.kind is TaskKind.RECV and (not t.final or x.microbatch == last):
                        posted.add((x.bare(), i))
                        yield x, t, Step.POST
            bare = a.bare()
            for i, t in enumerate(self.block(a).tasks):
                if not t.final or a.microbatch == last:
                    yield a, t, Step.WAIT if (bare, i) in posted else Step.RUN

    @property
    def static_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.cast_weight_bytes

    def block(self, action: Action) -> Block:
        return self.blocks[(action.stage, action.phase)]

    def tasks_in_order(self):
        """Yield ``(action, task)`` in execution order (``final`` tasks with the last micro-batch only)."""
        last = max((a.microbatch for a in self.schedule), default=0)
        for a in self.schedule:
            for t in self.block(a).tasks:
                if not t.final or a.microbatch == last:
                    yield a, t


@dataclass(frozen=True)
class Program:
    """Per-device programs of one training iteration of a Plan.

    A Program reduced by symmetry (``materialize(..., symmetric=True)``) holds the
    programs of one representative per device class only; ``classes[d]`` is the
    representative that device ``d`` is identical to, up to the names of its peers.
    """

    devices: tuple[DeviceProgram, ...]
    microbatches: int
    precision: Precision
    groups: tuple[tuple[int, ...], ...] = ()
    loss_holders: tuple[tuple[int, Buffer, int], ...] = field(default=())  # (device, buffer, replica-coord==0)
    classes: tuple[int, ...] = ()

    @property
    def num_devices(self) -> int:
        return len(self.classes) if self.classes else len(self.devices)

    @property
    def reduced(self) -> bool:
        """True when only class representatives are held."""
        return bool(self.classes) and len(self.devices) < len(self.classes)

    def device(self, d: int) -> DeviceProgram:
        """The program of device ``d`` (a representative's, for a reduced Program)."""
        if not self.reduced:
            return self.devices[d]
        index = self.__dict__.get("_index")
        if index is None:
            index = {dp.device: dp for dp in self.devices}
            object.__setattr__(self, "_index", index)
        return index[self.classes[d]]

    def num_tasks(self) -> int:
        return sum(len(b.tasks) for dp in self.devices for a in dp.schedule for b in [dp.block(a)])

    def grid(self, mark: tuple[int, int] | None = None, limit: int = 60) -> str:
        """Rank-by-step text grid of the first ``limit`` tasks of each device;
        ``mark=(device, step)`` flags one cell with ``>>``."""
        cols = []
        for dp in self.devices:
            col = []
            for i, (a, t) in enumerate(dp.tasks_in_order()):
                if i >= limit and not (mark and mark[0] == dp.device and i <= mark[1]):
                    continue
                cell = f"{a} {t}"
                if mark and mark == (dp.device, i):
                    cell = ">> " + cell
                col.append((i, cell))
            cols.append(col)
        width = 44
        lines = ["step | " + " | ".join(f"dev {d.device}".ljust(width) for d in self.devices)]
        rows = sorted({i for c in cols for i, _ in c})
        for i in rows:
            cells = []
            for c in cols:
                d = dict(c)
                cells.append(d.get(i, "").ljust(width)[:width])
            lines.append(f"{i:4d} | " + " | ".join(cells))
        return "\n".join(lines)
