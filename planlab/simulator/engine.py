"""The simpy model: one process per device class runs its schedule's units.

Segments occupy the device; sends are flows on the network (links shared fairly
between concurrent transfers) while the device goes on; receives wait for the
matching message; collectives that span classes start when every class has
reached them (matched by the identity the Program gives each collective, ``Task.ident``,
and the micro-batch); overlapped collectives (gradient buckets, ZeRO-3's gathers and
reduce-scatters) run on the device's communication stream; a task that reads their output waits
for them (an :class:`~planlab.simulator.units.Await`), and so does the optimizer.

:func:`simulate` checks its inputs and finds the device classes, a :class:`Simulation` holds
what the devices share (the environment, the network, mailboxes, barriers, the record), each
class's representative runs as a :class:`DeviceRun` (one method per kind of unit), and
:func:`result` sums up.
"""

from __future__ import annotations

import math
from dataclasses import replace
from collections import Counter, defaultdict, deque
from itertools import count

import simpy

from planlab.costmodel import CostModel
from planlab.costmodel.compute import peak_flops_per_s
from planlab.costmodel.hardware import ClusterSpec
from planlab.costmodel.host import host_of
from planlab.errors import ConfigError, DeadlockError
from planlab.gcpause import paused_gc
from planlab.plan.plan import Action
from planlab.plan.program import Program
from planlab.simulator.classes import device_classes
from planlab.simulator.exchange import exchange_prices
from planlab.simulator.network import Network
from planlab.simulator.pairs import run_pair
from planlab.simulator.result import DeviceStats, Event, SimResult
from planlab.simulator.units import (
    AsyncCollective,
    Await,
    HostCopy,
    Collective,
    Recv,
    Segment,
    Send,
    lower_block,
    overlap_writers,
    receives_first,
    run_parts,
)


def simulate(
    program: Program,
    cost: CostModel,
    *,
    model_flops: float = 0.0,
    timeline: bool = False,
    symmetry: bool = True,
    stragglers: dict[int, float] | None = None,
    overlap_slowdown: float | None = None,
) -> SimResult:
    """Simulate one iteration of ``program``; ``model_flops`` (forward + backward of the
    model at the global batch) gives MFU. With ``timeline`` every task is recorded. With
    ``symmetry`` one representative per device class is simulated (same result, less work).
    ``stragglers`` maps devices to a factor (> 1) slowing their computation, for what-if studies.
    ``overlap_slowdown`` (>= 1) stretches computation while an overlapped collective shares the device
    (None: the cost model's, :attr:`CostModel.overlap_slowdown`, from the SMs the cluster's collectives take)."""
    # a pair's computation beside the other action's expert dispatch: the dispatch kernels' SMs (the software's)
    pair_slowdown = cost.dispatch_slowdown if overlap_slowdown is None else overlap_slowdown
    if overlap_slowdown is None:
        overlap_slowdown = cost.overlap_slowdown
    with paused_gc():
        slow = _checked(program, cost, stragglers, overlap_slowdown, symmetry)
        if program.reduced:
            cls = list(program.classes)
        else:
            cls = device_classes(program, cost.cluster, slow) if symmetry else list(range(program.num_devices))
        sim = Simulation(
            program,
            cost,
            cls,
            timeline=timeline,
            slow=slow,
            overlap_slowdown=overlap_slowdown,
            pair_slowdown=pair_slowdown,
        )
        reps = sorted(set(cls))
        for r in reps:
            DeviceRun(sim, r).start()
        sim.env.run()
        stuck = [r for r in reps if "finish" not in sim.stats.get(r, {})]
        if stuck:
            raise DeadlockError(
                f"simulation stopped with device(s) {stuck} still waiting; run the dry run "
                "(planlab.simulator.find_deadlock) for the task each waits on"
            )
        return result(sim, model_flops)


def _checked(
    program: Program, cost: CostModel, stragglers: dict | None, overlap_slowdown: float, symmetry: bool
) -> dict[int, float]:
    """The stragglers, once the inputs are checked (ConfigError / DeadlockError naming the value)."""
    cluster = cost.cluster
    if program.num_devices > cluster.num_devices:
        raise DeadlockError(
            f"the program has {program.num_devices} devices; the cluster {cluster} has {cluster.num_devices}"
        )
    slow = dict(stragglers or {})
    bad = {
        d: f
        for d, f in slow.items()
        if not isinstance(d, int) or not isinstance(f, (int, float)) or not 0 <= d < program.num_devices or not f > 0
    }
    if bad:
        raise ConfigError(f"stragglers {bad}: devices must be 0..{program.num_devices - 1} and factors positive")
    if not overlap_slowdown >= 1.0:
        raise ConfigError(f"overlap_slowdown={overlap_slowdown}: expected a factor of at least 1")
    if program.reduced and (slow or not symmetry):
        raise ConfigError(
            "this Program holds one representative per device class; stragglers and "
            "symmetry=False need every device's tasks: materialize with symmetric=False"
        )
    return slow


class Simulation:
    """What the simulated devices share: the program, the prices, the classes (``cls[d]``: the
    representative device ``d`` stands with), the environment and network, the mailboxes of
    messages and the barriers of collectives, each representative's communication stream and
    statistics, and the recorded events and memory."""

    def __init__(
        self,
        program: Program,
        cost: CostModel,
        cls: list[int],
        *,
        timeline: bool,
        slow: dict[int, float],
        overlap_slowdown: float,
        pair_slowdown: float | None = None,
    ) -> None:
        self.program, self.cost, self.cls = program, cost, cls
        self.timeline, self.slow, self.overlap_slowdown = timeline, slow, overlap_slowdown
        # computation beside the other action's expert dispatch in a pair (planlab.simulator.pairs)
        self.pair_slowdown = overlap_slowdown if pair_slowdown is None else pair_slowdown
        self.dtype = program.precision.compute_dtype
        self.env = simpy.Environment()
        self.net = Network(self.env)
        self.coll_free = {r: 0.0 for r in set(cls)}  # when each device's collective stream is next free
        self.boxes: dict[tuple, _Mailbox] = defaultdict(_Mailbox)
        self.barriers: dict[tuple, list] = {}
        self.stats: dict[int, dict] = {}
        # (device, start_s, issue order, stream, action, name, end_s): sorted as recorded, made Events at the end
        self.events: list[tuple] = []
        self.issued = count()
        self.memory: list[tuple[int, float, int]] = []
        self.prices: dict = {}  # task times by what they depend on, shared by every device
        self.exchange = exchange_prices(program, cls, cost)  # sends of symmetric bursts, in closed form
        self._links: dict[tuple[int, int], tuple] = {}
        self._members = Counter(cls)
        self._within: dict[tuple[int, ...], bool] = {}  # group -> within one class (Simulation.within_class)
        self.stages = 1 + max((a.stage for d in program.devices for a in d.schedule), default=0)
        self.stages_of = {d.device: frozenset(a.stage for a in d.schedule if a.phase != "U") for d in program.devices}
        # blocking sends meet their receives, in DeepSpeed's order, where every device runs its TrainSchedule
        self.rendezvous = all(in_deepspeed_order(d.schedule, self.stages) for d in program.devices)

    def mailbox(self, src: int, dst: int, tag: int) -> _Mailbox:
        """The channel of messages with ``tag`` from ``src``'s class to ``dst``'s."""
        return self.boxes[(self.cls[src], self.cls[dst], tag)]

    def links(self, src: int, dst: int) -> tuple:
        """The links a message from representative ``src`` to ``dst`` uses: the sender's port out,
        the receiver's in. Between classes of as many devices the receiver's port is its
        representative's: every member of the receiver's class takes as many messages from the
        sender's class as the sender sends to the members, at the same times, so the messages the
        representative sends to the members share one port as the members' messages share theirs."""
        got = self._links.get((src, dst))
        if got is None:
            kind = "nvlink" if self.cost.cluster.node_of(src) == self.cost.cluster.node_of(dst) else "nic"
            port = self.cls[dst] if self._members[self.cls[src]] == self._members[self.cls[dst]] else dst
            got = self._links[(src, dst)] = ((kind, "out", src), (kind, "in", port))
        return got

    def within_class(self, group: tuple[int, ...]) -> bool:
        """Whether every member of ``group`` stands with one representative (its barrier is reached
        as soon as that representative issues the collective)."""
        got = self._within.get(group)
        if got is None:
            got = self._within[group] = len({self.cls[d] for d in group}) == 1
        return got

    def barrier(self, ident: int, microbatch: int, group: tuple[int, ...]) -> simpy.Event:
        """The event of collective ``ident``'s run for ``microbatch``: it fires when the
        representatives of every class in ``group`` have reached it."""
        key_cls = tuple(sorted({self.cls[d] for d in group}))
        bar = self.barriers.setdefault((ident, microbatch, key_cls), [0, self.env.event()])
        bar[0] += 1
        if bar[0] == len(key_cls):
            bar[1].succeed()
        return bar[1]

    def record(self, device: int, stream: str, action: str, name: str, start_s: float, end_s: float, seq=None):
        """Keep one event of the timeline (in issue order ``seq``, by default the next)."""
        self.events.append((device, start_s, next(self.issued) if seq is None else seq, stream, action, name, end_s))


class DeviceRun:
    """One representative device running its schedule: its program, the units of each block
    (lowered once), its memory, and the overlapped collectives it has in flight."""

    def __init__(self, sim: Simulation, rep: int) -> None:
        self.sim, self.rep = sim, rep
        self.dp = sim.program.device(rep)
        self.sizes: dict = {}
        self.with_final: set[tuple[int, str]] = set()  # blocks with tasks that run with the last micro-batch only
        for key, b in self.dp.blocks.items():
            for t in b.tasks:
                self.sizes.update(t.alloc)
                if t.final:
                    self.with_final.add(key)
        self.writers = overlap_writers(self.dp.blocks.values())
        self.owed_s: dict[str, float] = {}  # compute-stream copies of finished overlapped collectives, by name
        self.copy_free_s = {True: 0.0, False: 0.0}  # when each copy stream (to the host, back) is next free
        self.copied: dict[tuple[str, int], simpy.Process] = {}  # copies to the host by (task, micro-batch)
        self.pending = 0  # overlapped collectives issued that have not started on the communication stream
        self.computing = False  # in a computation that an overlapped collective starting (or queued) interrupts
        self.proc: simpy.Process | None = None
        self.units: dict[tuple, tuple] = {}
        self.st = sim.stats[rep] = dict(
            compute_s=0.0,
            comm_s=0.0,
            wait_s=0.0,
            exposed_s=0.0,
            bubble_s=0.0,
            peak=self.dp.static_bytes,
            peak_at=0.0,
            peak_task="(weights)",
        )
        self.factor = sim.slow.get(rep, 1.0)
        self.mem = self.dp.static_bytes
        self.in_flight: list[simpy.Process] = []
        self.by_name: dict[str, simpy.Process] = {}  # the latest overlapped collective of each name

    def run(self):
        """The device's process: every action of its schedule, unit by unit (segments and sends, the
        most frequent units, without a generator of their own); an action that ``overlaps`` the next
        runs with it as a pair (:func:`~planlab.simulator.pairs.run_pair`)."""
        sim, env, st, rep = self.sim, self.sim.env, self.st, self.rep
        timeline, slowdown, factor = sim.timeline, sim.overlap_slowdown, self.factor
        if timeline:
            sim.memory.append((rep, 0.0, self.mem))
        last_mb = sim.program.microbatches - 1
        schedule, paired = self.dp.schedule, None
        deferred: list[tuple[Send, str]] = []  # blocking sends put after the next block's receive
        for i, action in enumerate(schedule):
            a = str(action)
            if action.phase == "U" and (self.in_flight or self.owed_s):
                yield from self.drain(a)
            if paired is not None:  # ran with the action before it
                paired = None
                continue
            if action.overlaps and i + 1 < len(schedule):
                paired = schedule[i + 1]
                yield from run_pair(self, action, paired, last_mb)
                continue
            units = self.block_units(action, action.microbatch == last_mb)
            defer = i + 1 < len(schedule) and self.defers_sends(action, schedule[i + 1], last_mb)
            for u in units:
                if deferred and not isinstance(u, Recv):  # after the block's leading receives
                    yield from self.send_deferred(deferred)
                if isinstance(u, Segment):  # computation, slowed by a straggler's factor and
                    # stretched while an overlapped collective shares the device; class-internal collectives
                    start = env.now
                    if u.peak_bytes + self.mem > st["peak"]:
                        self.bump(u.peak_bytes, u.peak_task)
                    if timeline:
                        sim.memory.append((rep, start, self.mem + u.peak_bytes))
                    compute = u.compute_s * factor
                    if slowdown == 1.0 or (not self.pending and sim.coll_free[rep] <= start):  # alone
                        yield env.timeout(compute + u.comm_s)
                    else:
                        yield from self.share(u.parts if factor == 1.0 else scaled(u.parts, factor))
                        compute = env.now - start - u.comm_s
                    st["compute_s"] += compute
                    st["comm_s"] += u.comm_s
                    st["exposed_s"] += u.comm_s
                    self.mem += u.net_bytes
                    if timeline:
                        self.record_segment(u, a, start, compute)
                elif isinstance(u, Send):
                    if not u.blocking:
                        self.send(u, a)
                    elif defer:
                        deferred.append((u, a))
                    else:
                        yield from self.send_and_wait(u, a)
                elif isinstance(u, Recv):
                    yield from self.recv(u, a)
                else:
                    yield from self.unit(u, a, action)
        if deferred:
            yield from self.send_deferred(deferred)
        if self.in_flight or self.owed_s:
            yield from self.drain("end")
        self.st["finish"] = sim.env.now

    def unit(self, u, a: str, action: Action):
        """Run one unit other than a segment or a send: a receive, an overlapped collective's start
        or wait, a copy to or from the host, a collective across classes."""
        if isinstance(u, Recv):
            yield from self.recv(u, a)
        elif isinstance(u, AsyncCollective):
            yield from self.start_overlapped(u, a, action)
        elif isinstance(u, HostCopy):
            self.start_copy(u, a, action.microbatch)
        elif isinstance(u, Await):
            yield from self.wait_for(u, a)
        elif isinstance(u, Collective):
            yield from self.collective(u, a, action)

    def recv(self, u: Recv, a: str):
        """Wait for the channel's next message (a pipeline bubble)."""
        sim, env, st = self.sim, self.sim.env, self.st
        start, box = env.now, sim.mailbox(u.peer, self.rep, u.tag)
        if u.blocking:  # posted: a blocking sender may start
            box.post_ready()
        arrival = box.take() if box.arrivals else (yield box.wait(env))
        if arrival > env.now:
            yield env.timeout(arrival - env.now)
        st["wait_s"] += env.now - start
        st["bubble_s"] += env.now - start
        self.bump(u.alloc_bytes, u.task)
        self.mem += u.alloc_bytes
        if sim.timeline:
            sim.record(self.rep, "wait", a, u.task, start, env.now)

    def start(self) -> None:
        """Start the device's process."""
        self.proc = self.sim.env.process(self.run())

    def share(self, parts: tuple[float, ...]):
        """Run a segment's ``parts`` (:attr:`Segment.parts`) on a device whose communication stream
        may hold a collective: computation runs ``overlap_slowdown`` times as long while one runs
        there (from when it starts on the stream, once every member has issued it, to when it ends:
        the same span for every member of a class, in the reduced and the full simulation). A
        collective that starts (or queues) on the stream meanwhile interrupts the run, which goes on
        from where it was, at the speed the stream now leaves it."""
        sim, env = self.sim, self.sim.env
        at, slowdown = (0, parts[0]), sim.overlap_slowdown
        while True:
            now, busy_until = env.now, sim.coll_free[self.rep]
            end, _ = run_parts(parts, at, now, busy_until, slowdown, math.inf)
            if not self.pending:  # nothing can start on the stream before the end
                yield env.timeout(end - now)
                return
            self.computing = True
            try:
                yield env.timeout(end - now)
            except simpy.Interrupt:
                if env.now >= end:
                    return
                _, at = run_parts(parts, at, now, busy_until, slowdown, env.now)
                continue
            self.computing = False
            return

    def copy_out(self, names: tuple[str, ...] | None, a: str):
        """Run on the compute stream the copies owed by the finished overlapped collectives ``names``
        (every one with None): FSDP2 copies a gathered buffer into the parameters when the
        computation waits for it (``FSDPParamGroup.wait_for_unshard``)."""
        owed, env = self.owed_s, self.sim.env
        copy_s = sum(owed.pop(n) for n in (list(owed) if names is None else [n for n in names if n in owed]))
        if not copy_s:
            return
        start = env.now
        if self.sim.overlap_slowdown == 1.0:
            yield env.timeout(copy_s)
        else:
            yield from self.share((copy_s,))
        self.st["compute_s"] += env.now - start
        if self.sim.timeline:
            self.sim.record(self.rep, "compute", a, "copy-out", start, env.now)

    def block_units(self, action: Action, final: bool) -> tuple:
        """The units of ``action``'s block (with its ``final`` tasks on the last micro-batch; a block
        without any is lowered once for every micro-batch)."""
        key = (action.stage, action.phase, final or (action.stage, action.phase) not in self.with_final)
        got = self.units.get(key)
        if got is None:
            sim = self.sim
            got = self.units[key] = lower_block(
                self.dp.blocks[key[:2]],
                device=self.rep,
                cls=sim.cls,
                cost=sim.cost,
                dtype=sim.dtype,
                sizes=self.sizes,
                final=final,
                prices=sim.prices,
                writers=self.writers,
                closed=sim.exchange.get((self.rep, key[:2])),
            )
            if any(isinstance(u, (Send, Recv)) and u.blocking for u in got):
                got = self.units[key] = self.pipeline_blocking(got, action.phase == "B")
        return got

    def bump(self, extra: int, name: str) -> None:
        """A new peak if memory rises by ``extra`` bytes now (at task ``name``)."""
        st = self.st
        if self.mem + extra > st["peak"]:
            st["peak"], st["peak_at"], st["peak_task"] = self.mem + extra, self.sim.env.now, name

    def release(self, nbytes: int) -> None:
        """An overlapped collective completed: its input is freed."""
        if nbytes:
            self.mem -= nbytes
            if self.sim.timeline:
                self.sim.memory.append((self.rep, self.sim.env.now, self.mem))

    def drain(self, a: str):
        """Wait for the overlapped collectives still running, then run the copies still owed."""
        env = self.sim.env
        start = env.now
        # those done already would only be counted (a ZeRO-3 iteration issues hundreds of thousands)
        yield env.all_of([e for e in self.in_flight if not e.processed])
        self.in_flight.clear()
        self.st["exposed_s"] += env.now - start
        yield from self.copy_out(None, a)

    def record_segment(self, u: Segment, a: str, start: float, compute: float) -> None:
        """The events of a segment that ran from ``start`` (its computation stretched to ``compute``)."""
        sim, rep = self.sim, self.rep
        t = start
        factor = self.factor
        stretch = compute / (u.compute_s * factor) if u.compute_s else 1.0
        add, issued = sim.events.append, sim.issued
        for name, d, comm in zip(u.tasks, u.durations, u.is_comm):
            d = d if comm else d * factor * stretch
            add((rep, t, next(issued), "comm" if comm else "compute", a, name, t + d))
            t += d
        sim.memory.append((rep, sim.env.now, self.mem))

    def send(self, u: Send, a: str, delivered: simpy.Event | None = None) -> None:
        """A message leaves as a flow on the network (or, priced in closed form, is posted with its
        arrival time); the device goes on (its buffer is freed). ``delivered`` fires on arrival."""
        sim, rep, st = self.sim, self.rep, self.st
        env = sim.env
        start, seq = env.now, next(sim.issued)
        box = sim.mailbox(rep, u.peer, u.tag)

        def arrived(at: float) -> None:
            st["comm_s"] += at - start
            if sim.timeline:
                sim.record(rep, "comm", a, u.task, start, at, seq)
            box.post(at)
            if delivered is not None:
                delivered.succeed(at)

        if u.closed:  # its arrival is known now: no flow on the network, no event of its own
            arrived(start + u.duration_s)
        else:
            sim.net.transfer(u.duration_s, sim.links(rep, u.peer), lambda: arrived(env.now))
        self.mem -= u.free_bytes

    def pipeline_blocking(self, units: tuple, backward: bool) -> tuple:
        """``units`` with only the messages between pipeline stages blocking (a software's
        ``pipeline_p2p`` is its pipeline engine's; messages within a stage, a layout conversion's,
        stay asynchronous), and in a backward block the receives from the next stage first."""
        stages = self.sim.stages_of
        out = tuple(
            replace(u, blocking=False)
            if isinstance(u, (Send, Recv)) and u.blocking and stages[self.rep] == stages[self.sim.cls[u.peer]]
            else u
            for u in units
        )
        return receives_first(out) if backward and any(isinstance(u, Recv) and u.blocking for u in out) else out

    def defers_sends(self, action: Action, after: Action, last_mb: int) -> bool:
        """Whether the blocking sends of forward ``action`` wait until the backward ``after`` has
        received its gradient: DeepSpeed's TrainSchedule (schedule.py) runs stage s's forward of
        micro-batch k in step 2k + s and its backward of j in step 2j + 2p - s - 1, and issues a
        forward's SendActivation in the next step, after that step's RecvGrad when it has one (j =
        k + s + 1 - p), so that two stages sending to each other at once cannot both block."""
        if action.phase != "F" or after.phase != "B" or not self.sim.rendezvous:
            return False
        if after.microbatch != action.microbatch + action.stage + 1 - self.sim.stages:
            return False  # the step after the forward has no backward: the activation leaves at once
        units = self.block_units(after, after.microbatch == last_mb)
        return bool(units) and isinstance(units[0], Recv) and units[0].blocking

    def send_deferred(self, deferred: list):
        """Send the deferred blocking sends in order, each waiting until delivered."""
        todo = list(deferred)
        deferred.clear()
        for u, a in todo:
            yield from self.send_and_wait(u, a)

    def send_and_wait(self, u: Send, a: str):
        """A blocking send (the software's ``pipeline_p2p`` is ``"blocking"``): it starts once the
        receiver has posted its receive (NCCL's send of a message larger than its buffers completes
        only as the receiver takes it; the wait is the sender's bubble), leaves as :meth:`send`
        sends it, and the device waits until it is delivered, its time exposed."""
        sim, env, st = self.sim, self.sim.env, self.st
        start, box = env.now, sim.mailbox(self.rep, u.peer, u.tag)
        if not sim.rendezvous:  # another schedule than DeepSpeed's: the sender waits for delivery only
            pass
        elif box.ready:
            box.ready.popleft()
        else:
            yield box.wait_ready(env)
        st["wait_s"] += env.now - start
        st["bubble_s"] += env.now - start
        if sim.timeline and env.now > start:
            sim.record(self.rep, "wait", a, u.task, start, env.now)
        sent = env.now
        delivered = env.event()
        self.send(u, a, delivered)
        at = yield delivered
        if at > env.now:  # priced in closed form: posted at once with its arrival time
            yield env.timeout(at - env.now)
        st["exposed_s"] += env.now - sent

    def start_overlapped(self, u: AsyncCollective, a: str, action: Action):
        """Issue a collective on the communication stream (its output allocated now); it starts
        when every class has issued it and the stream is free."""
        sim = self.sim
        if u.alloc_bytes:
            self.bump(u.alloc_bytes, u.task)
            self.mem += u.alloc_bytes
            if sim.timeline:
                sim.memory.append((self.rep, sim.env.now, self.mem))
        if not self.pending and u.duration_s and sim.within_class(u.group):
            done = self.overlapped_now(u, a, next(sim.issued))
        else:
            ready = sim.barrier(u.ident, action.microbatch, u.group)
            done = sim.env.process(self.overlapped(u, ready, a, next(sim.issued)))
            self.pending += 1
        self.in_flight.append(done)
        self.by_name[u.task] = done
        yield from ()

    def overlapped_now(self, u: AsyncCollective, a: str, seq: int) -> simpy.Event:
        """An overlapped collective whose members are all in this class, issued with no other
        waiting for its barrier: it takes the stream now, after what the stream holds, as
        :meth:`overlapped` would once its barrier fires at this instant, so its end is known at
        once. Its timeout (whose callback does what :meth:`overlapped` does at the end) and the
        event returned (which fires after, as a process's end would) stand for the process, its
        start and its barrier: a ZeRO-3 run issues hundreds of thousands, and events run in the
        same order. Computation that starts now sees the stream's new end (:meth:`share`), as it
        would once the collective's start interrupted it at this same instant."""
        sim, rep = self.sim, self.rep
        env = sim.env
        issued_at = env.now
        start = max(issued_at, sim.coll_free[rep])
        sim.coll_free[rep] = start + u.duration_s
        done = env.event()

        def end(_) -> None:
            self.overlapped_end(u, a, issued_at, seq)
            done.succeed()

        env.timeout(sim.coll_free[rep] - issued_at).callbacks.append(end)
        return done

    def overlapped_end(self, u: AsyncCollective, a: str, issued_at: float, seq: int) -> None:
        """What an overlapped collective does as it ends: its time counted, its copy out owed, its
        event recorded, its input freed."""
        sim, rep = self.sim, self.rep
        sim.stats[rep]["comm_s"] += u.duration_s
        if u.copy_out_s:
            self.owed_s[u.task] = self.owed_s.get(u.task, 0.0) + u.copy_out_s
        if sim.timeline:
            sim.record(rep, "comm", a, u.task, issued_at, sim.env.now, seq)  # in flight
        self.release(u.free_bytes)

    def start_copy(self, u: HostCopy, a: str, mb: int) -> None:
        """Issue copies on the device's copy stream (what they write allocated now); they run after
        the copies issued before them, while the device computes, and free what they read when done."""
        sim = self.sim
        if u.alloc_bytes:
            self.bump(u.alloc_bytes, u.tasks[0])
            self.mem += u.alloc_bytes
            if sim.timeline:
                sim.memory.append((self.rep, sim.env.now, self.mem))
        sources = [self.copied.pop((name, mb)) for name in u.after if (name, mb) in self.copied]
        proc = sim.env.process(self.copying(u, a, next(sim.issued), sources))
        self.in_flight.append(proc)
        for name in u.tasks:
            self.by_name[name] = proc
            if u.to_host:  # its copy back waits for it
                self.copied[(name, mb)] = proc

    def copying(self, u: HostCopy, a: str, seq: int, sources: list):
        """The process of copies on the copy stream: in turn after the ones before, then their inputs freed."""
        sim, env = self.sim, self.sim.env
        issued_at = env.now
        if sources:  # a copy back starts once its activations are on the host
            yield env.all_of(sources)
        free = self.copy_free_s
        start = max(env.now, free[u.to_host])
        free[u.to_host] = start + u.duration_s
        yield env.timeout(free[u.to_host] - env.now)
        if sim.timeline:
            sim.record(self.rep, "copy", a, u.tasks[0], issued_at, env.now, seq)
        self.release(u.free_bytes)

    def overlapped(self, u: AsyncCollective, ready: simpy.Event, a: str, seq: int):
        """The process of an overlapped collective: the barrier, then the stream, then its input freed."""
        sim, rep = self.sim, self.rep
        env = sim.env
        issued_at = env.now
        yield ready
        self.pending -= 1
        start = max(env.now, sim.coll_free[rep])
        sim.coll_free[rep] = start + u.duration_s
        if self.computing and u.duration_s:  # the stream is busy longer: the computation under way
            self.computing = False  # is interrupted (once) and goes on from where it was
            self.proc.interrupt()
        yield env.timeout(sim.coll_free[rep] - env.now)
        self.overlapped_end(u, a, issued_at, seq)

    def wait_for(self, u: Await, a: str):
        """Wait for the latest runs of the overlapped collectives the next task reads from (no
        event of its own: the collectives' events show the wait), then run their copies out."""
        env = self.sim.env
        start = env.now
        awaited = [self.by_name[name] for name in u.tasks if name in self.by_name]
        # all done and nothing else due now: the condition's event would be the next to run
        if env.peek() <= start or any(not e.processed for e in awaited):
            yield env.all_of(awaited)
        self.st["exposed_s"] += env.now - start
        yield from self.copy_out(u.tasks, a)

    def collective(self, u: Collective, a: str, action: Action):
        """A collective across classes: wait for every class at its barrier, then run it."""
        sim, st = self.sim, self.st
        env = sim.env
        start = env.now
        yield sim.barrier(u.ident, action.microbatch, u.group)
        st["wait_s"] += env.now - start
        st["exposed_s"] += env.now - start
        self.bump(u.alloc_bytes, u.task)
        t0 = env.now
        yield env.timeout(u.duration_s)
        st["comm_s"] += u.duration_s
        st["exposed_s"] += u.duration_s
        self.mem += u.alloc_bytes - u.free_bytes
        if sim.timeline:
            sim.record(self.rep, "comm", a, u.task, t0, env.now)


def result(sim: Simulation, model_flops: float) -> SimResult:
    """The iteration's time, per class its statistics, the hardware FLOPs and the timeline."""
    program, cls = sim.program, sim.cls
    reps = sorted(set(cls))
    members = Counter(cls)  # class representative -> devices it stands for
    hw_flops = 0.0
    for r in reps:
        dp = program.device(r)
        per_action = {k: sum(t.flops for t in b.tasks if not t.final) for k, b in dp.blocks.items()}
        hw_flops += members[r] * sum(per_action[(a.stage, a.phase)] for a in dp.schedule)
    stats = sim.stats
    devs = tuple(
        DeviceStats(
            r,
            members[r],
            stats[r]["finish"],
            stats[r]["compute_s"],
            stats[r]["comm_s"],
            stats[r]["wait_s"],
            int(stats[r]["peak"]),
            stats[r]["peak_at"],
            stats[r]["peak_task"],
            exposed_comm_s=stats[r]["exposed_s"],
            bubble_s=stats[r]["bubble_s"],
        )
        for r in reps
    )
    return SimResult(
        iter_time_s=max(d.finish_s for d in devs),
        devices=devs,
        device_memory_bytes=sim.cost.device_memory_bytes,
        model_flops=model_flops,
        hardware_flops=hw_flops,
        num_devices=program.num_devices,
        peak_flops_per_s=peak_flops_per_s(
            sim.cost.cluster.device, program.precision.elementwise_dtype
        ),  # MFU: the 16-bit peak
        events=tuple(Event(d, st, a, n, s, e) for d, s, _, st, a, n, e in sorted(sim.events)),
        memory=tuple(sim.memory),
        **host_memory(program, sim.cost.cluster),
    )


def host_memory(program: Program, cluster: ClusterSpec) -> dict[str, float]:
    """The fullest node's host memory taken by offloaded state and a node's host memory, as
    :class:`SimResult` fields (none when nothing is offloaded)."""
    if not any(dp.host_bytes for dp in program.devices):
        return {}
    per_node = cluster.node.devices_per_node
    nodes: dict[int, float] = {}
    for d in range(program.num_devices):
        nodes[d // per_node] = nodes.get(d // per_node, 0.0) + program.device(d).host_bytes
    return {"host_peak_bytes": max(nodes.values()), "host_memory_bytes": host_of(cluster).memory_bytes}


def in_deepspeed_order(schedule: tuple[Action, ...], stages: int) -> bool:
    """Whether ``schedule``'s forwards and backwards come in the order of DeepSpeed's
    TrainSchedule (schedule.py), where stage s runs the forward of micro-batch k in step 2k + s and
    the backward of j in step 2j + 2 stages - s - 1 (Megatron-LM's 1F1B is in that order)."""
    work = [a for a in schedule if a.phase != "U"]
    if any(a.phase not in ("F", "B") or a.overlaps for a in work) or len({a.stage for a in work}) > 1:
        return False  # a split backward (W), pairs, several stages a device: not DeepSpeed's pipeline

    def step(a: Action) -> int:
        return 2 * a.microbatch + a.stage if a.phase == "F" else 2 * a.microbatch + 2 * stages - a.stage - 1

    return all(step(a) < step(b) for a, b in zip(work, work[1:]))


def scaled(parts: tuple[float, ...], factor: float) -> tuple[float, ...]:
    """A segment's parts with its computation (the even parts) slowed by a straggler's ``factor``."""
    return tuple(p * factor if i % 2 == 0 else p for i, p in enumerate(parts))


class _Mailbox:
    """Arrival times of messages on one channel, first in first out, and a waiting receiver;
    receives posted and not yet matched (``ready``) and a blocking sender waiting for one."""

    def __init__(self) -> None:
        self.arrivals: deque[float] = deque()
        self.waiter: simpy.Event | None = None
        self.ready: deque[bool] = deque()
        self.sender: simpy.Event | None = None

    def post_ready(self) -> None:
        if self.sender is not None:
            w, self.sender = self.sender, None
            w.succeed()
        else:
            self.ready.append(True)

    def wait_ready(self, env: simpy.Environment) -> simpy.Event:
        self.sender = env.event()
        return self.sender

    def post(self, arrival: float) -> None:
        if self.waiter is not None:
            w, self.waiter = self.waiter, None
            w.succeed(arrival)
        else:
            self.arrivals.append(arrival)

    def take(self) -> float:
        return self.arrivals.popleft()

    def wait(self, env: simpy.Environment) -> simpy.Event:
        self.waiter = env.event()
        return self.waiter
