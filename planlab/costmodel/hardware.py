"""Hardware as data: devices, nodes and clusters, loaded from JSON spec files.

Spec files carry their units in the field names (``memory_GB``, ``hbm_GBps``,
``peak_bf16_tflops``, ``intra_GBps``, ``inter_Gbps``, ``latency_us``); the
loader converts them once into SI units: bytes, bytes/s, flop/s, seconds.
GB are 1e9 bytes, as on vendor datasheets; MiB are 2**20 bytes, as in
nccl-tests message sizes.

A cluster spec file (``specs/<name>.json``) describes one node type; its
``device`` is the name of a device in ``specs/devices.json`` or an inline
device object with a ``name``. A user's spec file has the same format.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from planlab.errors import ConfigError, choices

SPEC_DIR = Path(__file__).parent / "specs"
DEVICES_FILE = "devices.json"
DTYPES = ("fp32", "tf32", "bf16", "fp16")

# Unit definitions (not hardware numbers): spec field unit -> SI factor.
_GB = 1e9  # bytes
_MiB = 2.0**20  # bytes
_TFLOPS = 1e12  # flop/s
_GFLOP = 1e9  # flop
_GBIT = 1e9 / 8  # bytes per Gbit
_US = 1e-6  # seconds


@dataclass(frozen=True)
class Efficiency:
    """Fraction of peak reached by an operation of ``size`` (flop or bytes).

    ``at(size) = max / (1 + (half / size) ** exponent)``: ``max`` for huge
    operations, ``max / 2`` when ``size == half``.
    """

    max: float
    half: float
    exponent: float = 1.0

    def at(self, size: float) -> float:
        """The efficiency for an operation of ``size`` (> 0) flop or bytes."""
        return self.max / (1.0 + (self.half / size) ** self.exponent)

    def __str__(self) -> str:
        return f"{self.max:g}@{self.half:.3g}^{self.exponent:g}"


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator, in SI units (bytes, bytes/s, flop/s, seconds)."""

    name: str
    memory_bytes: float
    hbm_bytes_per_s: float
    peak_flops_per_s: Mapping[str, float] = field(hash=False)  # dtype -> flop/s
    launch_overhead_s: float
    compute_efficiency: Efficiency = Efficiency(1.0, 0.0)  # size in flop
    memory_efficiency: Efficiency = Efficiency(1.0, 0.0)  # size in bytes

    def __str__(self) -> str:
        best = max(self.peak_flops_per_s.items(), key=lambda kv: kv[1])
        return f"{self.name} ({self.memory_bytes / _GB:g} GB, {best[1] / _TFLOPS:g} TFLOP/s {best[0]})"


@dataclass(frozen=True)
class NodeSpec:
    """A node: identical devices, an intra-node link and one inter-node NIC share per device."""

    name: str
    device: DeviceSpec
    devices_per_node: int
    intra_bytes_per_s: float  # per device, per direction
    intra_latency_s: float
    inter_bytes_per_s: float  # per device (its NIC share), per direction
    inter_latency_s: float
    intra_efficiency: Efficiency = Efficiency(1.0, 0.0)  # size in bytes
    inter_efficiency: Efficiency = Efficiency(1.0, 0.0)  # size in bytes

    def __str__(self) -> str:
        return f"{self.name} ({self.devices_per_node}x {self.device.name})"


@dataclass(frozen=True)
class ClusterSpec:
    """``nodes`` identical nodes; ranks are numbered node by node."""

    node: NodeSpec
    nodes: int = 1

    def __post_init__(self) -> None:
        _check_nodes(self.nodes)

    @property
    def num_devices(self) -> int:
        """Total number of devices (ranks)."""
        return self.node.devices_per_node * self.nodes

    @property
    def device(self) -> DeviceSpec:
        """The device type of every rank."""
        return self.node.device

    def node_of(self, rank: int) -> int:
        """The node index of ``rank``; ranks fill node 0 first, then node 1, ..."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.num_devices:
            raise ConfigError(f"rank {rank!r} is not in cluster {self} (ranks 0..{self.num_devices - 1})")
        return rank // self.node.devices_per_node

    def __str__(self) -> str:
        return f"{self.nodes}x {self.node.name} ({self.num_devices}x {self.device.name})"


def list_clusters() -> list[str]:
    """Names of the built-in cluster (node) specs, sorted."""
    return sorted(p.stem for p in SPEC_DIR.glob("*.json") if p.name != DEVICES_FILE)


def load_cluster(name_or_path: str | os.PathLike[str], nodes: int = 1) -> ClusterSpec:
    """Load a built-in cluster by name, or a user's JSON spec file by path, with ``nodes`` nodes.

    Raises ConfigError for an unknown name, ``nodes < 1`` or a malformed file.
    """
    _check_nodes(nodes)
    names = list_clusters()
    text = os.fspath(name_or_path) if isinstance(name_or_path, (str, os.PathLike)) else None
    if text in names:
        path = SPEC_DIR / f"{text}.json"
    elif text and (text.endswith(".json") or os.sep in text or "/" in text or Path(text).is_file()):
        path = Path(text)
    else:
        raise ConfigError(
            f"unknown cluster {name_or_path!r}; choose {choices(names)} or a path to a JSON spec file"
        )
    return ClusterSpec(node=_node_from(_Fields(_read_json(path), str(path))), nodes=nodes)


def _check_nodes(nodes: object) -> None:
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ConfigError(f"nodes must be an integer >= 1, got {nodes!r}")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"cluster spec file {str(path)!r} not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cluster spec file {str(path)!r}: cannot read JSON: {exc}") from None


class _Fields:
    """Typed access to one JSON object; errors name the file and the field path."""

    def __init__(self, obj: Any, where: str, prefix: str = "") -> None:
        if not isinstance(obj, dict):
            what = f"field {prefix.rstrip('.')!r}" if prefix else "the top level"
            raise ConfigError(f"cluster spec file {where!r}: {what} must be a JSON object, got {obj!r}")
        self.obj, self.where, self.prefix = obj, where, prefix

    def error(self, key: str, problem: str) -> ConfigError:
        return ConfigError(f"cluster spec file {self.where!r}: field {self.prefix + key!r} {problem}")

    def get(self, key: str) -> Any:
        if key not in self.obj:
            raise self.error(key, "is missing")
        return self.obj[key]

    def number(self, key: str, *, low: float = 0.0, strict: bool = True) -> float:
        """A number > low (strict) or >= low."""
        val = self.get(key)
        if isinstance(val, bool) or not isinstance(val, (int, float)):
            raise self.error(key, f"must be a number, got {val!r}")
        if val < low or (strict and val == low):
            raise self.error(key, f"must be {'>' if strict else '>='} {low:g}, got {val!r}")
        return float(val)

    def integer(self, key: str) -> int:
        """An integer >= 1."""
        val = self.get(key)
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise self.error(key, f"must be an integer >= 1, got {val!r}")
        return val

    def text(self, key: str) -> str:
        val = self.get(key)
        if not isinstance(val, str) or not val:
            raise self.error(key, f"must be a non-empty string, got {val!r}")
        return val

    def sub(self, key: str) -> _Fields:
        return _Fields(self.get(key), self.where, f"{self.prefix}{key}.")


def _efficiency(f: _Fields, key: str, half_unit: str, unit: float) -> Efficiency:
    e = f.sub(key)
    eff_max = e.number("max")
    if eff_max > 1.0:
        raise e.error("max", f"must be <= 1, got {eff_max!r}")
    return Efficiency(max=eff_max, half=e.number(half_unit, strict=False) * unit, exponent=e.number("exponent"))


def _device_from(f: _Fields, name: str) -> DeviceSpec:
    memory_bytes = f.number("memory_GB") * _GB
    hbm_bytes_per_s = f.number("hbm_GBps") * _GB
    f.number("peak_fp32_tflops")  # required; the other dtypes are optional
    peaks = {dt: f.number(f"peak_{dt}_tflops") * _TFLOPS for dt in DTYPES if f"peak_{dt}_tflops" in f.obj}
    return DeviceSpec(
        name=name,
        memory_bytes=memory_bytes,
        hbm_bytes_per_s=hbm_bytes_per_s,
        peak_flops_per_s=peaks,
        launch_overhead_s=f.number("launch_overhead_us", strict=False) * _US,
        compute_efficiency=_efficiency(f, "compute_efficiency", "half_gflop", _GFLOP),
        memory_efficiency=_efficiency(f, "memory_efficiency", "half_MiB", _MiB),
    )


def _builtin_device(f: _Fields, key: str) -> DeviceSpec:
    """The device named by field ``key`` of ``f``, from specs/devices.json."""
    name = f.text(key)
    path = SPEC_DIR / DEVICES_FILE
    table = _Fields(_read_json(path), str(path))
    names = sorted(k for k in table.obj if not k.startswith("_"))
    if name not in names:
        raise f.error(key, f"names unknown device {name!r}; choose {choices(names)} or an inline device object")
    return _device_from(table.sub(name), name)


def _node_from(f: _Fields) -> NodeSpec:
    if isinstance(f.get("device"), dict):  # an inline device object
        inline = f.sub("device")
        device = _device_from(inline, inline.text("name"))
    else:
        device = _builtin_device(f, "device")
    per_node = f.integer("devices_per_node")
    adapters = f.integer("inter_adapters")
    return NodeSpec(
        name=f.text("name"),
        device=device,
        devices_per_node=per_node,
        intra_bytes_per_s=f.number("intra_GBps") * _GB,
        intra_latency_s=f.number("intra_latency_us", strict=False) * _US,
        # each device's share of the node's NICs
        inter_bytes_per_s=f.number("inter_Gbps") * _GBIT * adapters / per_node,
        inter_latency_s=f.number("inter_latency_us", strict=False) * _US,
        intra_efficiency=_efficiency(f, "intra_efficiency", "half_MiB", _MiB),
        inter_efficiency=_efficiency(f, "inter_efficiency", "half_MiB", _MiB),
    )
