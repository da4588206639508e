"""Hardware as data: devices, nodes and clusters, loaded from JSON spec files.

Spec files carry their units in the field names (``memory_GB``, ``hbm_GBps``,
``peak_bf16_tflops``, ``intra_GBps``, ``inter_Gbps``, ``latency_us``); the
loader converts them once into SI units: bytes, bytes/s, flop/s, seconds.
GB are 1e9 bytes, as on vendor datasheets; MiB are 2**20 bytes, as in
nccl-tests message sizes.

A cluster spec file (``specs/<name>.json``) describes one node type and the
network between nodes; its ``device`` is the name of a device in
``specs/devices.json`` or an inline device object with a ``name``. A user's
spec file has the same format. ``nodes`` (how many) is given at load time.
Every number is checked against a plausible range for its unit, so that a
value written in the wrong unit (``memory_GB: 80000``) is refused with the
file, the field and the expected form.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from planlab.costmodel.fields import Fields, read_json
from planlab.costmodel.gemm import GemmSpec
from planlab.errors import ConfigError, choices

SPEC_DIR = Path(__file__).parent / "specs"
DEVICES_FILE = "devices.json"
DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
TOPOLOGIES = ("fat_tree", "rail_optimized")
COLLECTIVE_LIBRARIES = ("nccl",)

# Unit definitions (not hardware numbers): spec field unit -> SI factor.
_GB = 1e9  # bytes
_MiB = 2.0**20  # bytes
_TFLOPS = 1e12  # flop/s
_GFLOP = 1e9  # flop
_GBIT = 1e9 / 8  # bytes per Gbit
_US = 1e-6  # seconds

_DEVICE_FIELDS = {
    "name",
    "description",
    "source",
    "memory_GB",
    "memory_MiB",
    "default_precision",
    "hbm_GBps",
    "launch_overhead_us",
    "host_overhead_us",
    "compute_efficiency",
    "memory_efficiency",
    *(f"peak_{dt}_tflops" for dt in DTYPES),
    "sm_count",
    "gemm_efficiency",
    "gemm_efficiency_fp8",
    "l2_GBps",
    "gemm_tiles",
    "gemm_tile_overhead_k",
    "gemm_tile_overhead_k_fp8",
    "gemm_efficiency_fp8_block",
    "gemm_tile_overhead_k_fp8_block",
    "gemm_stream_k",
    "gemm_power_ceiling",
    "attention_efficiency",
    "architecture",
}
ARCHITECTURES = ("volta", "ampere", "hopper", "cdna3", "cpu")  # a device's generation, as software picks kernels by it
# fused attention kernels: FlashAttention-2 and -3, cuDNN's fused attention
ATTENTION_KERNELS = ("flash2", "flash3", "cudnn")
# the batched GEMMs of an unfused attention core (Megatron's baddbmm and bmm writing and reading the T x S scores):
# a device may list their measured efficiency beside the fused kernels'; no software runs it as a fused kernel
UNFUSED_ATTENTION = "unfused"
_NODE_FIELDS = {
    "name",
    "description",
    "source",
    "device",
    "devices_per_node",
    "intra_link",
    "intra_GBps",
    "intra_latency_us",
    "intra_efficiency",
    "intra_efficiency_by_ranks",
    "inter_link",
    "inter_Gbps",
    "inter_adapters",
    "inter_latency_us",
    "inter_efficiency",
    "network",
    "inter_scale_efficiency",
    "intra_nvls_GBps",
    "collective_sms",
    "collective_library",
    "host",
}
_HOST_FIELDS = {
    "link",
    "link_GBps",
    "link_efficiency",
    "devices_per_link",
    "memory_GB",
    "cpu_cores",
    "cpu_adam_Gparams_per_s_per_core",
    "source",
}
_NETWORK_FIELDS = {"topology", "nodes_per_switch", "oversubscription", "source"}


@dataclass(frozen=True)
class Efficiency:
    """Fraction of peak reached by an operation of ``size`` (flop or bytes).

    ``at(size) = max / (1 + (half / size) ** exponent)``: ``max`` for huge
    operations, ``max / 2`` when ``size == half``.
    """

    max: float
    half: float
    exponent: float = 1.0
    ranks: int = 0  # a collective's curve: fitted on groups of this many ranks (0: the size is the whole buffer)

    def at(self, size: float) -> float:
        """The efficiency for an operation of ``size`` (> 0) flop or bytes."""
        return self.max / (1.0 + (self.half / size) ** self.exponent)

    def at_chunk(self, nbytes: float, n: int) -> float:
        """The efficiency of a ring collective of ``nbytes`` over ``n`` ranks: the curve at the
        buffer whose per-rank chunk, over the ``ranks`` it was fitted on, is the same (a ring
        moves ``nbytes / n`` per rank and step, so 1 GiB over 128 ranks steps like 128 MiB over 16)."""
        return self.at(nbytes * self.ranks / n if self.ranks and n > 0 else nbytes)

    def __str__(self) -> str:
        return f"{self.max:g}@{self.half:.3g}^{self.exponent:g}"


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator, in SI units (bytes, bytes/s, flop/s, seconds)."""

    name: str
    memory_bytes: float  # the capacity the driver reports (memory_MiB), or the datasheet's memory_GB
    hbm_bytes_per_s: float
    peak_flops_per_s: Mapping[str, float] = field(hash=False)  # dtype -> flop/s
    launch_overhead_s: float  # added to every kernel (device-side launch latency)
    compute_efficiency: Efficiency = Efficiency(1.0, 0.0)  # size in flop
    memory_efficiency: Efficiency = Efficiency(1.0, 0.0)  # size in bytes
    host_overhead_s: float = 0.0  # the host's time to issue one operator: a floor on its time
    gemm: GemmSpec | None = None  # SMs, GEMM efficiency and tiles: GEMMs by tile and wave quantization
    default_precision: str = "bf16"  # the precision training software uses on it unless told otherwise
    architecture: str = ""  # its generation (ARCHITECTURES; "": not stated), which software picks kernels by

    def __str__(self) -> str:
        best = max(self.peak_flops_per_s.items(), key=lambda kv: kv[1] if kv[0] != "fp8" else 0.0)
        return f"{self.name} ({self.memory_bytes / _GB:g} GB, {best[1] / _TFLOPS:g} TFLOP/s {best[0]})"


@dataclass(frozen=True)
class HostSpec:
    """A node's host side, in SI units: the link from each device to host memory (``link``, e.g.
    ``PCIe 4.0 x16``), its effective bandwidth per direction and how many devices share one such
    link (a PCIe switch's uplink), the node's host memory, and how fast the host's CPU steps Adam
    for one device's process (its share of the node's cores)."""

    link: str
    link_bytes_per_s: float  # effective, per direction, per link
    devices_per_link: int
    memory_bytes: float  # the whole node's host memory
    adam_params_per_s: float  # per device: the cores of its share of the node's CPU

    def __str__(self) -> str:
        return f"{self.link} {self.link_bytes_per_s / _GB:.3g} GB/s, {self.memory_bytes / _GB:g} GB host memory"


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
    intra_link: str = ""
    inter_link: str = ""
    inter_scale: tuple[tuple[int, float], ...] = ()  # (nodes, efficiency of large inter-node collectives)
    nvls_bytes_per_s: float = 0.0  # bus bandwidth of NVLink SHARP all-reduces in the node (0: no NVLS)
    host: HostSpec | None = None  # the host link, memory and CPU (None: the spec gives none; offloading is refused)
    collective_sms: int = 0  # SMs a running NCCL collective takes from computation (0: not stated, none)
    collective_library: str = ""  # "nccl": collectives over nodes priced by NCCL's protocols (costmodel.nccl)
    # (ranks, curve): a ring of that many ranks inside one node reaches this curve, not intra_efficiency
    intra_by_ranks: tuple[tuple[int, Efficiency], ...] = ()

    def __str__(self) -> str:
        return f"{self.name} ({self.devices_per_node}x {self.device.name})"

    def intra_curve(self, ranks: int) -> Efficiency:
        """The efficiency curve of a ring of ``ranks`` ranks inside one node: the spec's
        ``intra_efficiency_by_ranks`` entry for that many ranks, else ``intra_efficiency``."""
        return next((curve for n, curve in self.intra_by_ranks if n == ranks), self.intra_efficiency)


@dataclass(frozen=True)
class Network:
    """How nodes connect: a fat tree of switches with ``nodes_per_switch`` nodes under each leaf
    switch; traffic between leaves shares the uplinks, ``oversubscription`` (>= 1) times fewer
    than the nodes' adapters (1: non-blocking, full bisection bandwidth). ``rail_optimized``:
    each node's NIC i sits under rail switch i (as NVIDIA's DGX SuperPOD is cabled), so traffic
    between devices of the same local rank stays on its rail and never shares the uplinks."""

    topology: str = "fat_tree"
    nodes_per_switch: int = 1 << 30  # one leaf holds every node unless the spec says otherwise
    oversubscription: float = 1.0

    @property
    def rail_optimized(self) -> bool:
        """Whether NIC i of every node is on rail switch i."""
        return self.topology == "rail_optimized"

    def switches_spanned(self, nodes: set[int] | frozenset[int]) -> int:
        """How many leaf switches the given node indices sit under (nodes fill switch 0 first)."""
        return len({n // self.nodes_per_switch for n in nodes})

    def __str__(self) -> str:
        if self.oversubscription == 1.0:
            return f"{self.topology} (non-blocking)"
        return f"{self.topology} ({self.nodes_per_switch} nodes per leaf, {self.oversubscription:g}:1)"


@dataclass(frozen=True)
class ClusterSpec:
    """``nodes`` identical nodes on ``network``; ranks are numbered node by node."""

    node: NodeSpec
    nodes: int = 1
    network: Network = Network()

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

    def describe(self) -> str:
        """One line: devices, links and network."""
        n = self.node
        intra = (
            f"{n.intra_link or 'intra-node link'} {n.intra_bytes_per_s / _GB:g} GB/s"
            if n.devices_per_node > 1
            else "one device per node"
        )
        inter = f"{n.inter_link or 'inter-node link'} {n.inter_bytes_per_s / _GB:g} GB/s per device"
        return f"{n.devices_per_node}x {self.device}; {intra}; {inter}; {self.network}"

    def __str__(self) -> str:
        return f"{self.nodes}x {self.node.name} ({self.num_devices}x {self.device.name})"


def list_clusters() -> list[str]:
    """Names of the built-in cluster (node) specs, sorted."""
    return sorted(p.stem for p in SPEC_DIR.glob("*.json") if p.name != DEVICES_FILE)


def list_devices() -> list[str]:
    """Names of the built-in devices (``specs/devices.json``), sorted."""
    path = SPEC_DIR / DEVICES_FILE
    return sorted(k for k in read_json(path) if not k.startswith("_"))


def load_device(name: str) -> DeviceSpec:
    """A built-in device by name (see ``list_devices``)."""
    path = SPEC_DIR / DEVICES_FILE
    table = Fields(read_json(path), str(path))
    if name not in list_devices():
        raise ConfigError(f"unknown device {name!r}; choose {choices(list_devices())}")
    return _device_from(table.sub(name), name)


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
        raise ConfigError(f"unknown cluster {name_or_path!r}; choose {choices(names)} or a path to a JSON spec file")
    f = Fields(read_json(path), str(path))
    network = _network_from(f.sub("network")) if "network" in f.obj else Network()
    return ClusterSpec(node=_node_from(f), nodes=nodes, network=network)


def _check_nodes(nodes: object) -> None:
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ConfigError(f"nodes must be an integer >= 1, got {nodes!r}")


def _efficiency(f: Fields, key: str, half_unit: str, unit: float) -> Efficiency:
    e = f.sub(key)
    e.only({"max", half_unit, "exponent", "fit_ranks"})
    return Efficiency(
        max=e.number("max", high=1.0, unit="fraction of peak"),
        half=e.number(half_unit, strict=False, unit=f"size reaching half of max, in {half_unit[5:]}") * unit,
        exponent=e.number("exponent", high=10.0),
        ranks=e.integer("fit_ranks") if "fit_ranks" in e.obj else 0,
    )


def _device_from(f: Fields, name: str) -> DeviceSpec:
    f.only(_DEVICE_FIELDS)
    memory_bytes = f.unit("memory_GB", "GB") * _GB  # the datasheet's; the driver's capacity where given
    if "memory_MiB" in f.obj:
        memory_bytes = f.number("memory_MiB", high=1e8, unit="MiB of device memory as the driver reports it") * _MiB
    hbm_bytes_per_s = f.unit("hbm_GBps", "GBps") * _GB
    f.unit("peak_fp32_tflops", "tflops")  # required; the other dtypes are optional
    peaks = {dt: f.unit(f"peak_{dt}_tflops", "tflops") * _TFLOPS for dt in DTYPES if f"peak_{dt}_tflops" in f.obj}
    return DeviceSpec(
        name=name,
        memory_bytes=memory_bytes,
        hbm_bytes_per_s=hbm_bytes_per_s,
        peak_flops_per_s=peaks,
        launch_overhead_s=f.unit("launch_overhead_us", "us", strict=False) * _US,
        compute_efficiency=_efficiency(f, "compute_efficiency", "half_gflop", _GFLOP),
        memory_efficiency=_efficiency(f, "memory_efficiency", "half_MiB", _MiB),
        host_overhead_s=f.unit("host_overhead_us", "us", strict=False) * _US if "host_overhead_us" in f.obj else 0.0,
        gemm=_gemm_from(f) if "sm_count" in f.obj else None,
        default_precision=_default_precision(f, peaks),
        architecture=_architecture(f),
    )


def _architecture(f: Fields) -> str:
    """The device's ``architecture`` (one of :data:`ARCHITECTURES`; "" if not given)."""
    return _optional_choice(f, "architecture", ARCHITECTURES)


def _optional_choice(f: Fields, key: str, allowed: tuple[str, ...]) -> str:
    """Field ``key``, one of ``allowed``; "" when not given."""
    if key not in f.obj:
        return ""
    val = f.get(key)
    if val not in allowed:
        raise f.error(key, f"is {val!r}; choose {choices(allowed)}")
    return val


def _attention_efficiency(f: Fields) -> tuple[tuple[str, float, float, int], ...]:
    """The device's ``attention_efficiency``: an object of fused attention kernel (one of
    :data:`ATTENTION_KERNELS`, or :data:`UNFUSED_ATTENTION` for the batched GEMMs of an unfused core) ->
    ``{"forward": x, "backward": y, "overhead_k": k0}``: the fractions of the dense peak its forward and its
    backward kernel reach, and its work per score element (a GEMM's per tile) as ``k0`` more steps of k
    (optional, 0); () if not given."""
    if "attention_efficiency" not in f.obj:
        return ()
    sub = f.sub("attention_efficiency")
    out = []
    for kernel in sub.obj:
        if kernel not in (*ATTENTION_KERNELS, UNFUSED_ATTENTION):
            raise f.error(
                "attention_efficiency",
                f"names kernel {kernel!r}; choose {choices((*ATTENTION_KERNELS, UNFUSED_ATTENTION))}",
            )
        passes = sub.sub(kernel)
        passes.only({"forward", "backward", "overhead_k"})
        unit = "fraction of the dense peak the fused attention kernel reaches"
        forward, backward = (passes.number(key, high=1.0, unit=unit) for key in ("forward", "backward"))
        out.append((kernel, forward, backward, passes.integer("overhead_k") if "overhead_k" in passes.obj else 0))
    return tuple(out)


def _default_precision(f: Fields, peaks: Mapping[str, float]) -> str:
    """The device's ``default_precision`` (one of its dtypes with a peak); bf16 if not given."""
    if "default_precision" not in f.obj:
        return "bf16" if "bf16" in peaks else "fp32"
    val = f.get("default_precision")
    if val not in peaks or val == "tf32":
        raise f.error(
            "default_precision",
            f"is {val!r}; choose one the device has a peak for: {choices(sorted(set(peaks) - {'tf32'}))}",
        )
    return val


def _gemm_from(f: Fields) -> GemmSpec:
    """The tile model's numbers of a device (``sm_count``, ``gemm_efficiency``, ``l2_GBps``,
    optional ``gemm_tiles``, ``gemm_tile_overhead_k`` (and ``gemm_tile_overhead_k_fp8``), ``gemm_stream_k``,
    ``gemm_power_ceiling`` and ``attention_efficiency``); the rest are required
    once ``sm_count`` is given."""
    sms = f.integer("sm_count")
    eff = f.number("gemm_efficiency", high=1.0, unit="fraction of the dense peak reached by large GEMMs")
    l2 = f.unit("l2_GBps", "GBps") * _GB
    eff8 = (
        f.number("gemm_efficiency_fp8", high=1.0, unit="fraction of the dense FP8 peak reached by large FP8 GEMMs")
        if "gemm_efficiency_fp8" in f.obj
        else 0.0
    )
    over_k = f.integer("gemm_tile_overhead_k") if "gemm_tile_overhead_k" in f.obj else 0
    over_k8 = f.integer("gemm_tile_overhead_k_fp8") if "gemm_tile_overhead_k_fp8" in f.obj else None
    block = dict(
        efficiency_fp8_block=(
            f.number("gemm_efficiency_fp8_block", high=1.0, unit="fraction of the dense FP8 peak of block-scaled GEMMs")
            if "gemm_efficiency_fp8_block" in f.obj
            else 0.0
        ),
        tile_overhead_k_fp8_block=(
            f.integer("gemm_tile_overhead_k_fp8_block") if "gemm_tile_overhead_k_fp8_block" in f.obj else None
        ),
    )
    flash = _attention_efficiency(f)
    ceiling = (
        f.number("gemm_power_ceiling", high=1.0, unit="fraction of the dense peak the power limit lets GEMMs sustain")
        if "gemm_power_ceiling" in f.obj
        else 0.0
    )
    stream_k = f.obj.get("gemm_stream_k", False)
    if not isinstance(stream_k, bool):
        raise f.error("gemm_stream_k", f"must be true or false, got {stream_k!r}")
    if "gemm_tiles" not in f.obj:
        return GemmSpec(
            sms,
            eff,
            l2,
            efficiency_fp8=eff8,
            tile_overhead_k=over_k,
            tile_overhead_k_fp8=over_k8,
            stream_k=stream_k,
            attention_efficiency=flash,
            power_ceiling=ceiling,
            **block,
        )
    tiles = f.get("gemm_tiles")
    form = "a list of [rows, columns] pairs of positive integers, e.g. [[256, 128], [128, 128]]"
    if (
        not isinstance(tiles, list)
        or not tiles
        or not all(
            isinstance(t, list)
            and len(t) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in t)
            for t in tiles
        )
    ):
        raise f.error("gemm_tiles", f"must be {form}, got {tiles!r}")
    return GemmSpec(
        sms,
        eff,
        l2,
        tuple((t[0], t[1]) for t in tiles),
        efficiency_fp8=eff8,
        tile_overhead_k=over_k,
        tile_overhead_k_fp8=over_k8,
        stream_k=stream_k,
        attention_efficiency=flash,
        power_ceiling=ceiling,
        **block,
    )


def _builtin_device(f: Fields, key: str) -> DeviceSpec:
    """The device named by field ``key`` of ``f``, from specs/devices.json."""
    name = f.text(key)
    path = SPEC_DIR / DEVICES_FILE
    table = Fields(read_json(path), str(path))
    names = sorted(k for k in table.obj if not k.startswith("_"))
    if name not in names:
        raise f.error(key, f"names unknown device {name!r}; choose {choices(names)} or an inline device object")
    return _device_from(table.sub(name), name)


def _node_from(f: Fields) -> NodeSpec:
    f.only(_NODE_FIELDS)
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
        intra_bytes_per_s=f.unit("intra_GBps", "GBps") * _GB,
        intra_latency_s=f.unit("intra_latency_us", "us", strict=False) * _US,
        # each device's share of the node's NICs
        inter_bytes_per_s=f.unit("inter_Gbps", "Gbps") * _GBIT * adapters / per_node,
        inter_latency_s=f.unit("inter_latency_us", "us", strict=False) * _US,
        intra_efficiency=_efficiency(f, "intra_efficiency", "half_MiB", _MiB),
        intra_by_ranks=_intra_by_ranks(f, per_node) if "intra_efficiency_by_ranks" in f.obj else (),
        inter_efficiency=_efficiency(f, "inter_efficiency", "half_MiB", _MiB),
        intra_link=f.text("intra_link") if "intra_link" in f.obj else "",
        inter_link=f.text("inter_link") if "inter_link" in f.obj else "",
        inter_scale=_inter_scale(f) if "inter_scale_efficiency" in f.obj else (),
        nvls_bytes_per_s=f.unit("intra_nvls_GBps", "GBps") * _GB if "intra_nvls_GBps" in f.obj else 0.0,
        host=_host_from(f.sub("host"), per_node) if "host" in f.obj else None,
        collective_sms=_collective_sms(f, device),
        collective_library=_collective_library(f),
    )


def _collective_sms(f: Fields, device: DeviceSpec) -> int:
    """``collective_sms``: the SMs of each device a running collective occupies (NCCL runs one
    thread block per channel, on an SM of its own); fewer than the device has. 0 when not given."""
    if "collective_sms" not in f.obj:
        return 0
    sms = f.integer("collective_sms")
    if device.gemm is None or sms >= device.gemm.sm_count:
        have = "no sm_count" if device.gemm is None else f"{device.gemm.sm_count} SMs"
        raise f.error(
            "collective_sms", f"is {sms}; expected fewer than the device's SMs (device {device.name}: {have})"
        )
    return sms


def _collective_library(f: Fields) -> str:
    """``collective_library``: ``"nccl"`` prices collectives spanning nodes by NCCL's protocols and
    their latencies (:mod:`planlab.costmodel.nccl`); "" (not given) by the spec's latencies alone."""
    return _optional_choice(f, "collective_library", COLLECTIVE_LIBRARIES)


def _host_from(f: Fields, per_node: int) -> HostSpec:
    """A node's ``host`` object: ``link``, ``link_GBps`` and ``link_efficiency`` (per direction),
    ``devices_per_link``, ``memory_GB``, ``cpu_cores`` and ``cpu_adam_Gparams_per_s_per_core``."""
    f.only(_HOST_FIELDS)
    share = f.integer("devices_per_link")
    if share > per_node:
        raise f.error("devices_per_link", f"is {share}; expected at most devices_per_node ({per_node})")
    efficiency = f.number("link_efficiency", high=1.0, unit="fraction of the link's bandwidth")
    cores = f.integer("cpu_cores")
    per_core = f.number("cpu_adam_Gparams_per_s_per_core", high=100.0, unit="Gparams/s stepped by Adam on one core")
    return HostSpec(
        link=f.text("link"),
        link_bytes_per_s=f.unit("link_GBps", "GBps") * _GB * efficiency,
        devices_per_link=share,
        memory_bytes=f.unit("memory_GB", "GB") * _GB,
        adam_params_per_s=per_core * 1e9 * cores / per_node,
    )


def _intra_by_ranks(f: Fields, per_node: int) -> tuple[tuple[int, Efficiency], ...]:
    """``{"2": {"max": 0.65, "half_MiB": 8, "exponent": 0.9}, ...}``: the efficiency curve of a ring
    of that many ranks inside one node (2 to ``devices_per_node``), where it differs from
    ``intra_efficiency`` (measured all-reduce bus bandwidth by the number of ranks)."""
    e = f.sub("intra_efficiency_by_ranks")
    out = []
    for key in e.obj:
        if str(key).startswith("_"):
            continue
        if not str(key).isdigit() or not 2 <= int(key) <= per_node:
            raise e.error(
                key, f'must be a number of ranks from 2 to devices_per_node ({per_node}), as a string, e.g. "2"'
            )
        out.append((int(key), _efficiency(e, key, "half_MiB", _MiB)))
    if not out:
        raise f.error(
            "intra_efficiency_by_ranks",
            'must map numbers of ranks to curves, e.g. {"2": {"max": 0.65, "half_MiB": 8, "exponent": 0.9}}',
        )
    return tuple(sorted(out))


def _inter_scale(f: Fields) -> tuple[tuple[int, float], ...]:
    """``{"2": 0.92, "16": 0.76}``: measured ratios of a large all-reduce's bus bandwidth to the
    peak, by the number of nodes it spans (see ``comm.scale_efficiency``)."""
    e = f.sub("inter_scale_efficiency")
    out = []
    for key in e.obj:
        if str(key).startswith("_"):
            continue
        if not str(key).isdigit() or int(key) < 1:
            raise e.error(key, 'must be a node count (a positive integer as a string, e.g. "16")')
        out.append((int(key), e.number(key, high=1.0, unit="fraction of peak bandwidth")))
    if not out:
        raise f.error("inter_scale_efficiency", 'must map node counts to fractions, e.g. {"2": 0.92, "16": 0.76}')
    return tuple(sorted(out))


def _network_from(f: Fields) -> Network:
    f.only(_NETWORK_FIELDS)
    topology = f.text("topology")
    if topology not in TOPOLOGIES:
        raise f.error("topology", f"is {topology!r}; choose {choices(TOPOLOGIES)}")
    per_switch = f.integer("nodes_per_switch") if "nodes_per_switch" in f.obj else Network.nodes_per_switch
    over = (
        f.number(
            "oversubscription",
            low=1.0,
            strict=False,
            high=64.0,
            unit="ratio of downlink to uplink bandwidth, 1 = non-blocking",
        )
        if "oversubscription" in f.obj
        else 1.0
    )
    return Network(topology, per_switch, over)
