"""Hardware specs as data and the times they imply: compute (roofline, or kernel by kernel with
GEMMs by tile and wave quantization when a spec names its software), collectives (alpha-beta),
the host's issue time, optionally calibrated to a machine by a profile (``planlab calibrate``)."""

from __future__ import annotations

from planlab.costmodel.comm import Algorithm, Collective, algorithms, collective_time_s, p2p_time_s
from planlab.costmodel.compute import canonical_dtype, compute_time_s
from planlab.costmodel.gemm import GemmSpec, gemm_time_s
from planlab.costmodel.hardware import (
    ClusterSpec,
    DeviceSpec,
    Efficiency,
    Network,
    NodeSpec,
    list_clusters,
    list_devices,
    load_cluster,
    load_device,
)
from planlab.costmodel.kernels import Kernel, OpKernels, op_kernels
from planlab.costmodel.model import CostModel, host_bound_elapsed_s
from planlab.costmodel.profile import Profile, load_profile
from planlab.costmodel.software import SoftwareSpec

__all__ = [
    "Algorithm",
    "Collective",
    "ClusterSpec",
    "CostModel",
    "DeviceSpec",
    "Efficiency",
    "GemmSpec",
    "Kernel",
    "Network",
    "NodeSpec",
    "OpKernels",
    "Profile",
    "SoftwareSpec",
    "algorithms",
    "canonical_dtype",
    "collective_time_s",
    "compute_time_s",
    "gemm_time_s",
    "host_bound_elapsed_s",
    "list_clusters",
    "list_devices",
    "load_cluster",
    "load_device",
    "load_profile",
    "op_kernels",
    "p2p_time_s",
]
