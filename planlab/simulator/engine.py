"""The simpy model: one process per device class runs its schedule's units.

Segments occupy the device; sends are flows on the network (links shared fairly
between concurrent transfers) while the device goes on; receives wait for the
matching message; collectives that span classes start when every class has
reached them; overlapped collectives (gradient buckets, ZeRO-3's gathers and reduce-scatters)
run on the device's communication stream; a task that reads their output waits for them (an
:class:`~planlab.simulator.units.Await`), and so does the optimizer.
"""

from __future__ import annotations

from collections import Counter, defaultdict, deque
from itertools import count

import simpy

from planlab.costmodel import CostModel
from planlab.costmodel.compute import peak_flops_per_s
from planlab.errors import ConfigError, DeadlockError
from planlab.gcpause import paused_gc
from planlab.plan.program import Program
from planlab.simulator.classes import device_classes
from planlab.simulator.network import Network
from planlab.simulator.result import DeviceStats, Event, SimResult
from planlab.simulator.units import (
    AsyncCollective,
    Await,
    Collective,
    Recv,
    Segment,
    Send,
    lower_block,
    overlap_writers,
)


def simulate(
    program: Program,
    cost: CostModel,
    *,
    model_flops: float = 0.0,
    timeline: bool = False,
    symmetry: bool = True,
    stragglers: dict[int, float] | None = None,
    overlap_slowdown: float = 1.0,
) -> SimResult:
    """Simulate one iteration of ``program``; ``model_flops`` (forward + backward of the
    model at the global batch) gives MFU. With ``timeline`` every task is recorded. With
    ``symmetry`` one representative per device class is simulated (same result, less work).
    ``stragglers`` maps devices to a factor (> 1) slowing their computation, for what-if studies.
    ``overlap_slowdown`` (>= 1) stretches computation while an overlapped collective shares the device."""
    with paused_gc():
        return _simulate(
            program,
            cost,
            model_flops=model_flops,
            timeline=timeline,
            symmetry=symmetry,
            stragglers=stragglers,
            overlap_slowdown=overlap_slowdown,
        )


def _simulate(
    program: Program,
    cost: CostModel,
    *,
    model_flops: float,
    timeline: bool,
    symmetry: bool,
    stragglers: dict[int, float] | None,
    overlap_slowdown: float,
) -> SimResult:
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
    if program.reduced:
        if slow or not symmetry:
            raise ConfigError(
                "this Program holds one representative per device class; stragglers and "
                "symmetry=False need every device's tasks: materialize with symmetric=False"
            )
        cls = list(program.classes)
    else:
        cls = device_classes(program, cluster, slow) if symmetry else list(range(program.num_devices))
    reps = sorted(set(cls))
    members = Counter(cls)  # class representative -> devices it stands for
    dtype = program.precision.compute_dtype
    last_mb = program.microbatches - 1
    env = simpy.Environment()
    net = Network(env)
    coll_free = {r: 0.0 for r in reps}  # when each device's collective stream is next free
    boxes: dict[tuple, _Mailbox] = defaultdict(_Mailbox)
    barriers: dict[tuple, list] = {}
    stats: dict[int, dict] = {}
    events: list[tuple[int, Event]] = []  # (issue order, event)
    issued = count()
    memory: list[tuple[int, float, int]] = []
    hw_flops = 0.0

    def mailbox(src: int, dst: int, tag: int) -> "_Mailbox":
        return boxes[(cls[src], cls[dst], tag)]

    link_cache: dict[tuple[int, int], tuple] = {}
    prices: dict = {}  # task times by what they depend on, shared by every device

    def links(src: int, dst: int) -> tuple:
        got = link_cache.get((src, dst))
        if got is None:
            kind = "nvlink" if cluster.node_of(src) == cluster.node_of(dst) else "nic"
            got = link_cache[(src, dst)] = ((kind, "out", src), (kind, "in", dst))
        return got

    def send(rep: int, unit: Send, action: str, seq: int) -> None:
        start = env.now
        box = mailbox(rep, unit.peer, unit.tag)

        def arrived() -> None:
            stats[rep]["comm_s"] += env.now - start
            if timeline:
                events.append((seq, Event(rep, "comm", action, unit.task, start, env.now)))
            box.post(env.now)

        net.transfer(unit.duration_s, links(rep, unit.peer), arrived)

    def barrier(key_cls: tuple, n: int) -> simpy.Event:
        bar = barriers.setdefault((key_cls, n), [0, env.event()])
        bar[0] += 1
        if bar[0] == len(key_cls):
            bar[1].succeed()
        return bar[1]

    def overlapped(rep: int, unit: AsyncCollective, ready: simpy.Event, action: str, seq: int, done):
        issued_at = env.now
        yield ready
        start = max(env.now, coll_free[rep])
        coll_free[rep] = start + unit.duration_s
        yield env.timeout(coll_free[rep] - env.now)
        stats[rep]["comm_s"] += unit.duration_s
        if timeline:
            events.append((seq, Event(rep, "comm", action, unit.task, issued_at, env.now)))  # in flight
        done(unit.free_bytes)

    def device(rep: int):
        dp = program.device(rep)
        sizes: dict[str, int] = {}
        for b in dp.blocks.values():
            for t in b.tasks:
                sizes.update(t.alloc)
        writers = overlap_writers(dp.blocks.values())
        units: dict[tuple, tuple] = {}
        st = stats[rep] = dict(
            compute_s=0.0,
            comm_s=0.0,
            wait_s=0.0,
            exposed_s=0.0,
            bubble_s=0.0,
            peak=dp.static_bytes,
            peak_at=0.0,
            peak_task="(weights)",
        )
        factor = slow.get(rep, 1.0)
        mem = dp.static_bytes
        seen_coll: dict[tuple, int] = defaultdict(int)
        in_flight: list[simpy.Process] = []
        by_name: dict[str, simpy.Process] = {}  # the latest overlapped collective of each name
        if timeline:
            memory.append((rep, 0.0, mem))

        def bump(extra: int, name: str) -> None:
            if mem + extra > st["peak"]:
                st["peak"], st["peak_at"], st["peak_task"] = mem + extra, env.now, name

        def release(nbytes: int) -> None:
            """An overlapped collective completed: its input is freed."""
            nonlocal mem
            if nbytes:
                mem -= nbytes
                if timeline:
                    memory.append((rep, env.now, mem))

        def drain():
            """Wait for the overlapped collectives still running."""
            start = env.now
            yield env.all_of(in_flight)
            in_flight.clear()
            st["exposed_s"] += env.now - start

        for action in dp.schedule:
            a = str(action)
            key = (action.stage, action.phase, action.microbatch == last_mb)
            block_units = units.get(key)
            if block_units is None:
                block_units = units[key] = lower_block(
                    dp.blocks[key[:2]],
                    device=rep,
                    cls=cls,
                    cost=cost,
                    dtype=dtype,
                    sizes=sizes,
                    final=key[2],
                    prices=prices,
                    writers=writers,
                )
            if action.phase == "U" and in_flight:
                yield from drain()
            for u in block_units:
                if isinstance(u, Segment):
                    bump(u.peak_bytes, u.peak_task)
                    start = env.now
                    if timeline:
                        memory.append((rep, start, mem + u.peak_bytes))
                    compute = u.compute_s * factor
                    if overlap_slowdown != 1.0 and coll_free[rep] > start:
                        compute += min(compute, coll_free[rep] - start) * (overlap_slowdown - 1.0)
                    yield env.timeout(compute + u.comm_s)
                    st["compute_s"] += compute
                    st["comm_s"] += u.comm_s
                    st["exposed_s"] += u.comm_s
                    mem += u.net_bytes
                    if timeline:
                        t = start
                        stretch = compute / (u.compute_s * factor) if u.compute_s else 1.0
                        for name, d, comm in zip(u.tasks, u.durations, u.is_comm):
                            d = d if comm else d * factor * stretch
                            stream = "comm" if comm else "compute"
                            events.append((next(issued), Event(rep, stream, a, name, t, t + d)))
                            t += d
                        memory.append((rep, env.now, mem))
                elif isinstance(u, Send):
                    send(rep, u, a, next(issued))
                    mem -= u.free_bytes
                elif isinstance(u, Recv):
                    start = env.now
                    box = mailbox(u.peer, rep, u.tag)
                    arrival = box.take() if box.arrivals else (yield box.wait(env))
                    if arrival > env.now:
                        yield env.timeout(arrival - env.now)
                    st["wait_s"] += env.now - start
                    st["bubble_s"] += env.now - start
                    bump(u.alloc_bytes, u.task)
                    mem += u.alloc_bytes
                    if timeline:
                        events.append((next(issued), Event(rep, "wait", a, u.task, start, env.now)))
                elif isinstance(u, AsyncCollective):
                    key_cls = tuple(sorted({cls[d] for d in u.group}))
                    n = seen_coll[key_cls]
                    seen_coll[key_cls] += 1
                    if u.alloc_bytes:
                        bump(u.alloc_bytes, u.task)
                        mem += u.alloc_bytes
                        if timeline:
                            memory.append((rep, env.now, mem))
                    proc = env.process(overlapped(rep, u, barrier(key_cls, n), a, next(issued), release))
                    in_flight.append(proc)
                    by_name[u.task] = proc
                    if overlap_slowdown != 1.0:
                        yield env.timeout(0)  # let it claim the stream, so what follows knows it is shared
                elif isinstance(u, Await):  # no event: the collectives' own events show the wait
                    start = env.now
                    yield env.all_of([by_name[name] for name in u.tasks if name in by_name])
                    st["exposed_s"] += env.now - start
                elif isinstance(u, Collective):
                    key_cls = tuple(sorted({cls[d] for d in u.group}))
                    n = seen_coll[key_cls]
                    seen_coll[key_cls] += 1
                    start = env.now
                    yield barrier(key_cls, n)
                    st["wait_s"] += env.now - start
                    st["exposed_s"] += env.now - start
                    bump(u.alloc_bytes, u.task)
                    t0 = env.now
                    yield env.timeout(u.duration_s)
                    st["comm_s"] += u.duration_s
                    st["exposed_s"] += u.duration_s
                    mem += u.alloc_bytes - u.free_bytes
                    if timeline:
                        events.append((next(issued), Event(rep, "comm", a, u.task, t0, env.now)))
        if in_flight:
            yield from drain()
        st["finish"] = env.now

    for r in reps:
        env.process(device(r))
    env.run()
    stuck = [r for r in reps if "finish" not in stats.get(r, {})]
    if stuck:
        raise DeadlockError(
            f"simulation stopped with device(s) {stuck} still waiting; run the dry run "
            "(planlab.simulator.find_deadlock) for the task each waits on"
        )
    for r in reps:
        dp = program.device(r)
        per_action = {k: sum(t.flops for t in b.tasks if not t.final) for k, b in dp.blocks.items()}
        hw_flops += members[r] * sum(per_action[(a.stage, a.phase)] for a in dp.schedule)
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
        device_memory_bytes=cost.device_memory_bytes,
        model_flops=model_flops,
        hardware_flops=hw_flops,
        num_devices=program.num_devices,
        peak_flops_per_s=peak_flops_per_s(cluster.device, program.precision.elementwise_dtype),  # MFU: the 16-bit peak
        events=tuple(e for _, e in sorted(events, key=lambda x: (x[1].device, x[1].start_s, x[0]))),
        memory=tuple(memory),
    )


class _Mailbox:
    """Arrival times of messages on one channel, first in first out, and a waiting receiver."""

    def __init__(self) -> None:
        self.arrivals: deque[float] = deque()
        self.waiter: simpy.Event | None = None

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
