"""Device classes: devices whose programs are the same up to the names of their peers.

Refined like a bisimulation: devices start grouped by their stripped task
lists, then split until every task's peers fall in the same classes. The
simulator runs one representative per class.
"""

from __future__ import annotations

from planlab.costmodel import ClusterSpec
from planlab.plan.program import DeviceProgram, Program


def _stripped(dp: DeviceProgram, cluster: ClusterSpec) -> tuple:
    out = [tuple(map(str, dp.schedule)), dp.static_bytes]
    for key in sorted(dp.blocks):
        for t in dp.blocks[key].tasks:
            nodes = len({cluster.node_of(d) for d in t.group}) if t.group else 0
            out.append(
                (
                    key,
                    t.kind.value,
                    t.op,
                    t.collective,
                    len(t.group),
                    nodes,
                    t.nbytes,
                    t.flops,
                    t.bytes_moved,
                    tuple(n for _, n in t.alloc),
                    len(t.free),
                    cluster.node_of(t.peer) == cluster.node_of(dp.device) if t.peer >= 0 else None,
                )
            )
    return tuple(out)


def device_classes(program: Program, cluster: ClusterSpec, slowdown: dict[int, float] | None = None) -> list[int]:
    """``cls[d]``: the class id of device ``d`` (ids are the lowest device of each class).
    Devices with different ``slowdown`` factors never share a class."""
    slowdown = slowdown or {}
    keys = [(slowdown.get(dp.device, 1.0), _stripped(dp, cluster)) for dp in program.devices]
    cls = _canon(keys)
    while True:
        refined = []
        for dp in program.devices:
            peers = []
            for key in sorted(dp.blocks):
                for t in dp.blocks[key].tasks:
                    if t.peer >= 0:  # a message inside a class (DualPipe's mirrored ranks): tags need not
                        # match between the members, so such devices each run as their own class
                        peers.append(cls[t.peer] if cls[t.peer] != cls[dp.device] else ("own", dp.device))
                    elif t.group:
                        peers.append(tuple(sorted(cls[d] for d in t.group)))
            refined.append((cls[dp.device], tuple(peers)))
        new = _canon(refined)
        if len(set(new)) == len(set(cls)):
            return new
        cls = new


def _canon(keys: list) -> list[int]:
    first: dict = {}
    out = []
    for d, k in enumerate(keys):
        out.append(first.setdefault(k, d))
    return out
