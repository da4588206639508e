"""Two actions run as a pair (``Action.overlaps``): DualPipe's overlapped forward and backward chunks.

DeepSeek-V3's report (section 3.2.1) runs the forward chunk of one micro-batch and the backward
chunk of another together, so that the all-to-all and pipeline communication of each hides behind
the computation of the other, both sharing one GPU's compute (a few SMs kept for communication).
Here each action of the pair runs as its own simpy process on the device, on two streams (each a
``simpy.Resource`` of capacity 1): the computation of its segments takes the compute stream, its
all-to-alls (the expert dispatch and combine) the communication stream, so that neither two
computations nor two all-to-alls (which share the device's links) run at once, but one action's
all-to-all runs beside the other's computation. Its other class-internal collectives (tensor
parallelism's) take both streams: they run in order with the chunk's computation on the compute
stream, as Megatron-Core's overlapped 1F1B (``--overlap-moe-expert-parallel-comm``) and DualPipe's
``overlapped_forward_backward`` leave them; DeepSeek-V3's report (section 3.2.1) hides only the
all-to-all and the pipeline's messages, and trains without tensor parallelism. Its messages and its
collectives across classes run as outside a pair. A computation that starts while the other's
collective runs is slowed by the SMs the dispatch kernels hold (``pair_slowdown``: the software's
``expert_dispatch_sms``, else the simulator's ``overlap_slowdown`` for any overlapped collective), until that collective ends (one that starts
during the computation does not slow it). The pair ends when both actions have. Communication is counted exposed only where the compute stream idled
in the pair and no pipeline message was awaited.
"""

from __future__ import annotations

import simpy

from planlab.plan.plan import Action
from planlab.simulator.units import Segment, Send


def run_pair(run, first: Action, second: Action, last_mb: int):
    """Run ``first`` and ``second`` on ``run`` (a :class:`~planlab.simulator.engine.DeviceRun`) as a
    pair (the module's docstring); a generator for the device's process."""
    env, st = run.sim.env, run.st
    streams = (simpy.Resource(env, capacity=1), simpy.Resource(env, capacity=1))  # compute, communication
    start, compute0, bubble0, exposed0 = env.now, st["compute_s"], st["bubble_s"], st["exposed_s"]
    comm_until = [0.0]  # when the communication stream's current collective ends
    yield env.all_of(
        [env.process(_half(run, x, streams, comm_until, x.microbatch == last_mb)) for x in (first, second)]
    )
    busy = (st["compute_s"] - compute0) + (st["bubble_s"] - bubble0)
    st["exposed_s"] = exposed0 + max(0.0, env.now - start - busy)


def _half(run, action: Action, streams: tuple[simpy.Resource, simpy.Resource], comm_until: list, final: bool):
    """One action of a pair: its units in order, its computation holding the compute stream, its
    all-to-alls the communication stream and its other class-internal collectives both (``streams``)."""
    env, st, a = run.sim.env, run.st, str(action)
    for u in run.block_units(action, final):
        if isinstance(u, Segment):
            if u.peak_bytes + run.mem > st["peak"]:
                run.bump(u.peak_bytes, u.peak_task)
            for k, part in enumerate(u.parts or (u.compute_s, u.comm_s)):
                if not part:
                    continue
                comm = k % 2  # odd parts: class-internal collectives
                beside = not comm or _overlapped(u, k)
                held = (streams[comm],) if beside else streams  # compute first, one at a time: no deadlock
                turns = []
                try:
                    for s in held:
                        turns.append(s.request())
                        yield turns[-1]
                    t0 = env.now
                    if comm:
                        took = part
                        if beside:
                            comm_until[0] = t0 + part
                    else:
                        took = _stretched(part * run.factor, comm_until[0] - t0, run.sim.pair_slowdown)
                    yield env.timeout(took)
                finally:
                    for s, turn in zip(held, turns):
                        s.release(turn)
                st["comm_s" if comm else "compute_s"] += took
                if run.sim.timeline:
                    run.sim.record(run.rep, "comm" if comm else "compute", a, u.peak_task or a, t0, env.now)
            run.mem += u.net_bytes
        elif isinstance(u, Send):
            run.send(u, a)
        else:
            yield from run.unit(u, a, action)


def _overlapped(u: Segment, k: int) -> bool:
    """Whether the collective of ``u``'s odd part ``k`` runs beside the other action's computation:
    an all-to-all (the lowering marks each collective part, :attr:`Segment.all_to_all`)."""
    return u.all_to_all[k // 2]


def _stretched(compute_s: float, beside_s: float, slowdown: float) -> float:
    """How long ``compute_s`` of computation takes when a collective runs beside it for its first
    ``beside_s`` (``slowdown`` times slower meanwhile)."""
    if beside_s <= 0 or slowdown == 1.0:
        return compute_s
    if compute_s * slowdown <= beside_s:
        return compute_s * slowdown
    return beside_s + compute_s - beside_s / slowdown
