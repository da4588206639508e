"""Symmetric bursts of messages priced in closed form give the fair-share network's answer.

Each case is a Program whose devices send their messages back to back at time 0 and then receive
theirs (an all-to-all inside a node and across nodes of a rail-optimized fabric, a gather of every
device's piece onto a few receivers as the interlaced pipeline's embedding makes). The closed form
(:func:`planlab.simulator.exchange.exchange_prices`) is compared with the same messages started
together as flows on :class:`planlab.simulator.network.Network`, to 1e-9 relative.
"""

import pytest
import simpy

from planlab.costmodel import CostModel
from planlab.plan import FP32, Action, Block, DeviceProgram, Program, Task, TaskKind
from planlab.simulator import simulate
from planlab.simulator.exchange import exchange_prices
from planlab.simulator.network import Network

NBYTES = 1 << 20


def _exchange(devices: int, pairs: list[tuple[int, int]], nbytes=lambda s, d: NBYTES) -> Program:
    """Every device sends its messages of ``pairs`` (sender, receiver) at once, then receives its own."""
    devs = []
    for d in range(devices):
        sends = tuple(
            Task(f"s{s}-{r}", TaskKind.SEND, peer=r, nbytes=nbytes(s, r), tag=s * devices + r)
            for s, r in pairs
            if s == d
        )
        recvs = tuple(
            Task(f"r{s}-{r}", TaskKind.RECV, peer=s, nbytes=nbytes(s, r), tag=s * devices + r)
            for s, r in pairs
            if r == d
        )
        devs.append(DeviceProgram(d, {(0, "F"): Block(0, "F", sends + recvs)}, (Action(0, "F", 0),)))
    return Program(tuple(devs), 1, FP32)


def _fair_share_s(cost: CostModel, pairs, nbytes) -> dict[tuple[int, int], float]:
    """Seconds of each message started together as flows on the network (ports per link kind)."""
    env = simpy.Environment()
    net = Network(env)
    done: dict = {}
    node_of = cost.cluster.node_of
    for s, r in pairs:
        kind = "nvlink" if node_of(s) == node_of(r) else "nic"
        links = ((kind, "out", s), (kind, "in", r))
        net.transfer(cost.p2p_time_s(nbytes(s, r), s, r), links, lambda s=s, r=r: done.setdefault((s, r), env.now))
    env.run()
    return done


def _all_to_all(devices):
    return [(s, r) for s in range(devices) for r in range(devices) if s != r]


CASES = {
    "all-to-all in a node": (1, _all_to_all(8), lambda s, d: NBYTES),
    "all-to-all over two nodes (rails)": (2, _all_to_all(16), lambda s, d: NBYTES),
    "gather onto 4 devices": (2, [(s, r) for s in range(16) for r in range(4) if s != r], lambda s, d: NBYTES),
    "all-to-all, smaller messages to odd devices": (1, _all_to_all(8), lambda s, d: NBYTES >> (d % 2)),
}


@pytest.mark.parametrize("name", CASES)
def test_a_symmetric_burst_in_closed_form_is_the_fair_share_networks_answer(name):
    nodes, pairs, nbytes = CASES[name]
    cost = CostModel.load("dgx-a100-80g", nodes, software="planlab")
    devices = cost.cluster.num_devices
    program = _exchange(devices, pairs, nbytes)
    prices = exchange_prices(program, list(range(devices)), cost)
    fair = _fair_share_s(cost, pairs, nbytes)
    closed = {}
    for d in range(devices):
        for i, t in enumerate(program.device(d).blocks[(0, "F")].tasks):
            if t.kind is TaskKind.SEND:
                closed[(d, t.peer)] = prices[(d, (0, "F"))][i]  # every message is priced in closed form
    assert closed.keys() == fair.keys()
    worst = max(abs(closed[k] - fair[k]) / fair[k] for k in fair)
    assert worst <= 1e-9, (name, worst)
    alone = max(cost.p2p_time_s(nbytes(s, r), s, r) for s, r in pairs)
    assert max(fair.values()) > 2 * alone  # the messages did share their ports
    # the simulation takes them as priced: the last receive ends when the slowest message arrives
    assert simulate(program, cost, symmetry=False).iter_time_s == pytest.approx(max(fair.values()), rel=1e-9)


def test_messages_with_other_bottlenecks_stay_flows():
    """Device 0 sends to 1 and 2; device 2 also receives from 3 to 7: the message to 1 is not
    bottlenecked where the message to 2 is: device 0's burst, and with it device 2's receives, are
    left to the network."""
    cost = CostModel.load("dgx-a100-80g", 1, software="planlab")
    pairs = [(0, 1), (0, 2)] + [(s, 2) for s in range(3, 8)]
    program = _exchange(8, pairs)
    prices = exchange_prices(program, list(range(8)), cost)
    assert prices == {}
    # without device 0's message to 1 the gather onto device 2 is symmetric again
    assert {d for d, _ in exchange_prices(_exchange(8, pairs[1:]), list(range(8)), cost)} == {0, 3, 4, 5, 6, 7}
