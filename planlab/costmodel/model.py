"""The cost model the simulator and the searches query: one cluster, three prices."""

from __future__ import annotations

import os
from dataclasses import dataclass

from planlab.costmodel import comm, compute
from planlab.costmodel.hardware import ClusterSpec, load_cluster


@dataclass(frozen=True)
class CostModel:
    """Prices compute, collectives and point-to-point transfers on ``cluster`` (seconds)."""

    cluster: ClusterSpec

    @classmethod
    def load(cls, name_or_path: str | os.PathLike[str], nodes: int = 1) -> CostModel:
        """The cost model of a built-in cluster name or a spec file path (see ``load_cluster``)."""
        return cls(load_cluster(name_or_path, nodes))

    @property
    def device_memory_bytes(self) -> float:
        """Memory of one device, in bytes."""
        return self.cluster.device.memory_bytes

    def compute_time_s(self, *, flops: float, bytes_moved: float, dtype: str) -> float:
        """Seconds for one kernel on one device (see ``compute.compute_time_s``)."""
        return compute.compute_time_s(self.cluster.device, flops=flops, bytes_moved=bytes_moved, dtype=dtype)

    def collective_time_s(self, kind: str, nbytes: float, group: tuple[int, ...]) -> float:
        """Seconds for a collective on the full buffer of ``nbytes`` (see ``comm.collective_time_s``)."""
        return comm.collective_time_s(self.cluster, kind, nbytes, group)

    def p2p_time_s(self, nbytes: float, src: int, dst: int) -> float:
        """Seconds to send ``nbytes`` from ``src`` to ``dst`` (see ``comm.p2p_time_s``)."""
        return comm.p2p_time_s(self.cluster, nbytes, src, dst)

    def __str__(self) -> str:
        return f"CostModel({self.cluster})"
