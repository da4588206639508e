"""Compute time of one kernel: a roofline with size-dependent efficiency.

``kernel = max(flops / (peak[dtype] * eff_c(flops)), bytes / (hbm * eff_m(bytes))) + launch``
``time = max(kernel, host)``

where ``eff_c`` and ``eff_m`` are the device's efficiency curves (from its spec
file): small kernels reach a lower fraction of peak than large ones. ``launch`` is
the device-side launch latency every kernel pays; ``host`` (0 unless the spec sets
``host_overhead_us``) is the host's time to issue one operator (framework dispatch
and kernel launches): while the device runs kernels shorter than that, the host
cannot keep it busy, so an operator never takes less.
"""

from __future__ import annotations

from planlab.costmodel.hardware import DTYPES, DeviceSpec
from planlab.errors import ConfigError, choices

# Other spellings of the dtype names (torch's, numpy's) -> the spec's names.
_ALIASES = {
    "float32": "fp32",
    "float": "fp32",
    "tf32": "tf32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
}


def canonical_dtype(dtype: object) -> str:
    """The spec name ("fp32", "tf32", "bf16", "fp16") of ``dtype``; accepts torch spellings.

    ``"bfloat16"``, ``"torch.bfloat16"`` and ``torch.bfloat16`` all give ``"bf16"``.
    Raises ConfigError for anything else.
    """
    text = str(dtype).removeprefix("torch.")
    if text in DTYPES:
        return text
    if text in _ALIASES:
        return _ALIASES[text]
    raise ConfigError(f"unknown dtype {dtype!r}; choose {choices(DTYPES)}")


def peak_flops_per_s(device: DeviceSpec, dtype: object) -> float:
    """The device's dense peak for ``dtype`` in flop/s; ConfigError if the spec has none."""
    name = canonical_dtype(dtype)
    if name not in device.peak_flops_per_s:
        raise ConfigError(
            f"device {device.name!r} has no peak for dtype {dtype!r}; choose {choices(device.peak_flops_per_s)}"
        )
    return device.peak_flops_per_s[name]


def compute_time_s(device: DeviceSpec, *, flops: float, bytes_moved: float, dtype: str) -> float:
    """Seconds one kernel takes on ``device``: ``flops`` of arithmetic in ``dtype`` and
    ``bytes_moved`` bytes of device-memory traffic (reads + writes).

    Zero flops and zero bytes cost 0.0 (no kernel). Raises ConfigError for an
    unknown dtype or negative work.
    """
    peak = peak_flops_per_s(device, dtype)  # flop/s
    if flops < 0 or bytes_moved < 0:
        raise ConfigError(f"work must be >= 0, got flops={flops!r}, bytes_moved={bytes_moved!r}")
    if flops == 0 and bytes_moved == 0:
        return 0.0
    t_math = flops / (peak * device.compute_efficiency.at(flops)) if flops > 0 else 0.0  # s
    t_mem = (
        bytes_moved / (device.hbm_bytes_per_s * device.memory_efficiency.at(bytes_moved)) if bytes_moved > 0 else 0.0
    )  # s
    return max(max(t_math, t_mem) + device.launch_overhead_s, device.host_overhead_s)
