"""Collective and point-to-point times: alpha-beta models of ring, tree and hierarchical algorithms.

``nbytes`` is always the FULL buffer, as in nccl-tests' "size" column:
all_reduce the buffer, all_gather the gathered output, reduce_scatter the input
before scattering, all_to_all one rank's whole buffer, broadcast the buffer.

For a group of n ranks, ``time = steps * latency + traffic * nbytes / bandwidth``.

Ring (every kind but all_to_all):

| kind           | traffic per rank | latency steps |
|----------------|------------------|---------------|
| all_reduce     | 2(n-1)/n         | 2(n-1)        |
| all_gather     | (n-1)/n          | n-1           |
| reduce_scatter | (n-1)/n          | n-1           |
| broadcast      | 1 (pipelined)    | n-1           |

Tree (all_reduce, as NCCL's double binary tree): a reduce up and a broadcast down,
pipelined: traffic 2, latency steps 2 x depth, where depth is ``ceil(log2 nodes)``
inter-node hops plus a chain through the node's members; its bandwidth 0.9 of the links'
(NCCL's own tuning model). It beats the ring for
small messages on many ranks (fewer steps) and loses for large ones (twice the traffic).

Hierarchical (all_reduce, all_gather, reduce_scatter spanning nodes): within each
node a reduce-scatter over the intra-node link, across nodes the node-local
shards in parallel, one per member's NIC, then an all-gather within each node.

NVLS (all_reduce within a node whose spec gives ``intra_nvls_GBps``: NVLink SHARP on H100 and
H200 NVSwitches, which reduce and multicast in the switch): two latency steps and the buffer at
that bus bandwidth, its size curve the intra-node link's.

Placement decides the link. Within one node: the intra-node link per device,
``bandwidth = intra * eff_intra(nbytes)``, intra latency per step. Spanning
nodes, with g members on the node that has fewest: g rings run in parallel,
one per member's NIC, and each ring also crosses intra-node links, so
``bandwidth = min(intra * eff_intra(nbytes), g * inter * eff_inter(nbytes))``
and every ring step pays the inter-node latency; on a cluster whose ``collective_library`` is
``"nccl"`` a ring or tree spanning nodes is priced as NCCL's tuner prices it instead (the fastest
of its protocols, each with a base latency, an NVLink hop per step inside a node and a network hop
per step between nodes, at its share of the bandwidth: :mod:`planlab.costmodel.nccl`), and only
NCCL's algorithms are chosen (no hierarchical all_gather or reduce_scatter). When the nodes sit under more
than one leaf switch of an oversubscribed fat tree, the inter-node bandwidth is
divided by the oversubscription. all_to_all spanning nodes is bounded by the
slower of the traffic to node peers (intra link) and to other nodes (the rank's
own NIC); on a rail-optimized network NCCL's PXN keeps it on the rails, relaying
messages for other rails over NVLink (:func:`all_to_all_traffic`). ``eff(size) = max / (1 + (half / size) ** exponent)`` makes small
messages reach lower bandwidth; its parameters live in the spec files, fitted
against nccl-tests all-reduce bus bandwidths (of two nodes; over more nodes the spec's
``inter_scale_efficiency`` lowers it, :func:`scale_efficiency`). A ring moves ``nbytes / n``
per rank and step, so a ring over n ranks is priced at the buffer with the same per-rank chunk
on the group size the curve was fitted on (its ``fit_ranks``): 1 GiB over 128 ranks like 128 MiB
over 16, which is what the 16-node nccl-tests anchors show. Without an explicit algorithm the
fastest applicable one is priced, as NCCL's tuner picks per size.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from planlab.enums import StrEnum
from planlab.costmodel import nccl
from planlab.costmodel.hardware import ClusterSpec, NodeSpec
from planlab.errors import ConfigError, choices


class Collective(StrEnum):
    """Collective kinds; the value is the name ``collective_time_s`` accepts."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"


class Algorithm(StrEnum):
    """Collective algorithms; the value is the name ``collective_time_s`` accepts."""

    RING = "ring"
    TREE = "tree"
    HIERARCHICAL = "hierarchical"
    DIRECT = "direct"  # all_to_all: every pair at once
    NVLS = "nvls"  # NVLink SHARP: the NVSwitch reduces and multicasts (H100, H200)


# kind -> (latency steps, traffic per rank in units of nbytes), as functions of n
_RING = {
    Collective.ALL_REDUCE: (lambda n: 2 * (n - 1), lambda n: 2 * (n - 1) / n),
    Collective.ALL_GATHER: (lambda n: n - 1, lambda n: (n - 1) / n),
    Collective.REDUCE_SCATTER: (lambda n: n - 1, lambda n: (n - 1) / n),
    Collective.BROADCAST: (lambda n: n - 1, lambda n: 1.0),
}

_APPLICABLE = {
    Collective.ALL_REDUCE: (Algorithm.RING, Algorithm.TREE, Algorithm.HIERARCHICAL, Algorithm.NVLS),
    Collective.ALL_GATHER: (Algorithm.RING, Algorithm.HIERARCHICAL),
    Collective.REDUCE_SCATTER: (Algorithm.RING, Algorithm.HIERARCHICAL),
    Collective.BROADCAST: (Algorithm.RING,),
    Collective.ALL_TO_ALL: (Algorithm.DIRECT,),
}


@dataclass(frozen=True)
class Placement:
    """Where a group's members sit: ``n`` ranks on ``nodes`` nodes, ``g_min``/``g_max`` members on
    the emptiest/fullest node, spanning ``switches`` leaf switches; ``rails``: every node holds
    members of the same local ranks (on a rail-optimized network its traffic stays on the rails)."""

    n: int
    nodes: int
    g_min: int
    g_max: int
    switches: int = 1
    rails: bool = False


def placement(cluster: ClusterSpec, group: tuple[int, ...]) -> Placement:
    """The placement of ``group`` on ``cluster``; validates the ranks."""
    if len(group) == 0:
        raise ConfigError("a collective needs a non-empty group of ranks")
    if len(set(group)) != len(group):
        raise ConfigError(f"group {group!r} repeats a rank")
    per_node = Counter(cluster.node_of(r) for r in group)
    k = cluster.node.devices_per_node
    local: dict[int, set[int]] = {}
    for r in group:
        local.setdefault(r // k, set()).add(r % k)
    switches = cluster.network.switches_spanned(set(per_node))
    rails = cluster.network.rail_optimized and len({frozenset(v) for v in local.values()}) == 1
    return Placement(len(group), len(per_node), min(per_node.values()), max(per_node.values()), switches, rails)


def _check_nbytes(nbytes: float) -> None:
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or nbytes < 0:
        raise ConfigError(f"nbytes must be a number >= 0, got {nbytes!r}")


def _intra_bw(node: NodeSpec, nbytes: float, ranks: int = 0, *, one_node: bool = False) -> float:
    """Achieved intra-node bandwidth per device for a message of nbytes, bytes/s; for a ring over
    ``ranks`` ranks at its per-rank chunk (``Efficiency.at_chunk``). A ring of ``ranks`` inside
    ``one_node`` runs at that many ranks' curve (``NodeSpec.intra_curve``: NCCL's rings over
    NVSwitch reach less bus bandwidth with fewer ranks)."""
    curve = node.intra_curve(ranks) if one_node else node.intra_efficiency
    return node.intra_bytes_per_s * curve.at_chunk(nbytes, ranks)


def _inter_bw(
    cluster: ClusterSpec, nbytes: float, switches: int = 1, nodes: int = 2, rails: bool = False, ranks: int = 0
) -> float:
    """Achieved inter-node bandwidth of one device's NIC share for a message of nbytes, bytes/s;
    shared uplinks divide it when the nodes sit under several leaf switches (unless the traffic
    stays on the rails of a rail-optimized network), and a collective over more than two nodes
    reaches less (:func:`scale_efficiency`); for a ring over ``ranks`` ranks at its per-rank chunk."""
    node = cluster.node
    over = cluster.network.oversubscription if switches > 1 and not rails else 1.0
    eff = node.inter_efficiency.at_chunk(nbytes, ranks)
    return node.inter_bytes_per_s * eff / over * scale_efficiency(node, nodes)


def scale_efficiency(node: NodeSpec, nodes: int) -> float:
    """The fraction of the two-node inter-node bandwidth a collective over ``nodes`` nodes
    reaches: the spec's ``inter_scale_efficiency`` (measured ratios of a large all-reduce's
    bandwidth to the peak by node count), interpolated in log2 of the node count, relative to
    two nodes (where ``inter_efficiency`` was fitted); 1 without it or for two nodes or fewer."""
    pts = node.inter_scale
    if nodes <= 2 or not pts:
        return 1.0

    def at(n: int) -> float:
        if n <= pts[0][0]:
            return pts[0][1]
        for (n0, e0), (n1, e1) in zip(pts, pts[1:]):
            if n <= n1:
                return e0 + (e1 - e0) * (math.log2(n) - math.log2(n0)) / (math.log2(n1) - math.log2(n0))
        return pts[-1][1]

    return min(1.0, at(nodes) / at(2))


def _ring(cluster: ClusterSpec, kind: Collective, nbytes: float, p: Placement) -> float:
    node = cluster.node
    steps, traffic = _RING[kind]
    bw = _intra_bw(node, nbytes, p.n, one_node=p.nodes == 1)  # bytes/s, at the ring's per-rank chunk
    if p.nodes > 1:  # g_min rings, one NIC each
        bw = min(bw, p.g_min * _inter_bw(cluster, nbytes, p.switches, p.nodes, p.rails, p.n))
    if p.nodes > 1 and node.collective_library == "nccl":
        return _nccl_ring(kind, nbytes, p, bw)
    alpha = node.intra_latency_s if p.nodes == 1 else node.inter_latency_s  # s per ring step
    return steps(p.n) * alpha + traffic(p.n) * nbytes / bw


def _nccl_ring(kind: Collective, nbytes: float, p: Placement, bw: float) -> float:
    """A ring over nodes as NCCL's tuner prices it: the fastest protocol, each with its latency
    (a base, an NVLink hop per step inside a node, a network hop per step between nodes) and its
    share of the links' achieved bandwidth ``bw`` (:mod:`planlab.costmodel.nccl`)."""
    steps, traffic = _RING[kind]
    net_steps = (2 if kind is Collective.ALL_REDUCE else 1) * (p.nodes - 1)  # nInterSteps
    plateau = kind is Collective.ALL_REDUCE and nbytes >= p.n * nccl.RING_PLATEAU_BYTES_PER_RANK
    best = math.inf
    for proto, cost in nccl.RING.items():
        lat = nccl.ring_latency_s(cost, steps(p.n), net_steps)
        if plateau and proto is nccl.Protocol.SIMPLE:
            lat *= nccl.RING_PLATEAU
        best = min(best, lat + traffic(p.n) * nbytes / (cost.bandwidth * bw))
    return best


# NCCL's tuning model derates a tree's bus bandwidth to 0.9 of what its channels carry in a ring
# (src/graph/tuning.cc, ncclTopoTuneModel: "if (a == NCCL_ALGO_TREE) busBw = std::min(busBw*.9, ...)").
TREE_BANDWIDTH = 0.9


def _tree(cluster: ClusterSpec, nbytes: float, p: Placement) -> float:
    """all_reduce as a pipelined reduce up and broadcast down a tree of nodes, chains within them,
    at :data:`TREE_BANDWIDTH` of the links' achieved bandwidth."""
    node = cluster.node
    bw = _intra_bw(node, nbytes)
    if p.nodes > 1:
        bw = min(bw, p.g_min * _inter_bw(cluster, nbytes, p.switches, p.nodes, p.rails))
    if p.nodes > 1 and node.collective_library == "nccl":  # NCCL's protocols, the fastest
        return min(
            nccl.tree_latency_s(cost, p.g_max, p.nodes) + 2.0 * nbytes / (TREE_BANDWIDTH * cost.bandwidth * bw)
            for cost in nccl.TREE.values()
        )
    if p.nodes == 1:
        depth_s = math.ceil(math.log2(p.n)) * node.intra_latency_s
    else:
        depth_s = math.ceil(math.log2(p.nodes)) * node.inter_latency_s + (p.g_max - 1) * node.intra_latency_s
    return 2.0 * depth_s + 2.0 * nbytes / (TREE_BANDWIDTH * bw)


def _hierarchical(cluster: ClusterSpec, kind: Collective, nbytes: float, p: Placement) -> float:
    """Within nodes over the intra link, across nodes on each member's shard over its own NIC."""
    node = cluster.node
    g, k = p.g_max, p.nodes
    shard = nbytes / p.g_min  # bytes each NIC carries across nodes
    local = Placement(g, 1, g, g)
    if kind is Collective.ALL_REDUCE:
        inner = (
            _ring(cluster, Collective.REDUCE_SCATTER, nbytes, local)
            + _ring(cluster, Collective.ALL_GATHER, nbytes, local)
            if g > 1
            else 0.0
        )
        outer = 2 * (k - 1) * node.inter_latency_s + 2 * (k - 1) / k * shard / _inter_bw(
            cluster, shard, p.switches, k, p.rails, k
        )
    else:  # all_gather or reduce_scatter: one intra-node and one inter-node phase
        inner = _ring(cluster, kind, nbytes, local) if g > 1 else 0.0
        outer = (k - 1) * node.inter_latency_s + (k - 1) / k * shard / _inter_bw(
            cluster, shard, p.switches, k, p.rails, k
        )
    return inner + outer


def _all_to_all(cluster: ClusterSpec, nbytes: float, p: Placement, node_share: float = 1.0) -> float:
    """Every rank sends ``nbytes / n`` to each other member, all pairs at once (NCCL's all_to_all
    is grouped point-to-point): the slower of the NVLink traffic and the NIC traffic of the rank
    with the most bytes to move (see :func:`all_to_all_traffic`), plus a latency per peer.
    ``node_share`` of the NIC traffic crosses the network (an expert dispatch that sends a token
    once to each node, :mod:`planlab.plan.expert_dispatch`); NVLink's, which forwards the token to
    its experts on the node, is taken as it is."""
    node = cluster.node
    alpha = node.intra_latency_s if p.nodes == 1 else node.inter_latency_s
    nvlink, nic = all_to_all_traffic(p, cluster.network.rail_optimized)
    t_intra = nvlink * nbytes / _intra_bw(node, nbytes, p.n)
    t_inter = 0.0
    if nic > 0:
        # on rails (or under one leaf) the NIC's share is not divided by the oversubscription; the
        # ring's node-count derate (inter_scale) is not applied: a direct exchange has no ring to
        # stretch, and DeepEP's all-to-all keeps 43-51 GB/s per 50 GB/s NIC at 16 to 64 ranks
        # (deepseek-ai/DeepEP README, normal kernels on H800 with ConnectX-7 400 Gb/s)
        rails = cluster.network.rail_optimized
        over = cluster.network.oversubscription if p.switches > 1 and not rails else 1.0
        bw = node.inter_bytes_per_s * node.inter_efficiency.at_chunk(nbytes, p.n) / over
        t_inter = nic * node_share * nbytes / bw
    return (p.n - 1) * alpha + max(t_intra, t_inter)


def all_to_all_traffic(p: Placement, rail_optimized: bool) -> tuple[float, float]:
    """The share of one rank's all-to-all buffer that crosses its NVLink and its NIC: ``(nvlink,
    nic)``, for the rank with the most to move (on the node holding the fewest members).

    Peers on the node take ``(g_max - 1) / n`` of the buffer over NVLink; members on other nodes
    ``(n - g_min) / n`` over the network. On a rail-optimized network (NIC i of every node on rail
    switch i, as DGX SuperPOD is cabled) NCCL's PXN (since NCCL 2.12; NVIDIA, "Doubling all2all
    Performance with NVIDIA Collective Communication Library 2.12", 2022) moves a message for
    another rail first over NVLink to the node's GPU on the destination's rail, which sends it on
    that rail: nothing crosses the spine, every NIC carries its GPU's share, and the messages for
    other rails (all but ``1 / g`` of the remote ones when the group holds ``g`` local ranks on
    each node; all of them when its nodes hold different local ranks) cross NVLink once more."""
    n, g = p.n, p.g_max
    peers, remote = (g - 1) / n, (n - p.g_min) / n
    if p.nodes == 1 or not rail_optimized:
        return peers, remote if p.nodes > 1 else 0.0
    relayed = remote * ((g - 1) / g if p.rails else 1.0)
    return peers + relayed, remote


def _nvls(cluster: ClusterSpec, nbytes: float, p: Placement) -> float:
    """all_reduce by NVLink SHARP inside a node: the switch reduces the members' buffers and
    multicasts the sum (two latency steps; the bus bandwidth the spec gives, reached for large
    buffers along the intra-node link's size curve); ``inf`` where it does not apply."""
    node = cluster.node
    if p.nodes > 1 or node.nvls_bytes_per_s <= 0:
        return math.inf
    shape = node.intra_efficiency.at(nbytes) / node.intra_efficiency.max
    return 2 * node.intra_latency_s + 2 * (p.n - 1) / p.n * nbytes / (node.nvls_bytes_per_s * shape)


def algorithms(kind: str) -> tuple[str, ...]:
    """The algorithms that can run collective ``kind``."""
    return tuple(a.value for a in _APPLICABLE[_kind(kind)])


def _kind(kind: str) -> Collective:
    try:
        return Collective(kind)
    except ValueError:
        raise ConfigError(f"unknown collective {kind!r}; choose {choices([k.value for k in Collective])}") from None


def collective_time_s(
    cluster: ClusterSpec,
    kind: str,
    nbytes: float,
    group: tuple[int, ...],
    algorithm: str | None = None,
    node_share: float = 1.0,
) -> float:
    """Seconds for the collective ``kind`` on ``nbytes`` (the full buffer) among the ranks ``group``.

    kind: "all_reduce", "all_gather", "reduce_scatter", "all_to_all" or "broadcast".
    ``algorithm`` ("ring", "tree", "hierarchical", "direct"; see ``algorithms(kind)``) prices
    one algorithm; None prices the fastest. A hierarchical collective within one node is a ring.
    ``node_share`` (an all-to-all's) is the share of its bytes for other nodes that crosses the network.
    A group of one rank, or zero bytes, costs 0.0. Raises ConfigError for an unknown kind or
    algorithm, a rank outside the cluster or a repeated rank.
    """
    kind_ = _kind(kind)
    if algorithm is not None:
        try:
            algo = Algorithm(algorithm)
        except ValueError:
            algo = None
        if algo not in _APPLICABLE[kind_]:
            raise ConfigError(f"unknown algorithm {algorithm!r} for {kind_}; choose {choices(algorithms(kind))}")
    _check_nbytes(nbytes)
    p = placement(cluster, tuple(group))
    if p.n == 1 or nbytes == 0:
        return 0.0
    todo = (algo,) if algorithm is not None else _APPLICABLE[kind_]
    if algorithm is None and cluster.node.collective_library == "nccl":
        # NCCL's tuner chooses among its own algorithms: rings and trees, no hierarchy of rings
        # ("if (coll != ncclFuncAllReduce && a != NCCL_ALGO_RING) continue;", ncclTopoTuneModel, v2.8.3)
        todo = tuple(a for a in todo if a is not Algorithm.HIERARCHICAL)
    best = math.inf
    for a in todo:
        if a is Algorithm.DIRECT:
            t = _all_to_all(cluster, nbytes, p, node_share)
        elif a is Algorithm.NVLS:
            t = _nvls(cluster, nbytes, p)
            if t == math.inf and algorithm is not None:
                raise ConfigError(
                    f"algorithm 'nvls' needs a group inside one node of a cluster whose spec gives intra_nvls_GBps "
                    f"(NVLink SHARP: H100, H200); group {tuple(group)!r} on {cluster.node.name!r}"
                )
        elif a is Algorithm.TREE:
            t = _tree(cluster, nbytes, p)
        elif a is Algorithm.HIERARCHICAL and p.nodes > 1:
            t = _hierarchical(cluster, kind_, nbytes, p)
        else:
            t = _ring(cluster, kind_, nbytes, p)
        best = min(best, t)
    return best


def p2p_time_s(cluster: ClusterSpec, nbytes: float, src: int, dst: int) -> float:
    """Seconds to send ``nbytes`` from rank ``src`` to rank ``dst``: the intra-node link if they
    share a node, else the inter-node link (the sender's NIC). ``src == dst`` or zero bytes cost 0.0.
    """
    _check_nbytes(nbytes)
    a, b = cluster.node_of(src), cluster.node_of(dst)
    if src == dst or nbytes == 0:
        return 0.0
    node = cluster.node
    if a == b:
        return node.intra_latency_s + nbytes / _intra_bw(node, nbytes)
    rails = (
        cluster.network.rail_optimized and src % cluster.node.devices_per_node == dst % cluster.node.devices_per_node
    )
    return node.inter_latency_s + nbytes / _inter_bw(
        cluster, nbytes, cluster.network.switches_spanned({a, b}), 2, rails
    )
