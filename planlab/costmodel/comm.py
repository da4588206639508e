"""Collective and point-to-point times: an alpha-beta model with ring algorithms.

``nbytes`` is always the FULL buffer, as in nccl-tests' "size" column:
all_reduce the buffer, all_gather the gathered output, reduce_scatter the input
before scattering, all_to_all one rank's whole buffer, broadcast the buffer.

For a group of n ranks, ``time = steps * latency + traffic * nbytes / bandwidth``:

| kind           | traffic per rank | latency steps |
|----------------|------------------|---------------|
| all_reduce     | 2(n-1)/n         | 2(n-1)        |
| all_gather     | (n-1)/n          | n-1           |
| reduce_scatter | (n-1)/n          | n-1           |
| all_to_all     | (n-1)/n          | n-1           |
| broadcast      | 1 (pipelined)    | n-1           |

Placement decides the link. Within one node: the intra-node link per device,
``bandwidth = intra * eff_intra(nbytes)``, intra latency per step. Spanning
nodes, with g members on the node that has fewest: g rings run in parallel,
one per member's NIC, and each ring also crosses intra-node links, so
``bandwidth = min(intra * eff_intra(nbytes), g * inter * eff_inter(nbytes))``
and every ring step pays the inter-node latency. all_to_all spanning nodes is
bounded by the slower of the traffic to node peers (intra link) and to other
nodes (the rank's own NIC). ``eff(size) = max / (1 + (half / size) ** exponent)``
makes small messages reach lower bandwidth; its parameters live in the spec
files, fitted against nccl-tests all-reduce bus bandwidths.
"""

from __future__ import annotations

from collections import Counter
from enum import Enum

from planlab.costmodel.hardware import ClusterSpec, NodeSpec
from planlab.errors import ConfigError, choices


class Collective(str, Enum):
    """Collective kinds; the value is the name ``collective_time_s`` accepts."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"

    def __str__(self) -> str:
        return self.value


# kind -> (latency steps, traffic per rank in units of nbytes), as functions of n
_RING = {
    Collective.ALL_REDUCE: (lambda n: 2 * (n - 1), lambda n: 2 * (n - 1) / n),
    Collective.ALL_GATHER: (lambda n: n - 1, lambda n: (n - 1) / n),
    Collective.REDUCE_SCATTER: (lambda n: n - 1, lambda n: (n - 1) / n),
    Collective.BROADCAST: (lambda n: n - 1, lambda n: 1.0),
}


def _placement(cluster: ClusterSpec, group: tuple[int, ...]) -> tuple[int, int, int]:
    """(nodes spanned, fewest members on a node, most members on a node); validates ranks."""
    if len(group) == 0:
        raise ConfigError("a collective needs a non-empty group of ranks")
    if len(set(group)) != len(group):
        raise ConfigError(f"group {group!r} repeats a rank")
    per_node = Counter(cluster.node_of(r) for r in group)
    return len(per_node), min(per_node.values()), max(per_node.values())


def _check_nbytes(nbytes: float) -> None:
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or nbytes < 0:
        raise ConfigError(f"nbytes must be a number >= 0, got {nbytes!r}")


def _intra_bw(node: NodeSpec, nbytes: float) -> float:
    """Achieved intra-node bandwidth per device for a message of nbytes, bytes/s."""
    return node.intra_bytes_per_s * node.intra_efficiency.at(nbytes)


def _inter_bw(node: NodeSpec, nbytes: float) -> float:
    """Achieved inter-node bandwidth of one device's NIC share for a message of nbytes, bytes/s."""
    return node.inter_bytes_per_s * node.inter_efficiency.at(nbytes)


def collective_time_s(cluster: ClusterSpec, kind: str, nbytes: float, group: tuple[int, ...]) -> float:
    """Seconds for the collective ``kind`` on ``nbytes`` (the full buffer) among the ranks ``group``.

    kind: "all_reduce", "all_gather", "reduce_scatter", "all_to_all" or "broadcast".
    A group of one rank, or zero bytes, costs 0.0. Raises ConfigError for an
    unknown kind, a rank outside the cluster or a repeated rank.
    """
    try:
        kind_ = Collective(kind)
    except ValueError:
        raise ConfigError(f"unknown collective {kind!r}; choose {choices([k.value for k in Collective])}") from None
    _check_nbytes(nbytes)
    group = tuple(group)
    nodes, g_min, g_max = _placement(cluster, group)
    n = len(group)
    if n == 1 or nbytes == 0:
        return 0.0
    node = cluster.node
    alpha = node.intra_latency_s if nodes == 1 else node.inter_latency_s  # s per ring step
    if kind_ is Collective.ALL_TO_ALL:
        t_peers = (g_max - 1) / n * nbytes / _intra_bw(node, nbytes)  # to ranks on the same node
        t_remote = (n - g_min) / n * nbytes / _inter_bw(node, nbytes) if nodes > 1 else 0.0  # over own NIC
        return (n - 1) * alpha + max(t_peers, t_remote)
    steps, traffic = _RING[kind_]
    bw = _intra_bw(node, nbytes)  # bytes/s
    if nodes > 1:
        bw = min(bw, g_min * _inter_bw(node, nbytes))  # g_min rings in parallel, one NIC each
    return steps(n) * alpha + traffic(n) * nbytes / bw


def p2p_time_s(cluster: ClusterSpec, nbytes: float, src: int, dst: int) -> float:
    """Seconds to send ``nbytes`` from rank ``src`` to rank ``dst``: the intra-node link if they
    share a node, else the inter-node link (the sender's NIC). ``src == dst`` or zero bytes cost 0.0.
    """
    _check_nbytes(nbytes)
    same_node = cluster.node_of(src) == cluster.node_of(dst)
    if src == dst or nbytes == 0:
        return 0.0
    node = cluster.node
    if same_node:
        return node.intra_latency_s + nbytes / _intra_bw(node, nbytes)
    return node.inter_latency_s + nbytes / _inter_bw(node, nbytes)
