"""Lowering a device's blocks to simulation units (pure).

Consecutive compute tasks, local copies and collectives among devices of one
class run back to back on the device and become one :class:`Segment` with
their summed time and their memory profile; sends, receives and collectives
that wait on other classes stay separate units.
"""

from __future__ import annotations

from dataclasses import dataclass

from planlab.costmodel import CostModel
from planlab.costmodel.host import SAVE_COPY_ROLES
from planlab.costmodel.model import host_bound_elapsed_s
from planlab.errors import DeadlockError
from planlab.plan.buffer import Buffer
from planlab.plan.program import Block, Role, Task, TaskKind
from planlab.simulator.exchange import message_tag

# the roles of copies on the copy streams (SAVE_COPY_ROLES), as members: compared without reading their values
SAVE_COPIES = frozenset(r for r in Role if r.value in SAVE_COPY_ROLES)


@dataclass(frozen=True)
class Segment:
    """Tasks run back to back: ``compute_s`` on the compute stream, ``comm_s`` in
    class-internal collectives; memory rises by ``peak_bytes`` at most and ends at ``net_bytes``.
    ``parts``: the same time in the order it runs, computation and collectives alternating
    (computation first; :func:`run_parts` runs them on a device whose collectives come and go);
    ``all_to_all``: per collective of ``parts`` (its odd parts, in order), whether it is an
    all-to-all (the expert dispatch and combine a pair overlaps, :mod:`planlab.simulator.pairs`)."""

    tasks: tuple[str, ...]
    compute_s: float
    comm_s: float
    peak_bytes: int
    net_bytes: int
    durations: tuple[float, ...]
    peak_task: str = ""
    is_comm: tuple[bool, ...] = ()
    parts: tuple[float, ...] = ()
    all_to_all: tuple[bool, ...] = ()


@dataclass(frozen=True)
class Send:
    """A message: a flow of ``duration_s`` alone on its links, or with ``closed`` a message of a
    symmetric burst whose ``duration_s`` is the network's answer already (:mod:`planlab.simulator.exchange`).
    ``blocking``: the sender waits until it is delivered (the software's ``pipeline_p2p``)."""

    task: str
    peer: int
    tag: int
    duration_s: float
    free_bytes: int
    closed: bool = False
    blocking: bool = False


@dataclass(frozen=True)
class Recv:
    """A receive; ``blocking``: its sender sends only once it is posted (a rendezvous, the
    software's ``pipeline_p2p``)."""

    task: str
    peer: int
    tag: int
    alloc_bytes: int
    blocking: bool = False


@dataclass(frozen=True)
class Collective:
    """A collective whose members span several classes: a barrier (the collective's ``ident``, the
    same on every member), then ``duration_s``."""

    task: str
    group: tuple[int, ...]
    duration_s: float
    alloc_bytes: int
    free_bytes: int
    ident: int = -1


@dataclass(frozen=True)
class AsyncCollective:
    """A collective on the communication stream while the device goes on (a bucket of weight
    gradients reduced during the backward, a ZeRO-3 layer's weights gathered ahead); the
    optimizer waits for it. Its output (``alloc_bytes``) is allocated when it is issued, its
    input (``free_bytes``) freed when it completes; its members meet at ``ident``.
    ``copy_out_s``: the part of its price the software runs on the compute stream once it is done
    (FSDP2 copies a gathered buffer into the parameters there), run where the computation waits for
    it (its :class:`Await`; the copies of collectives never waited for run before the optimizer)."""

    task: str
    group: tuple[int, ...]
    duration_s: float
    alloc_bytes: int = 0
    free_bytes: int = 0
    ident: int = -1
    copy_out_s: float = 0.0


@dataclass(frozen=True)
class HostCopy:
    """Saved activations copied between the device and host memory (activation offload,
    :mod:`planlab.plan.passes.act_offload`) on a copy stream of the device's own while it goes on:
    consecutive copies of a block's ``tasks`` as one, ``duration_s`` on the host link (each direction
    its own stream, as Megatron-Core's offloading uses one for each). What it
    writes on the device (``alloc_bytes``) is allocated when it is issued, what it reads
    (``free_bytes``) freed when it is done; a task reading what it wrote waits for it (an :class:`Await`)."""

    tasks: tuple[str, ...]
    duration_s: float
    alloc_bytes: int = 0
    free_bytes: int = 0
    to_host: bool = True  # the direction: PCIe is full duplex, each direction has a copy stream of its own
    after: tuple[str, ...] = ()  # the copies to the host (of this micro-batch) a copy back waits for


@dataclass(frozen=True)
class Await:
    """Wait for the latest run of overlapped collectives whose outputs the next task reads
    (a ZeRO-3 layer's forward waits for its gathered weights)."""

    tasks: tuple[str, ...]


Unit = Segment | Send | Recv | Collective | AsyncCollective | HostCopy | Await


def task_time_s(task: Task, cost: CostModel, dtype: str) -> float:
    """Seconds for one task on its stream: the cost model's ``task_time_s`` where it has one
    (a calibrated profile prices each kind of task), else from its compute and collective times."""
    if hasattr(cost, "task_time_s"):
        return cost.task_time_s(task, dtype)
    k = task.kind
    if task.in_kernel:  # inside another task's kernel (a fused token permutation)
        return 0.0
    if k in (TaskKind.FORWARD, TaskKind.BACKWARD, TaskKind.OPTIMIZER):
        if task.flops == 0 and task.bytes_moved == 0:
            return 0.0
        return cost.compute_time_s(flops=task.flops, bytes_moved=task.bytes_moved, dtype=dtype)
    if k is TaskKind.LOCAL:
        n = sum(s for _, s in task.alloc) or 0
        return cost.compute_time_s(flops=0.0, bytes_moved=2.0 * n, dtype=dtype) if n else 0.0
    if k is TaskKind.COLLECTIVE:
        if task.node_share == 1.0:  # the three-argument form every cost model takes
            return cost.collective_time_s(task.collective, task.nbytes, tuple(task.group))
        return cost.collective_time_s(task.collective, task.nbytes, tuple(task.group), task.node_share)
    return 0.0  # sends and receives are priced by lower_block, which knows the device


def overlap_writers(blocks) -> dict[Buffer, str]:
    """Buffers (not static ones) written by overlapped collectives or by copies on the copy stream,
    and the task writing each."""
    return {
        b: t.name
        for blk in blocks
        for t in blk.tasks
        if t.overlap or t.role in SAVE_COPIES
        for b in t.writes
        if b and not b.static
    }


def lower_block(
    block: Block,
    *,
    device: int,
    cls: list[int],
    cost: CostModel,
    dtype: str,
    sizes: dict[Buffer, int],
    final: bool = True,
    prices: dict | None = None,
    writers: dict[Buffer, str] | None = None,
    closed: dict[int, float] | None = None,
) -> tuple[Unit, ...]:
    """The units of one block on ``device``; ``sizes`` maps buffers to bytes (for frees).
    ``final`` includes the tasks that run with the last micro-batch only; ``prices`` caches
    task times across the blocks of one simulation. A task reading a buffer of ``writers``
    (:func:`overlap_writers` of the device's blocks; default: this block's) waits for the
    collective's latest run first. ``closed`` maps the index of a send in the block to its price
    in closed form (:func:`~planlab.simulator.exchange.exchange_prices`). Raises DeadlockError for a collective across classes without
    an identity to meet at."""
    low = _Lowering(device, cls, cost, dtype, sizes, prices if prices is not None else {})
    writers = overlap_writers([block]) if writers is None else writers
    awaited: set[Buffer] = set()  # buffers already waited for in this block
    closed = closed or {}
    for i, t in enumerate(block.tasks):
        if t.final and not final:
            continue
        if writers and t.role not in SAVE_COPIES:  # a copy back waits on its stream, not the device
            waits = {b for b in t.reads + t.saved if b in writers and b not in awaited}
            if waits:
                low.flush()
                names = {writers[b] for b in waits}
                if low.synchronized and names & low.gathers:  # the fetch's torch.cuda.synchronize() waits
                    names |= low.in_flight  # for every collective issued before the last task too
                low.in_flight -= names
                low.fresh -= names
                low.units.append(Await(tuple(sorted(names))))
                awaited.update(waits)
        if t.role in SAVE_COPIES:
            low.copy(t, tuple(sorted({writers[b] for b in t.reads if b in writers})))
            awaited.difference_update(t.writes)
        elif t.overlap:
            duration_s = low.times(t)[0]
            copy_s = min(duration_s, cost.copy_out_s(t)) if hasattr(cost, "copy_out_s") else 0.0
            issued = low.synchronized and t.role is Role.UNIT_GATHER
            if issued:  # the fill and the host's work before the all-gather starts
                low.prepare(t)
            low.apart(AsyncCollective(t.name, tuple(t.group), duration_s - copy_s, *low.memory(t), _ident(t), copy_s))
            awaited.difference_update(t.writes)
            low.fresh.add(t.name)
            if t.role is Role.UNIT_GATHER:
                low.gathers.add(t.name)
            if issued:  # the host's work after it (its copies' launches) while it runs
                low.issue(t)
        elif t.kind is TaskKind.SEND:
            price = closed.get(i)
            duration_s = cost.p2p_time_s(t.nbytes, device, t.peer) if price is None else price
            low.apart(
                Send(t.name, t.peer, message_tag(t), duration_s, low.memory(t)[1], price is not None, low.blocking)
            )
        elif t.kind is TaskKind.RECV:
            low.apart(Recv(t.name, t.peer, message_tag(t), low.memory(t)[0], low.blocking))
        elif t.kind is TaskKind.COLLECTIVE and len({cls[d] for d in t.group}) > 1:
            low.apart(Collective(t.name, tuple(t.group), low.times(t)[0], *low.memory(t), _ident(t)))
        else:
            low.cur.append((t, low.times(t), t.kind is TaskKind.COLLECTIVE))
            low.in_flight |= low.fresh
            low.fresh = set()
    low.flush()
    return tuple(low.units)


def receives_first(units: tuple[Unit, ...]) -> tuple[Unit, ...]:
    """A backward block's units with its blocking receives (from the next stage) first: DeepSpeed's pipeline engine runs a
    backward step as RecvGrad, then SendActivation, then BackwardPass (schedule.py's
    TrainSchedule), and the recomputation of a checkpointed layer runs inside the backward pass,
    where autograd reaches it (deepspeed/runtime/activation_checkpointing/checkpointing.py,
    CheckpointFunction.backward), so none of the block's work runs before its gradients arrive."""
    first = [isinstance(u, Recv) and u.blocking for u in units]
    return tuple(u for u, f in zip(units, first) if f) + tuple(u for u, f in zip(units, first) if not f)


class _Lowering:
    """The units of one block so far, the tasks of the segment being gathered (``cur``: task,
    (device s, host s), whether it is a collective) and the prices of tasks."""

    def __init__(self, device: int, cls: list[int], cost: CostModel, dtype: str, sizes: dict, prices: dict) -> None:
        self.device, self.cls, self.cost, self.dtype, self.sizes, self.prices = device, cls, cost, dtype, sizes, prices
        self.hosted = bool(getattr(cost, "host_bound", False))  # the host's issue time bounds the device's
        software = getattr(cost, "software", None)
        self.blocking = software is not None and software.pipeline_p2p == "blocking"  # sends hold the sender
        # ZeRO-3 gathers issued with the device synchronized (DeepSpeed of 2021)
        self.synchronized = self.hosted and software is not None and software.zero3_synchronized_fetch
        self.units: list[Unit] = []
        self.cur: list = []
        # overlapped collectives issued and not yet waited for: before the last task the device ran
        # (``in_flight``), or since (``fresh``: a reduce-scatter issued by the gradient hook of the
        # module about to run, after its fetch); ``gathers``: the ZeRO-3 gathers among them
        self.in_flight: set[str] = set()
        self.fresh: set[str] = set()
        self.gathers: set[str] = set()

    def times(self, t: Task) -> tuple[float, float]:
        """``(device s, host s)`` of a task, priced once per simulation for tasks alike."""
        key = (
            t.kind,
            t.flops,
            t.bytes_moved,
            t.collective,
            t.nbytes,
            t.group,
            len(t.writes),
            sum(n for _, n in t.alloc) if t.kind is TaskKind.LOCAL else 0,
            t.op_kind,
            t.shapes,
            t.accumulate,
            tuple(w and w.kind for w in t.writes) if t.kind is TaskKind.BACKWARD else (),  # I/W parts
            t.ring,
            t.role,
            t.node_share,
            t.in_kernel,
            t.causal,  # a causal fused attention computes part of its blocks
            t.fused_widths,  # a projection's share of a fused GEMM (query, key and value; gate and up)
            t.fusion,
            t.weight_matmul,  # a matrix product with a weight (FP8 where the software runs those in FP8)
            t.output_layer,  # the output projection (16 bits under FP8)
            t.step_microbatches,  # a weight's FP8 cast kept across a step's micro-batches
            t.recompute,  # a recomputed forward reads the kept cast
            t.fp8_gathered,  # its weight gathered in FP8 (no cast forward, a transposing copy backward)
            t.merged_tensors,  # an optimizer step's tensors that a fused projection's tensor holds
        )
        got = self.prices.get(key)
        if got is None:
            if self.hosted:
                got = self.cost.device_and_host_s(t, self.dtype)
            else:
                got = (task_time_s(t, self.cost, self.dtype), 0.0)
            self.prices[key] = got
        return got

    def memory(self, t: Task) -> tuple[int, int]:
        """Bytes a task allocates and frees."""
        return sum(n for _, n in t.alloc), sum(self.sizes.get(b, 0) for b in t.free)

    def copy(self, t: Task, after: tuple[str, ...]) -> None:
        """A copy on its direction's copy stream, joined to the copy just before it when nothing ran between."""
        alloc, free = self.memory(t)
        out = t.role.value == "save-to-host"
        last = self.units[-1] if self.units and not self.cur else None
        if isinstance(last, HostCopy) and last.to_host == out:
            self.units[-1] = HostCopy(
                last.tasks + (t.name,),
                last.duration_s + self.times(t)[0],
                last.alloc_bytes + alloc,
                last.free_bytes + free,
                out,
                last.after + after,
            )
        else:
            self.apart(HostCopy((t.name,), self.times(t)[0], alloc, free, out, after))

    def prepare(self, t: Task) -> None:
        """What a gather issued with the device synchronized (the software's
        ``zero3_synchronized_fetch``) costs before it starts: DeepSpeed's ``_allgather_param`` of 2021
        zero-fills the gathered buffer with ``torch.zeros``, calls ``torch.cuda.synchronize()``, then
        makes a narrow view per rank (``zero3_gather_rank_s`` each) and calls
        ``torch.distributed.all_gather``, whose framework call (``host_collective_s``) launches it.
        The device idles for all of it, so it is one entry on the compute stream before the gather:
        the fill, then the host's time."""
        fill_s = self.cost.fill_s(t.nbytes) if hasattr(self.cost, "fill_s") else 0.0
        sw = self.cost.software
        host_s = len(t.group) * sw.zero3_gather_rank_s + sw.host_collective_s
        self.cur.append((Task(f"{t.name}:prepare", TaskKind.LOCAL, (), ()), (fill_s + host_s, 0.0), False))

    def issue(self, t: Task) -> None:
        """The host's time after a synchronized gather is launched (:meth:`prepare`): ProcessGroupNCCL
        launches a copy per rank of the group (``collective_buffers`` ``per_rank``) while the gather
        runs, so the computation after it (a prefetch's module) starts that much later."""
        host_s = max(0.0, self.times(t)[1] - self.cost.software.host_collective_s)
        self.cur.append((Task(f"{t.name}:issue", TaskKind.LOCAL, (), ()), (0.0, host_s), False))

    def apart(self, unit: Unit) -> None:
        """A unit of its own, after the segment gathered so far."""
        self.flush()
        self.units.append(unit)

    def flush(self) -> None:
        """The tasks gathered so far as one :class:`Segment`."""
        cur = self.cur
        if not cur:
            return
        durations = [d for _, (d, _), _ in cur]
        if self.hosted:  # the device waits for the host where the host is slower
            durations = host_bound_elapsed_s(durations, [h for _, (_, h), _ in cur])
        comm = sum(min(e, d) for (_, (d, _), c), e in zip(cur, durations) if c)  # the wait counts as compute
        mem = peak = 0
        at = cur[0][0].name
        size = self.sizes.get
        for t, _, _ in cur:
            if t.alloc:
                alloc = 0
                for _, n in t.alloc:
                    alloc += n
                mem += alloc
            if mem > peak:
                peak, at = mem, t.name
            if t.free:
                freed = 0
                for b in t.free:
                    freed += size(b, 0)
                mem -= freed
        self.units.append(
            Segment(
                tuple(t.name for t, _, _ in cur),
                sum(durations) - comm,
                comm,
                peak,
                mem,
                tuple(durations),
                at,
                tuple(c for _, _, c in cur),
                _parts(durations, [(d, c) for _, (d, _), c in cur]),
                tuple(t.collective == "all_to_all" for t, _, c in cur if c),
            )
        )
        self.cur = []


def _parts(elapsed: list[float], tasks: list[tuple[float, bool]]) -> tuple[float, ...]:
    """A segment's seconds in order, computation and class-internal collectives alternating
    (computation first, possibly 0): a collective's ``elapsed`` beyond its device time (waiting
    for the host) counts as computation before it, as :class:`Segment` counts it."""
    parts = [0.0]
    for e, (d, comm) in zip(elapsed, tasks):
        if not comm:
            parts[-1] += e
            continue
        parts[-1] += e - min(e, d)
        parts += [min(e, d), 0.0]
    return tuple(parts)


def run_parts(
    parts: tuple[float, ...], at: tuple[int, float], now_s: float, busy_until_s: float, slowdown: float, stop_s: float
) -> tuple[float, tuple[int, float]]:
    """Run a segment's ``parts`` (:attr:`Segment.parts`) from ``at`` (a part's index and the
    seconds left in it) at ``now_s``: computation takes ``slowdown`` times as long before
    ``busy_until_s`` (a collective on the communication stream holds some of the device's SMs), the
    class-internal collectives do not. Returns the time reached and where, stopping at ``stop_s``
    or at the end (index ``len(parts)``). Pure; the computation of a part is reached at the same
    time whatever the times at which the run is cut."""
    i, left = at
    t = now_s
    while i < len(parts):
        slow = slowdown if i % 2 == 0 and t < busy_until_s else 1.0
        need = left * slow
        bound = min(stop_s, busy_until_s) if slow != 1.0 else stop_s
        if t + need <= bound:
            t += need
            i += 1
            left = parts[i] if i < len(parts) else 0.0
            continue
        left -= (bound - t) / slow
        t = bound
        if t >= stop_s:
            break
    return t, (i, left)


def _ident(task: Task) -> int:
    """The identity a collective's members meet at (DeadlockError without one)."""
    if task.ident < 0:
        raise DeadlockError(
            f"collective {task} spans several device classes but has no identity (Task.ident) "
            "for its members to meet at"
        )
    return task.ident
