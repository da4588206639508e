"""NCCL's protocols and the latencies its tuning model gives them, for collectives spanning nodes.

NCCL runs every collective in one of three protocols, and its tuner (``ncclTopoTuneModel`` in
``src/graph/tuning.cc``) prices each algorithm and protocol as ``latency + nbytes / bandwidth`` and
runs the fastest (``ncclTopoGetAlgoTime``, ``src/graph/tuning.cc`` / ``src/enqueue.cc``):

- LL (low latency): 8-byte stores carrying a flag, no synchronisation; half of every line is flags,
  so it reaches a quarter of the links' bus bandwidth;
- LL128: 128-byte lines with 8 bytes of flag, 120/128 = 0.92 of it, some more latency;
- Simple: whole chunks with a fence and a flag per chunk, the full bandwidth, the most latency.

Latency = a base per call and protocol + one hop latency per step, an NVLink hop for the steps
inside a node and a network hop for the steps between nodes. A ring over ``n`` ranks on ``N``
nodes takes ``2(n-1)`` steps of which ``2(N-1)`` cross the network (all_reduce; ``n-1`` and ``N-1``
for all_gather and reduce_scatter); a double binary tree ``2 ((n/N - 1)`` NVLink hops ``+
log2(N)`` network hops``)``. On more than one node an LL NVLink hop costs 1.8x its single-node value.
A multi-node Simple ring all_reduce of at least ``n/16 x 64 KiB`` costs 1.9x its latency ("plateau
effect of ring").

Every number below is NCCL v2.8.3's (git tag ``v2.8.3-1``, ``src/graph/tuning.cc``: ``baseLat``,
``hwLat``, the bus bandwidth refinements in ``ncclTopoTuneModel``; ``ncclTopoGetAlgoTime``),
the NCCL of 2021 that DeepSpeed's ZeRO-3 and Megatron-LM ran in the SC'21 paper. The ring's Simple
and LL128 hop latencies are the same through v2.21 (NVLink 3.4 / 1.9 us, network 9.6 / 4.0 us);
v2.18 raised the LL and LL128 base latencies (6.6 and 14 us) and the LL NVLink hop (0.6 us), and
counts ``2N`` network steps for a ring all_reduce. NCCL's per-channel bandwidth caps of LL and LL128
(``llMaxBws``, ``ll128MaxBwPerCh``) are not modelled: planlab has no channel count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planlab.enums import StrEnum

_US = 1e-6


class Protocol(StrEnum):
    """NCCL's protocols (``NCCL_PROTO``)."""

    LL = "LL"
    LL128 = "LL128"
    SIMPLE = "Simple"


@dataclass(frozen=True)
class ProtocolCost:
    """What one protocol costs an algorithm in NCCL's tuning model: ``base_s`` per call, an NVLink
    hop (``nvlink_hop_s``, on more than one node) and a network hop (``net_hop_s``) per step, and
    the ``bandwidth`` it reaches as a fraction of the links' bus bandwidth."""

    base_s: float
    nvlink_hop_s: float
    net_hop_s: float
    bandwidth: float

    def __str__(self) -> str:
        return f"{self.base_s / _US:g}+{self.nvlink_hop_s / _US:g}/{self.net_hop_s / _US:g}us@{self.bandwidth:.3g}"


# LL's NVLink hop on more than one node: "if (nNodes > 1 && p == NCCL_PROTO_LL) intraLat *= 1.8"
_LL_MULTINODE = 1.8

# baseLat[Ring] = {3.6, 10.0, 8.4}; hwLat[NVLINK][Ring] = {.47, 1.9, 3.4}; hwLat[NET][Ring] = {2.7, 4.0, 9.6};
# ring LL: busBw x 1/4 (nNodes > 1); ring LL128: busBw x 0.92 (120/128, ppn >= 2)
RING = {
    Protocol.LL: ProtocolCost(3.6 * _US, 0.47 * _LL_MULTINODE * _US, 2.7 * _US, 1.0 / 4.0),
    Protocol.LL128: ProtocolCost(10.0 * _US, 1.9 * _US, 4.0 * _US, 0.92),
    Protocol.SIMPLE: ProtocolCost(8.4 * _US, 3.4 * _US, 9.6 * _US, 1.0),
}

# baseLat[Tree] = {4.4, 4.4, 0}; hwLat[NVLINK][Tree] = {.52, 1.25, 28}; hwLat[NET][Tree] = {5.0, 8.5, 28}
# ("Tree/Simple is the latency a 256kB chunk"); tree LL: busBw x 1/3.8; tree LL128: busBw x 0.915
# (nNodes > 1); Simple: the tree's own derating (comm.TREE_BANDWIDTH) only
TREE = {
    Protocol.LL: ProtocolCost(4.4 * _US, 0.52 * _LL_MULTINODE * _US, 5.0 * _US, 1.0 / 3.8),
    Protocol.LL128: ProtocolCost(4.4 * _US, 1.25 * _US, 8.5 * _US, 0.915),
    Protocol.SIMPLE: ProtocolCost(0.0, 28.0 * _US, 28.0 * _US, 1.0),
}

# "lat *= 1.9; // Plateau effect of ring": a Simple ring all_reduce over nodes of at least
# nRanks / 16 x 65536 bytes (ncclTopoGetAlgoTime, v2.8.3; v2.18 takes 1.4 on compute capability 8.0+)
RING_PLATEAU = 1.9
RING_PLATEAU_BYTES_PER_RANK = 65536 / 16


def ring_latency_s(cost: ProtocolCost, steps: int, net_steps: int) -> float:
    """A ring's latency in NCCL's model: its base and ``steps`` hops, ``net_steps`` of them between nodes."""
    return cost.base_s + (steps - net_steps) * cost.nvlink_hop_s + net_steps * cost.net_hop_s


def tree_latency_s(cost: ProtocolCost, per_node: int, nodes: int) -> float:
    """A double binary tree's latency in NCCL's model (up and down): ``per_node - 1`` NVLink hops of
    the chain in each node and ``log2(nodes)`` network hops (``log2i``, rounded down)."""
    return cost.base_s + 2 * ((per_node - 1) * cost.nvlink_hop_s + int(math.log2(nodes)) * cost.net_hop_s)
