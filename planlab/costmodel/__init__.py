"""Hardware specs and training software as data, and the times they imply: compute (kernel by
kernel, GEMMs by tile and wave quantization, where the device gives its SMs; else the roofline),
collectives (alpha-beta, NCCL's algorithms), the host's issue time, memory as the software leaves
it, optionally calibrated to a machine by a profile (``planlab calibrate``)."""

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
from planlab.costmodel.precision import Precision
from planlab.costmodel.software import SoftwareSpec, list_software, load_software

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
    "Precision",
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
    "list_software",
    "load_cluster",
    "load_device",
    "load_profile",
    "load_software",
    "op_kernels",
    "p2p_time_s",
]
