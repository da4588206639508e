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

The computation runs in the order the software issues it, not in the order its inputs arrive:
Megatron-Core's combined 1F1B step (``TransformerLayerSchedulePlan.run`` in
``megatron/core/models/common/model_chunk_schedule_plan.py``, core_r0.14.0) launches, layer by layer,
the backward's head and combine backward, the forward's attention, the backward's MLP (with its
weight gradients), the forward's MLP, the backward's attention, each kernel on its stream in that
order, and a CUDA stream runs its kernels in launch order; DeepSeek-V3's report (figure 4) draws its
pair in the same alternation. So when both actions dispatch experts, the computation between two of
an action's all-to-alls (a block) waits for its turn: the backward's block ``b`` for the forward's
blocks before ``b``, the forward's block ``b`` for the backward's blocks up to ``b`` (B0 F0 B1 F1 ...,
:class:`_Turns`); once one action has ended, the other runs freely. A greedy order (whichever action
asks first takes the stream) would let a slower kernel shorten the step, by moving a later-arriving
block ahead of the other's. A pair whose actions do not both dispatch keeps the greedy order (no
all-to-all to delimit the turns).
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
    units = [run.block_units(x, x.microbatch == last_mb) for x in (first, second)]
    turns = _Turns(env, lead=0 if first.phase == "B" else 1) if all(map(_dispatches, units)) else None
    yield env.all_of(
        [
            env.process(_half(run, x, u, streams, comm_until, turns, h))
            for h, (x, u) in enumerate(zip((first, second), units))
        ]
    )
    busy = (st["compute_s"] - compute0) + (st["bubble_s"] - bubble0)
    st["exposed_s"] = exposed0 + max(0.0, env.now - start - busy)


class _Turns:
    """The launch order of a pair's computation blocks (the module's docstring): action ``lead`` (the
    backward) runs its block ``b`` after the other's blocks before ``b``, the other its block ``b`` after
    the lead's blocks up to ``b``. A block ends when its action starts its next all-to-all."""

    def __init__(self, env: simpy.Environment, lead: int):
        self.env, self.lead = env, lead
        self.block, self.ended = [0, 0], [False, False]
        self.moved = env.event()  # succeeds when either action ends a block or ends

    def may_compute(self, h: int) -> bool:
        """Whether action ``h`` may launch the computation of its current block."""
        other = 1 - h
        if self.ended[other]:
            return True
        return self.block[other] >= self.block[h] + (h != self.lead)

    def advance(self, h: int, ended: bool = False) -> None:
        """Action ``h`` ended its block (it starts an all-to-all), or ended (``ended``)."""
        if ended:
            self.ended[h] = True
        else:
            self.block[h] += 1
        moved, self.moved = self.moved, self.env.event()
        moved.succeed()


def _dispatches(units: tuple) -> bool:
    """Whether an action's units hold an all-to-all (the expert dispatch or combine)."""
    return any(isinstance(u, Segment) and any(u.all_to_all) for u in units)


def _half(run, action: Action, units: tuple, streams: tuple, comm_until: list, turns: _Turns | None, h: int):
    """One action of a pair (``h``: 0 or 1): its ``units`` in order, its computation holding the compute
    stream (in its turn, with ``turns``), its all-to-alls the communication stream and its other
    class-internal collectives both (``streams``: compute, communication)."""
    env, st, a = run.sim.env, run.st, str(action)
    for u in units:
        if isinstance(u, Segment):
            if u.peak_bytes + run.mem > st["peak"]:
                run.bump(u.peak_bytes, u.peak_task)
            for k, part in enumerate(u.parts or (u.compute_s, u.comm_s)):
                if not part:
                    continue
                comm = k % 2  # odd parts: class-internal collectives
                beside = not comm or _overlapped(u, k)
                held = (streams[comm],) if beside else streams  # compute first, one at a time: no deadlock
                if turns is not None and comm and beside:  # an all-to-all ends the action's block
                    turns.advance(h)
                while turns is not None and not comm and not turns.may_compute(h):  # its block's turn
                    yield turns.moved
                requests = []
                try:
                    for s in held:
                        requests.append(s.request())
                        yield requests[-1]
                    t0 = env.now
                    if comm:
                        took = part
                        if beside:
                            comm_until[0] = t0 + part
                    else:
                        took = _stretched(part * run.factor, comm_until[0] - t0, run.sim.pair_slowdown)
                    yield env.timeout(took)
                finally:
                    for s, request in zip(held, requests):
                        s.release(request)
                st["comm_s" if comm else "compute_s"] += took
                if run.sim.timeline:
                    run.sim.record(run.rep, "comm" if comm else "compute", a, u.peak_task or a, t0, env.now)
            run.mem += u.net_bytes
        elif isinstance(u, Send):
            run.send(u, a)
        else:
            yield from run.unit(u, a, action)
    if turns is not None:
        turns.advance(h, ended=True)


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
