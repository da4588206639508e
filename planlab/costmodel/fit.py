"""Fitting cost-model parameters to measurements (pure functions, no processes, no clocks).

``calibrate`` measures; these functions turn the measurements into the parameters the
cost model uses, and tests feed them synthetic measurements made from known parameters:

* :func:`fit_alpha_beta` - a collective or a transfer: ``time = alpha + nbytes / bandwidth``;
* :func:`fit_roofline` - kernels: ``time = max(flops / (peak * eff_c(flops)),
  bytes / (bw * eff_m(bytes))) + launch`` with ``eff(size) = 1 / (1 + (half / size) ** exponent)``;
* :func:`fit_linear` - non-negative least squares of a time on a few features (the optimizer step:
  a fixed cost, a cost per tensor and a cost per byte);
* :func:`robust_overhead` - the fixed cost per task from residuals (a median, which ignores the
  occasional task slowed by another process on a shared machine).

Every fit minimises relative (logarithmic) error: microbenchmark times span five decades, and an
absolute fit would ignore the small ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from planlab.costmodel.hardware import Efficiency
from planlab.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True)
class AlphaBeta:
    """``time_s = alpha_s + nbytes / bytes_per_s``."""

    alpha_s: float
    bytes_per_s: float

    def time_s(self, nbytes: float) -> float:
        """Seconds for ``nbytes``."""
        return self.alpha_s + nbytes / self.bytes_per_s

    def __str__(self) -> str:
        return f"{self.alpha_s * 1e6:.1f} us + bytes / {self.bytes_per_s / 1e9:.3g} GB/s"


@dataclass(frozen=True)
class Roofline:
    """Fitted kernel-time parameters of one device and dtype (SI units)."""

    peak_flops_per_s: float
    compute_efficiency: Efficiency  # size in flop; max is 1 (the peak is the achieved one)
    bytes_per_s: float
    memory_efficiency: Efficiency  # size in bytes
    launch_s: float

    def time_s(self, flops: float, nbytes: float) -> float:
        """Seconds for one kernel of ``flops`` and ``nbytes`` of memory traffic."""
        return roofline_time_s(
            flops,
            nbytes,
            self.peak_flops_per_s,
            self.compute_efficiency,
            self.bytes_per_s,
            self.memory_efficiency,
            self.launch_s,
        )

    def __str__(self) -> str:
        return (
            f"{self.peak_flops_per_s / 1e9:.3g} GFLOP/s (half at {self.compute_efficiency.half / 1e6:.3g} Mflop), "
            f"{self.bytes_per_s / 1e9:.3g} GB/s (half at {self.memory_efficiency.half / 2**20:.3g} MiB), "
            f"{self.launch_s * 1e6:.1f} us per kernel"
        )


def roofline_time_s(
    flops: float, nbytes: float, peak: float, eff_c: Efficiency, bw: float, eff_m: Efficiency, launch_s: float
) -> float:
    """``max(flops / (peak * eff_c(flops)), nbytes / (bw * eff_m(nbytes))) + launch_s`` (0 work: launch only)."""
    t_math = flops / (peak * eff_c.at(flops)) if flops > 0 else 0.0  # s
    t_mem = nbytes / (bw * eff_m.at(nbytes)) if nbytes > 0 else 0.0  # s
    return max(t_math, t_mem) + launch_s


def _check_points(points: Sequence[Sequence[float]], width: int, what: str, minimum: int) -> np.ndarray:
    import numpy as np  # imported on use: planlab simulate needs no fitting

    arr = np.asarray(points, dtype=float)
    if arr.ndim != 2 or arr.shape[1] != width or len(arr) < minimum:
        raise ConfigError(f"{what} needs at least {minimum} measurements of {width} numbers each, got {len(arr)}")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0) or np.any(arr[:, -1] <= 0):
        raise ConfigError(f"{what}: measurements must be finite, sizes >= 0 and times > 0")
    return arr


MAX_BYTES_PER_S = 1e13  # 10 TB/s: above any link, below the 1e5 GB/s a profile file accepts


def fit_alpha_beta(points: Sequence[tuple[float, float]]) -> AlphaBeta:
    """Fit ``time = alpha + nbytes / bandwidth`` to ``(nbytes, seconds)`` points by least squares
    on relative error, with alpha >= 0 and bandwidth > 0. Needs two distinct sizes."""
    import numpy as np  # imported on use: planlab simulate needs no fitting

    arr = _check_points(points, 2, "fit_alpha_beta", 2)
    x, t = arr[:, 0], arr[:, 1]
    if len(set(x)) < 2:
        raise ConfigError("fit_alpha_beta needs measurements at two different sizes at least")
    alpha, beta = fit_linear(np.stack([np.ones_like(x), x], axis=1), t)
    # A flat curve (noise hides the bytes' cost) gets the highest bandwidth a profile holds.
    return AlphaBeta(alpha, min(1.0 / beta, MAX_BYTES_PER_S) if beta > 0 else MAX_BYTES_PER_S)


def fit_linear(features: np.ndarray | Sequence[Sequence[float]], times: Sequence[float]) -> tuple[float, ...]:
    """Non-negative coefficients ``c`` minimising ``sum(((features @ c) / t - 1) ** 2)``."""
    import numpy as np  # imported on use: planlab simulate needs no fitting
    from scipy.optimize import nnls

    a = np.asarray(features, dtype=float)
    t = np.asarray(times, dtype=float)
    if a.ndim != 2 or a.shape[0] != t.shape[0] or a.shape[0] < a.shape[1]:
        raise ConfigError(
            f"fit_linear needs at least as many measurements ({a.shape[0]}) as features "
            f"({a.shape[1] if a.ndim == 2 else '?'})"
        )
    coef, _ = nnls(a / t[:, None], np.ones_like(t))
    return tuple(float(c) for c in coef)


def fit_roofline(samples: Sequence[tuple[float, float, float]], *, launch_s: float | None = None) -> Roofline:
    """Fit the roofline parameters to ``(flops, bytes, seconds)`` kernel measurements.

    The samples should include compute-bound kernels (matmuls) and memory-bound ones
    (elementwise) over a range of sizes. ``launch_s`` fixes the per-kernel cost instead of
    fitting it. Least squares on log time; the efficiency maxima are 1 (the fitted peak and
    bandwidth are what the device reaches).
    """
    import numpy as np  # imported on use: planlab simulate needs no fitting
    from scipy.optimize import least_squares

    arr = _check_points(samples, 3, "fit_roofline", 6)
    f, b, t = arr[:, 0], arr[:, 1], arr[:, 2]
    # Starting point from the data: the best rates seen, the smallest time as the launch cost.
    big_f = f > 0
    peak0 = float(np.max(f[big_f] / t[big_f])) if big_f.any() else 1e9
    bw0 = float(np.max(b[b > 0] / t[b > 0])) if (b > 0).any() else 1e9
    launch0 = float(np.min(t)) * 0.5 if launch_s is None else launch_s
    x0 = np.array(
        [
            math.log(peak0 * 1.5),
            math.log(max(np.median(f[big_f]) if big_f.any() else 1e6, 1.0) * 0.1),
            0.0,
            math.log(bw0 * 1.5),
            math.log(max(float(np.median(b)), 1.0) * 0.1),
            0.0,
            math.log(max(launch0, 1e-9)),
        ]
    )

    def unpack(x: np.ndarray) -> tuple:
        launch = math.exp(x[6]) if launch_s is None else launch_s
        return (
            math.exp(x[0]),
            Efficiency(1.0, math.exp(x[1]), math.exp(x[2])),
            math.exp(x[3]),
            Efficiency(1.0, math.exp(x[4]), math.exp(x[5])),
            launch,
        )

    def residual(x: np.ndarray) -> np.ndarray:
        peak, ec, bw, em, launch = unpack(x)
        with np.errstate(divide="ignore"):
            t_math = np.where(f > 0, f / peak * (1.0 + (ec.half / np.maximum(f, 1e-30)) ** ec.exponent), 0.0)
            t_mem = np.where(b > 0, b / bw * (1.0 + (em.half / np.maximum(b, 1e-30)) ** em.exponent), 0.0)
        return np.log(np.maximum(t_math, t_mem) + launch) - np.log(t)

    # Bounds: a rate is at least the best one seen (time >= work / rate) and at most 30 times it;
    # a curve's half-size lies within the measured sizes (a hundredth of the smallest to the largest).
    fpos, bpos = f[f > 0] if big_f.any() else np.array([1.0]), b[b > 0] if (b > 0).any() else np.array([1.0])
    lo = np.array(
        [
            math.log(peak0),
            math.log(fpos.min() / 100),
            math.log(0.3),
            math.log(bw0),
            math.log(bpos.min() / 100),
            math.log(0.3),
            math.log(1e-9),
        ]
    )
    hi = np.array(
        [
            math.log(peak0 * 30),
            math.log(fpos.max()),
            math.log(3.0),
            math.log(bw0 * 30),
            math.log(bpos.max()),
            math.log(3.0),
            math.log(1.0),
        ]
    )
    x0 = np.clip(x0, lo + 1e-9, hi - 1e-9)
    best = None
    for start_exp in (0.0, math.log(2.0)):  # a second start when the first leaves errors: the valley is shallow
        start = x0.copy()
        start[2] = start[5] = start_exp
        sol = least_squares(residual, start, bounds=(lo, hi), x_scale="jac", max_nfev=1500)
        if best is None or sol.cost < best.cost:
            best = sol
        if math.sqrt(2 * best.cost / len(t)) < 1e-3:  # rms log error under 0.1%: done
            break
    peak, ec, bw, em, launch = unpack(best.x)
    return Roofline(peak, ec, bw, em, launch)


def robust_overhead(residuals_s: Sequence[float]) -> float:
    """The fixed cost per task: the median of ``measured - modelled`` over tasks, at least 0."""
    import numpy as np  # imported on use: planlab simulate needs no fitting

    if len(residuals_s) == 0:
        raise ConfigError("robust_overhead needs at least one residual")
    return max(0.0, float(np.median(np.asarray(residuals_s, dtype=float))))


def relative_errors(pred: Sequence[float], meas: Sequence[float]) -> np.ndarray:
    """``pred / meas - 1`` element-wise."""
    import numpy as np  # imported on use: planlab simulate needs no fitting

    return np.asarray(pred, dtype=float) / np.asarray(meas, dtype=float) - 1.0
