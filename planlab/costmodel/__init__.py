"""Hardware specs as data and the times they imply: compute (roofline), collectives (alpha-beta)."""

from __future__ import annotations

from planlab.costmodel.comm import Collective, collective_time_s, p2p_time_s
from planlab.costmodel.compute import canonical_dtype, compute_time_s
from planlab.costmodel.hardware import ClusterSpec, DeviceSpec, Efficiency, NodeSpec, list_clusters, load_cluster
from planlab.costmodel.model import CostModel

__all__ = [
    "Collective",
    "ClusterSpec",
    "CostModel",
    "DeviceSpec",
    "Efficiency",
    "NodeSpec",
    "canonical_dtype",
    "collective_time_s",
    "compute_time_s",
    "list_clusters",
    "load_cluster",
    "p2p_time_s",
]
