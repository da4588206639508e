"""The simpy model: one process per device class runs its schedule's units.

Segments occupy the device; sends run on the device's communication stream,
first come first served, while the device goes on; receives wait for the matching
send; collectives that span classes start when every class has reached them.
"""

from __future__ import annotations

from collections import Counter, defaultdict, deque

import simpy

from planlab.costmodel import CostModel
from planlab.costmodel.compute import peak_flops_per_s
from planlab.errors import ConfigError, DeadlockError
from planlab.plan.program import Program
from planlab.simulator.classes import device_classes
from planlab.simulator.result import DeviceStats, Event, SimResult
from planlab.simulator.units import Collective, Recv, Segment, Send, lower_block


def simulate(program: Program, cost: CostModel, *, model_flops: float = 0.0, timeline: bool = False,
             symmetry: bool = True, stragglers: dict[int, float] | None = None) -> SimResult:
    """Simulate one iteration of ``program``; ``model_flops`` (forward + backward of the
    model at the global batch) gives MFU. With ``timeline`` every task is recorded. With
    ``symmetry`` one representative per device class is simulated (same result, less work).
    ``stragglers`` maps devices to a factor (> 1) slowing their computation, for what-if studies."""
    cluster = cost.cluster
    if program.num_devices > cluster.num_devices:
        raise DeadlockError(f"the program has {program.num_devices} devices; the cluster {cluster} has "
                            f"{cluster.num_devices}")
    slow = dict(stragglers or {})
    bad = {d: f for d, f in slow.items() if not isinstance(d, int) or not isinstance(f, (int, float))
           or not 0 <= d < program.num_devices or not f > 0}
    if bad:
        raise ConfigError(f"stragglers {bad}: devices must be 0..{program.num_devices - 1} and factors positive")
    cls = device_classes(program, cluster, slow) if symmetry else list(range(program.num_devices))
    reps = sorted(set(cls))
    members = Counter(cls)  # class representative -> devices it stands for
    dtype = program.precision.compute_dtype
    env = simpy.Environment()
    comm_free = {r: 0.0 for r in reps}  # when each communication stream is next free
    boxes: dict[tuple, _Mailbox] = defaultdict(_Mailbox)
    barriers: dict[tuple, list] = {}
    stats: dict[int, dict] = {}
    events: list[Event] = []
    memory: list[tuple[int, float, int]] = []
    hw_flops = 0.0

    def mailbox(src: int, dst: int, tag: int) -> "_Mailbox":
        return boxes[(cls[src], cls[dst], tag)]

    def send(rep: int, unit: Send, action: str) -> None:
        # The send occupies the communication stream, first come first served, while the device goes on.
        start = max(env.now, comm_free[rep])
        arrival = comm_free[rep] = start + unit.duration_s
        stats[rep]["comm_s"] += unit.duration_s
        if timeline:
            events.append(Event(rep, "comm", action, unit.task, start, arrival))
        mailbox(rep, unit.peer, unit.tag).post(arrival)

    def device(rep: int):
        dp = program.devices[rep]
        sizes: dict[str, int] = {}
        for b in dp.blocks.values():
            for t in b.tasks:
                sizes.update(t.alloc)
        units = {k: lower_block(b, device=rep, cls=cls, cost=cost, dtype=dtype, sizes=sizes)
                 for k, b in dp.blocks.items()}
        st = stats[rep] = dict(compute_s=0.0, comm_s=0.0, wait_s=0.0, peak=dp.static_bytes, peak_at=0.0,
                               peak_task="(weights)")
        factor = slow.get(rep, 1.0)
        mem = dp.static_bytes
        seen_coll: dict[tuple, int] = defaultdict(int)
        if timeline:
            memory.append((rep, 0.0, mem))

        def bump(extra: int, name: str) -> None:
            if mem + extra > st["peak"]:
                st["peak"], st["peak_at"], st["peak_task"] = mem + extra, env.now, name

        for action in dp.schedule:
            a = str(action)
            for u in units[(action.stage, action.phase)]:
                if isinstance(u, Segment):
                    bump(u.peak_bytes, u.peak_task)
                    start = env.now
                    if timeline:
                        memory.append((rep, start, mem + u.peak_bytes))
                    yield env.timeout(u.compute_s * factor + u.comm_s)
                    st["compute_s"] += u.compute_s * factor
                    st["comm_s"] += u.comm_s
                    mem += u.net_bytes
                    if timeline:
                        t = start
                        for name, d, comm in zip(u.tasks, u.durations, u.is_comm):
                            d = d if comm else d * factor
                            events.append(Event(rep, "comm" if comm else "compute", a, name, t, t + d))
                            t += d
                        memory.append((rep, env.now, mem))
                elif isinstance(u, Send):
                    send(rep, u, a)
                    mem -= u.free_bytes
                elif isinstance(u, Recv):
                    start = env.now
                    box = mailbox(u.peer, rep, u.tag)
                    arrival = box.take() if box.arrivals else (yield box.wait(env))
                    if arrival > env.now:
                        yield env.timeout(arrival - env.now)
                    st["wait_s"] += env.now - start
                    bump(u.alloc_bytes, u.task)
                    mem += u.alloc_bytes
                    if timeline:
                        events.append(Event(rep, "wait", a, u.task, start, env.now))
                elif isinstance(u, Collective):
                    key_cls = tuple(sorted({cls[d] for d in u.group}))
                    n = seen_coll[key_cls]
                    seen_coll[key_cls] += 1
                    bar = barriers.setdefault((key_cls, n), [0, env.event()])
                    bar[0] += 1
                    start = env.now
                    if bar[0] == len(key_cls):
                        bar[1].succeed()
                    yield bar[1]
                    st["wait_s"] += env.now - start
                    bump(u.alloc_bytes, u.task)
                    t0 = env.now
                    yield env.timeout(u.duration_s)
                    st["comm_s"] += u.duration_s
                    mem += u.alloc_bytes - u.free_bytes
                    if timeline:
                        events.append(Event(rep, "comm", a, u.task, t0, env.now))
        st["finish"] = env.now

    for r in reps:
        env.process(device(r))
    env.run()
    stuck = [r for r in reps if "finish" not in stats.get(r, {})]
    if stuck:
        raise DeadlockError(f"simulation stopped with device(s) {stuck} still waiting; run the dry run "
                            "(planlab.simulator.find_deadlock) for the task each waits on")
    for r in reps:
        dp = program.devices[r]
        per_action = {k: sum(t.flops for t in b.tasks) for k, b in dp.blocks.items()}
        hw_flops += members[r] * sum(per_action[(a.stage, a.phase)] for a in dp.schedule)
    devs = tuple(DeviceStats(r, members[r], stats[r]["finish"], stats[r]["compute_s"], stats[r]["comm_s"],
                             stats[r]["wait_s"], int(stats[r]["peak"]), stats[r]["peak_at"], stats[r]["peak_task"])
                 for r in reps)
    return SimResult(iter_time_s=max(d.finish_s for d in devs), devices=devs,
                     device_memory_bytes=cost.device_memory_bytes, model_flops=model_flops,
                     hardware_flops=hw_flops, num_devices=program.num_devices,
                     peak_flops_per_s=peak_flops_per_s(cluster.device, dtype),
                     events=tuple(sorted(events, key=lambda e: (e.device, e.start_s))), memory=tuple(memory))


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
