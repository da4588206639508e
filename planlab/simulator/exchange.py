"""Exchanges priced in closed form: the fair-share network's answer for a symmetric burst of messages.

A device that sends several messages back to back (a redistribution's pieces to every member of
another mesh, an all-to-all's parts) starts them at the same instant: each is a flow on the
sender's port out and the receiver's port in (:mod:`planlab.simulator.network`, max-min fair,
every port of capacity one, NVLink and the NIC apart). Flow by flow, a class-wide exchange over
1,024 devices is a million flows whose rates are recomputed whenever one starts or ends.

When such a burst is symmetric, max-min fairness has a closed form. Count, per link kind, the
messages of the sender's burst (``n_out``) and of the receiver's burst of receives (``n_in``);
a message's bottleneck is the port with the larger count. If every message on that port has it
as its bottleneck too (its own count on the other side is no larger), every message on the port
runs at the same rate and the port is saturated: that is max-min's allocation. The port then
serves its messages by processor sharing, so a message of ``w`` seconds alone finishes after
``sum(min(w_g, w) for g on the port)`` seconds: ``n * w`` when the messages are alike (the
network's own answer to 1e-9, tests/test_exchange.py), and the processor-sharing answer on the
bottleneck when they differ (messages across rails of a rail-optimized fabric).

The decision and the prices depend on the Program alone (bursts, their peers, the cost model), so
a full Program and its reduction to device classes price every message alike. Bursts whose
messages have other bottlenecks, and single messages (a pipeline's activations), stay flows on
the network, and so do the bursts they exchange messages with (directly or through others). What
the closed form leaves out: a burst's messages are assumed to start together
at their receivers too, and they do not share ports with flows outside the burst.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from planlab.costmodel import CostModel
from planlab.plan.program import Program, TaskKind


@dataclass(frozen=True)
class _Message:
    """One message of a burst seen from one end: the end's device, its peer, the channel, the
    link kind, the seconds alone on the link, the burst it belongs to, and its place in its block."""

    device: int
    peer: int
    tag: int
    kind: str
    work_s: float
    burst: tuple
    where: tuple


def message_tag(task) -> int:
    """The channel a message is matched on: its conversion's in a reduced Program, else its own tag."""
    return task.channel if task.channel >= 0 else task.tag


def _bursts(program: Program, cls: list[int], cost: CostModel, kind: TaskKind) -> list[_Message]:
    """Every send (or receive) of the representatives, each with the run of consecutive tasks of
    its kind it belongs to (its burst, split by link kind)."""
    node_of = cost.cluster.node_of
    out = []
    for rep in sorted(set(cls)):
        dp = program.device(rep)
        for key in sorted(dp.blocks):
            run = 0
            for i, t in enumerate(dp.blocks[key].tasks):
                if t.kind is not kind:
                    run = i + 1
                    continue
                link = "nvlink" if node_of(rep) == node_of(t.peer) else "nic"
                src, dst = (rep, t.peer) if kind is TaskKind.SEND else (t.peer, rep)
                work_s = cost.p2p_time_s(t.nbytes, src, dst)
                out.append(_Message(rep, t.peer, message_tag(t), link, work_s, (rep, key, run, link), (key, i)))
    return out


def exchange_prices(program: Program, cls: list[int], cost: CostModel) -> dict[tuple, dict[int, float]]:
    """Seconds of each send priced in closed form: per ``(device, (stage, phase))`` of a
    representative, the index of the task in its block -> seconds; other sends stay flows on the network."""
    sends = _bursts(program, cls, cost, TaskKind.SEND)
    recvs = _bursts(program, cls, cost, TaskKind.RECV)
    works: dict[tuple, list[float]] = defaultdict(list)
    for m in sends + recvs:
        works[m.burst].append(m.work_s)
    # a message is found from the other end by (that end's class, channel, this end's class, link kind)
    recv_burst, tainted = _by_channel(recvs, cls)
    other_max: dict[tuple, int] = defaultdict(int)  # per burst: the largest count at the other ends
    pairs = []
    for m in sends:
        theirs = recv_burst.get((cls[m.peer], m.tag, cls[m.device], m.kind))
        if theirs is None:  # no receive, or receives of the channel in several bursts: flows
            tainted.add(m.burst)
            continue
        n_out, n_in = len(works[m.burst]), len(works[theirs])
        other_max[m.burst] = max(other_max[m.burst], n_in)
        other_max[theirs] = max(other_max[theirs], n_out)
        pairs.append((m, theirs, n_out, n_in))
    open_ = set(tainted)  # bursts left to the network, with every burst they exchange messages with
    for m, theirs, n_out, n_in in pairs:
        port = theirs if n_in >= n_out else m.burst
        if max(n_out, n_in) < 2 or other_max[port] > len(works[port]):
            open_.update((m.burst, theirs))  # a lone message, or a port whose messages have other bottlenecks
    grown = True
    while grown:
        before = len(open_)
        for m, theirs, _, _ in pairs:
            if m.burst in open_ or theirs in open_:
                open_.update((m.burst, theirs))
        grown = len(open_) > before
    prices: dict[tuple, dict[int, float]] = defaultdict(dict)
    shared: dict[tuple, float] = {}  # (port, seconds alone) -> seconds on the port: a few works per port
    for m, theirs, n_out, n_in in pairs:
        if m.burst not in open_:
            key, index = m.where
            port = theirs if n_in >= n_out else m.burst
            got = shared.get((port, m.work_s))
            if got is None:
                got = shared[(port, m.work_s)] = sum(min(w, m.work_s) for w in works[port])
            prices[(m.device, key)][index] = got
    return dict(prices)


def _by_channel(recvs: list[_Message], cls: list[int]) -> tuple[dict, set]:
    """The burst of receives each ``(device, channel, class of the sender, link kind)`` falls in, and the
    bursts of the channels found in several (their messages stay flows)."""
    found: dict = {}
    tainted: set = set()
    for m in recvs:
        key = (m.device, m.tag, cls[m.peer], m.kind)
        if found.setdefault(key, m.burst) != m.burst:
            tainted.update((m.burst, found[key]))
    return {k: b for k, b in found.items() if b not in tainted}, tainted
