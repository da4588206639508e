"""Hardware specs as data and the times they imply: compute (roofline), collectives (alpha-beta),
optionally calibrated to a machine by a profile (``planlab calibrate``)."""

from __future__ import annotations

from planlab.costmodel.comm import Algorithm, Collective, algorithms, collective_time_s, p2p_time_s
from planlab.costmodel.compute import canonical_dtype, compute_time_s
from planlab.costmodel.hardware import (ClusterSpec, DeviceSpec, Efficiency, Network, NodeSpec, list_clusters,
                                        list_devices, load_cluster, load_device)
from planlab.costmodel.model import CostModel
from planlab.costmodel.profile import Profile, load_profile

__all__ = [
    "Algorithm",
    "Collective",
    "ClusterSpec",
    "CostModel",
    "DeviceSpec",
    "Efficiency",
    "Network",
    "NodeSpec",
    "Profile",
    "algorithms",
    "canonical_dtype",
    "collective_time_s",
    "compute_time_s",
    "list_clusters",
    "list_devices",
    "load_cluster",
    "load_device",
    "load_profile",
    "p2p_time_s",
]
