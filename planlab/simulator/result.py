"""What a simulation returns: times, memory, and the timeline as a table or a trace."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple


@dataclass(frozen=True)
class DeviceStats:
    """One device class: its representative, how many devices it stands for, and where its time went.

    ``compute_s`` is busy computing; ``comm_s`` all communication, overlapped or not;
    ``exposed_comm_s`` the part of it the device waited for (collectives in its way, and
    overlapped reductions still running when the optimizer needs them); ``bubble_s``
    waiting for pipeline messages from other stages; ``wait_s`` every wait (bubbles, and
    peers late to a collective); ``idle_s`` what is left of the iteration.
    """

    device: int
    members: int
    finish_s: float
    compute_s: float
    comm_s: float
    wait_s: float
    peak_mem_bytes: int
    peak_at_s: float
    peak_task: str
    exposed_comm_s: float = 0.0
    bubble_s: float = 0.0

    @property
    def idle_s(self) -> float:
        return max(0.0, self.finish_s - self.compute_s - self.exposed_comm_s - self.bubble_s)


class Event(NamedTuple):
    """One task or segment on a device's stream, in seconds from the iteration's start (a named
    tuple, not a dataclass: a timeline holds millions, and a tuple is made three times faster)."""

    device: int
    stream: str
    action: str
    name: str
    start_s: float
    end_s: float


@dataclass(frozen=True)
class SimResult:
    """One simulated training iteration."""

    iter_time_s: float
    devices: tuple[DeviceStats, ...]
    device_memory_bytes: float
    model_flops: float
    hardware_flops: float
    num_devices: int
    peak_flops_per_s: float
    events: tuple[Event, ...] = ()
    memory: tuple[tuple[int, float, int], ...] = ()  # (device, time s, bytes)
    host_peak_bytes: float = 0.0  # the fullest node's host memory taken by offloaded state
    host_memory_bytes: float = float("inf")  # a node's host memory (inf: nothing is offloaded)

    @property
    def peak_mem_bytes(self) -> int:
        return max(d.peak_mem_bytes for d in self.devices)

    @property
    def feasible(self) -> bool:
        return self.peak_mem_bytes <= self.device_memory_bytes and self.host_peak_bytes <= self.host_memory_bytes

    @property
    def reason(self) -> str:
        if self.feasible:
            return ""
        if self.host_peak_bytes > self.host_memory_bytes:
            return (
                f"out of host memory: a node's offloaded state takes {self.host_peak_bytes / 1e9:.1f} GB "
                f"(host memory {self.host_memory_bytes / 1e9:g} GB per node)"
            )
        d = max(self.devices, key=lambda s: s.peak_mem_bytes)
        return (
            f"out of memory: device {d.device} peaks at {d.peak_mem_bytes / 2**30:.1f} GiB "
            f"(device memory {self.device_memory_bytes / 2**30:.1f} GiB) at {d.peak_at_s * 1e3:.1f} ms "
            f"in task {d.peak_task}"
        )

    @property
    def tflops_per_gpu(self) -> float:
        return self.model_flops / self.iter_time_s / self.num_devices / 1e12 if self.iter_time_s else 0.0

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: model FLOPs per second over the devices' peak."""
        return self.tflops_per_gpu * 1e12 / self.peak_flops_per_s if self.peak_flops_per_s else 0.0

    @property
    def hfu(self) -> float:
        """Hardware FLOPs utilisation: every FLOP executed, replicas included."""
        if not self.iter_time_s or not self.peak_flops_per_s:
            return 0.0
        return self.hardware_flops / self.iter_time_s / self.num_devices / self.peak_flops_per_s

    def summary(self) -> str:
        return (
            f"iteration {self.iter_time_s * 1e3:.2f} ms, peak memory {self.peak_mem_bytes / 2**30:.2f} GiB, "
            f"{self.tflops_per_gpu:.1f} TFLOP/s per device, MFU {self.mfu:.1%}"
            + ("" if self.feasible else f" -- {self.reason}")
        )

    def to_dataframe(self):
        """The timeline, one row per event (needs ``simulate(..., timeline=True)``)."""
        import pandas as pd

        return pd.DataFrame(list(self.events), columns=["device", "stream", "action", "name", "start_s", "end_s"])

    def device_table(self):
        import pandas as pd

        rows = [dict(d.__dict__, idle_s=d.idle_s) for d in self.devices]
        return pd.DataFrame(rows)

    def write_trace(self, path: str | os.PathLike) -> None:
        """A Chrome/Perfetto trace: a process per device class, a thread per stream."""
        write_chrome_trace(
            path,
            self.events,
            counters=self.memory,
        )


TRACE_THREADS = {"compute": 0, "comm": 1, "wait": 2}  # stream -> thread id in a Chrome trace (3: any other)


def write_chrome_trace(path: str | os.PathLike, events, counters=()) -> None:
    """Write ``(device, stream, action, name, start_s, end_s)`` events as Chrome trace JSON."""
    tids = TRACE_THREADS
    out = []
    for dev in sorted({e[0] for e in events}):
        out.append({"ph": "M", "name": "process_name", "pid": dev, "args": {"name": f"device {dev}"}})
        for s, tid in tids.items():
            out.append({"ph": "M", "name": "thread_name", "pid": dev, "tid": tid, "args": {"name": s}})
    for dev, stream, action, name, a, b in events:
        out.append(
            {
                "ph": "X",
                "pid": dev,
                "tid": tids.get(stream, 3),
                "name": name,
                "cat": action,
                "ts": a * 1e6,
                "dur": max(0.0, (b - a) * 1e6),
                "args": {"action": action},
            }
        )
    for dev, t, nbytes in counters:
        out.append({"ph": "C", "pid": dev, "name": "memory", "ts": t * 1e6, "args": {"GiB": nbytes / 2**30}})
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"traceEvents": out, "displayTimeUnit": "ms"}))
    os.replace(tmp, path)
