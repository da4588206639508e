"""Calibration profiles: what ``planlab calibrate`` measured and fitted on one machine.

A profile is versioned JSON with units in the field names (``time_us``, ``alpha_us``,
``GBps``, ``flop``, ``bytes``), converted to SI units once at load:

```json
{"format": "planlab-profile", "version": 1, "device": "cpu",
 "created": "2025-01-01T00:00:00", "host": "...", "torch": "2.13.0", "threads": 1, "quick": false,
 "kernel_model": {"fp32": {"peak_gflops": 150, "half_mflop": 1.0, "compute_exponent": 1.0,
                           "GBps": 12, "half_MiB": 0.3, "memory_exponent": 0.8, "launch_us": 3.5}},
 "task_overhead_us": {"F": 7, "B": 0, "L": 5},
 "view_task_us": {"F": 9, "B": 22}, "concurrent_slowdown": {"2": 1.6},
 "optimizer": {"fixed_us": 80, "per_tensor_us": 55, "per_param_ns": 5},
 "collectives": [{"kind": "all_reduce", "ranks": 2, "alpha_us": 90, "GBps": 1.2, "points": [[4096, 95.0]]}],
 "kernels": [{"phase": "F", "kind": "linear", "dtype": "fp32", "shape": [512, 64, 256],
              "flop": 16777216, "bytes": 721920, "time_us": 120.0}]}
```

``kernels`` is the profiled table: a kernel priced by the cost model whose flop and byte
counts lie near measured entries of its operator's kind (within a factor of :data:`NEAR` in
both) takes their measured times, carried to its shape by the fitted model (nearest-shape
interpolation, see ``Profile.kernel_time_s``); elsewhere the fitted ``kernel_model`` (a roofline
with efficiency curves) prices it. An entry slower than an entry of its kind doing at least as
much work is read at that entry's time (``Profile.envelope``).
``task_overhead_us`` is the executor's own cost per task kind on top of the kernels (whose
measured times include the framework's dispatch and, backward, the autograd engine's call);
``view_task_us`` is the whole time of a forward or backward task with no kernel (a view);
``concurrent_slowdown`` the factor on compute times while that many processes of the machine
compute at once (they share its caches and memory; on a virtual machine, perhaps its cores); the collectives' ``alpha_us`` and ``GBps`` are fitted per collective and
group size, measured the way the executor issues them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planlab.costmodel.fit import AlphaBeta, Roofline
from planlab.costmodel.fields import Fields
from planlab.costmodel.hardware import DTYPES, Efficiency
from planlab.errors import ConfigError, choices

PROFILE_FORMAT = "planlab-profile"
PROFILE_VERSION = 1
NEAR = 2.0  # a table entry prices a kernel whose flop and bytes are both within this factor
TASK_KINDS = ("F", "B", "L", "C", "S", "R")
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "p2p")
_WHAT = "profile file"


@dataclass(frozen=True)
class KernelTime:
    """One measured kernel: ``phase`` F (forward) or B (backward) of an operator ``kind``."""

    phase: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    flops: float
    bytes_moved: float
    time_s: float

    def __str__(self) -> str:
        return f"{self.phase}:{self.kind}{list(self.shape)}/{self.dtype} {self.time_s * 1e6:.1f} us"


@dataclass(frozen=True)
class CollectiveFit:
    """``time = alpha + nbytes / bandwidth`` for ``kind`` among ``ranks`` ranks (or ``p2p``: one transfer)."""

    kind: str
    ranks: int
    fit: AlphaBeta
    points: tuple[tuple[float, float], ...] = ()  # measured (nbytes, seconds)

    def __str__(self) -> str:
        return f"{self.kind}x{self.ranks}: {self.fit}"


@dataclass(frozen=True)
class OptimizerFit:
    """The optimizer step: ``fixed + per_tensor * tensors + per_param * parameters`` seconds."""

    fixed_s: float
    per_tensor_s: float
    per_param_s: float

    def time_s(self, tensors: int, params: float) -> float:
        """Seconds for one step over ``tensors`` tensors holding ``params`` parameters."""
        return self.fixed_s + self.per_tensor_s * tensors + self.per_param_s * params


@dataclass(frozen=True)
class Profile:
    """A calibration of one device type and its interconnect (SI units)."""

    device: str
    rooflines: tuple[tuple[str, Roofline], ...]  # (dtype, fitted kernel model)
    task_overhead_s: tuple[tuple[str, float], ...]  # (task kind code, seconds)
    optimizer: OptimizerFit | None = None
    collectives: tuple[CollectiveFit, ...] = ()
    kernels: tuple[KernelTime, ...] = ()
    meta: tuple[tuple[str, Any], ...] = field(default=(), compare=False)
    path: str = field(default="", compare=False)
    view_task_s: tuple[tuple[str, float], ...] = ()  # (F or B, seconds of a whole task with no kernel)
    slowdown: tuple[tuple[int, float], ...] = ()  # (busy ranks, factor on compute while they all compute)

    # ------------------------------------------------------------------ lookups

    def roofline(self, dtype: str) -> Roofline | None:
        """The fitted kernel model for ``dtype`` (or None)."""
        return dict(self.rooflines).get(dtype)

    def overhead_s(self, kind: str) -> float:
        """The executor's cost per task of ``kind`` (a TaskKind code), 0 if not measured."""
        return dict(self.task_overhead_s).get(kind, 0.0)

    def view_s(self, kind: str) -> float | None:
        """Seconds of a whole ``kind`` (F or B) task with no work (a view), if measured."""
        return dict(self.view_task_s).get(kind)

    def slowdown_at(self, ranks: int) -> float:
        """The factor on compute times while ``ranks`` processes of this machine compute at once
        (1 for one; the largest measured count stands for more)."""
        if ranks <= 1 or not self.slowdown:
            return 1.0
        fits = dict(self.slowdown)
        return fits.get(
            ranks, fits[max(n for n in fits if n <= ranks)] if any(n <= ranks for n in fits) else fits[min(fits)]
        )

    @property
    def compute_overhead_s(self) -> float:
        """The mean of the forward and backward task costs: the cost per compute task when the
        caller does not say which (every operator has one of each)."""
        d = dict(self.task_overhead_s)
        return (d.get("F", 0.0) + d.get("B", 0.0)) / 2

    def kernel_time_s(
        self, flops: float, bytes_moved: float, dtype: str, phase: str | None = None, kind: str = ""
    ) -> float | None:
        """Seconds for one kernel from the profile, or None when it has nothing for ``dtype``.

        Measured kernels (same dtype, if given the same phase, and of the operator ``kind`` when
        the table measured that kind: a layer norm is not priced by a GELU of the same size)
        within a factor :data:`NEAR` in both flop and bytes take precedence: an exact shape gets its measured time; otherwise the
        fitted model's time is corrected by the measured/modelled ratios of those neighbours,
        averaged in log space with weights falling with the square of their distance (nearest-
        shape interpolation). With no neighbour, the fitted model alone.
        """
        model = self.roofline(dtype)
        near = self.neighbours(flops, bytes_moved, dtype, phase, kind=kind if kind in self.kinds else "")
        if near and near[0][0] == 0.0:
            return near[0][1].time_s
        if near:
            if model is None:
                return near[0][1].time_s
            num = den = 0.0
            for d, k in near:
                w = 1.0 / (d * d)
                num += w * math.log(k.time_s / model.time_s(k.flops, k.bytes_moved))
                den += w
            return model.time_s(flops, bytes_moved) * math.exp(num / den)
        return model.time_s(flops, bytes_moved) if model is not None else None

    @property
    def kinds(self) -> frozenset[str]:
        """The operator kinds the kernel table measured."""
        got = self.__dict__.get("_kinds")
        if got is None:
            got = frozenset(k.kind for k in self.kernels)
            object.__setattr__(self, "_kinds", got)
        return got

    @property
    def envelope(self) -> tuple[KernelTime, ...]:
        """The kernel table with each time capped by the times of the entries of its kind, phase
        and dtype that do at least as much work (flop and bytes both): a kernel that does less
        of the same work is not slower, so a larger time is a measurement a busy machine
        disturbed (the lower quartile of a case all of whose samples were preempted)."""
        got = self.__dict__.get("_envelope")
        if got is None:
            got = tuple(
                dataclasses.replace(
                    k,
                    time_s=min(
                        [k.time_s]
                        + [
                            j.time_s
                            for j in self.kernels
                            if (j.kind, j.phase, j.dtype) == (k.kind, k.phase, k.dtype)
                            and j.flops >= k.flops
                            and j.bytes_moved >= k.bytes_moved
                        ]
                    ),
                )
                for k in self.kernels
            )
            object.__setattr__(self, "_envelope", got)
        return got

    def neighbours(
        self, flops: float, bytes_moved: float, dtype: str, phase: str | None = None, count: int = 4, kind: str = ""
    ) -> list[tuple[float, KernelTime]]:
        """Up to ``count`` entries of the table's :attr:`envelope` (of operator ``kind``, if given)
        nearest in (log flop, log bytes) within a factor NEAR in both, as ``(distance, entry)``,
        nearest first."""
        lim = math.log(NEAR) + 1e-9
        lf, lb = math.log(max(flops, 1.0)), math.log(max(bytes_moved, 1.0))
        found = []
        for k in self.envelope:
            if k.dtype != dtype or (phase is not None and k.phase != phase) or (kind and k.kind != kind):
                continue
            df, db = abs(math.log(max(k.flops, 1.0)) - lf), abs(math.log(max(k.bytes_moved, 1.0)) - lb)
            if df <= lim and db <= lim:
                found.append((math.hypot(df, db), k))
        found.sort(key=lambda x: x[0])
        return found[:count]

    def collective(self, kind: str, ranks: int) -> tuple[CollectiveFit, int] | None:
        """The fit for ``kind`` measured at ``ranks`` ranks, or at the nearest measured group size
        (returned with it), or None."""
        fits = [c for c in self.collectives if c.kind == kind]
        if not fits:
            return None
        best = min(fits, key=lambda c: (abs(c.ranks - ranks), -c.ranks))
        return best, best.ranks

    def __str__(self) -> str:
        where = f" from {self.path}" if self.path else ""
        return f"Profile({self.device}{where}: {len(self.kernels)} kernels, {len(self.collectives)} collective fits)"

    # ------------------------------------------------------------------ files

    def to_json(self) -> dict:
        """The profile as a JSON object (see the module docstring)."""
        out: dict[str, Any] = {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "device": self.device}
        out.update(dict(self.meta))
        out["kernel_model"] = {
            dt: {
                "peak_gflops": r.peak_flops_per_s / 1e9,
                "half_mflop": r.compute_efficiency.half / 1e6,
                "compute_exponent": r.compute_efficiency.exponent,
                "GBps": r.bytes_per_s / 1e9,
                "half_MiB": r.memory_efficiency.half / 2**20,
                "memory_exponent": r.memory_efficiency.exponent,
                "launch_us": r.launch_s * 1e6,
            }
            for dt, r in self.rooflines
        }
        out["task_overhead_us"] = {k: v * 1e6 for k, v in self.task_overhead_s}
        if self.view_task_s:
            out["view_task_us"] = {k: v * 1e6 for k, v in self.view_task_s}
        if self.slowdown:
            out["concurrent_slowdown"] = {str(n): f for n, f in self.slowdown}
        if self.optimizer is not None:
            o = self.optimizer
            out["optimizer"] = {
                "fixed_us": o.fixed_s * 1e6,
                "per_tensor_us": o.per_tensor_s * 1e6,
                "per_param_ns": o.per_param_s * 1e9,
            }
        out["collectives"] = [
            {
                "kind": c.kind,
                "ranks": c.ranks,
                "alpha_us": c.fit.alpha_s * 1e6,
                "GBps": c.fit.bytes_per_s / 1e9,
                "points": [[int(n), t * 1e6] for n, t in c.points],
            }
            for c in self.collectives
        ]
        out["kernels"] = [
            {
                "phase": k.phase,
                "kind": k.kind,
                "dtype": k.dtype,
                "shape": list(k.shape),
                "flop": k.flops,
                "bytes": k.bytes_moved,
                "time_us": k.time_s * 1e6,
            }
            for k in self.kernels
        ]
        return out

    def save(self, path: str | os.PathLike) -> Path:
        """Write the profile to ``path`` (whole or not at all)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        os.replace(tmp, path)
        return path


def load_profile(path: str | os.PathLike) -> Profile:
    """Read a profile written by ``planlab calibrate``. Raises ConfigError naming the file, the
    field and the expected form for a missing, malformed or out-of-range field, or another version."""
    path = Path(path)
    try:
        obj = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{_WHAT} {str(path)!r} not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{_WHAT} {str(path)!r}: cannot read JSON: {exc}") from None
    return dataclasses.replace(profile_from_json(obj, str(path)), path=str(path))


def profile_from_json(obj: Any, where: str = "<profile>") -> Profile:
    """A Profile from its JSON object (see ``load_profile``)."""
    f = Fields(obj, where, what=_WHAT)
    if f.get("format") != PROFILE_FORMAT:
        raise f.error("format", f"must be {PROFILE_FORMAT!r}, got {f.obj['format']!r}")
    if f.get("version") != PROFILE_VERSION:
        raise f.error("version", f"is {f.obj['version']!r}; this planlab reads version {PROFILE_VERSION}")
    device = f.text("device")
    rooflines = _rooflines(f.sub("kernel_model"))
    ov = f.sub("task_overhead_us")
    ov.only(set(TASK_KINDS))
    overheads = tuple((k, ov.number(k, strict=False, high=1e6, unit="microseconds") * 1e-6) for k in sorted(ov.obj))
    views: tuple[tuple[str, float], ...] = ()
    if "view_task_us" in f.obj:
        vw = f.sub("view_task_us")
        vw.only({"F", "B"})
        views = tuple((k, vw.number(k, strict=False, high=1e6, unit="microseconds") * 1e-6) for k in sorted(vw.obj))
    optimizer = None
    if "optimizer" in f.obj:
        o = f.sub("optimizer")
        o.only({"fixed_us", "per_tensor_us", "per_param_ns"})
        optimizer = OptimizerFit(
            o.number("fixed_us", strict=False, high=1e7, unit="microseconds") * 1e-6,
            o.number("per_tensor_us", strict=False, high=1e7, unit="microseconds") * 1e-6,
            o.number("per_param_ns", strict=False, high=1e6, unit="nanoseconds") * 1e-9,
        )
    colls = _collectives(f, where)
    kernels = _kernels(f, where)
    meta = tuple((k, f.obj[k]) for k in ("created", "host", "torch", "threads", "quick", "seconds") if k in f.obj)
    slowdown: list[tuple[int, float]] = []
    if "concurrent_slowdown" in f.obj:
        sd = f.sub("concurrent_slowdown")
        for key in sd.obj:
            if not str(key).isdigit() or int(key) < 2:
                raise sd.error(key, 'must be a number of ranks >= 2 (a JSON key like "2")')
            slowdown.append((int(key), sd.number(key, low=0.1, high=100.0, unit="factor on compute times")))
    return Profile(
        device,
        rooflines,
        overheads,
        optimizer,
        tuple(colls),
        tuple(kernels),
        meta,
        view_task_s=views,
        slowdown=tuple(sorted(slowdown)),
    )


def _rooflines(models: Fields) -> tuple:
    """The per-dtype rooflines of ``kernel_model``."""
    rooflines = []
    for dt in models.obj:
        if dt not in DTYPES:
            raise models.error(dt, f"is not a dtype; choose {choices(DTYPES)}")
        m = models.sub(dt)
        m.only({"peak_gflops", "half_mflop", "compute_exponent", "GBps", "half_MiB", "memory_exponent", "launch_us"})
        rooflines.append(
            (
                dt,
                Roofline(
                    m.number("peak_gflops", high=1e8, unit="GFLOP/s") * 1e9,
                    Efficiency(
                        1.0,
                        m.number("half_mflop", strict=False, high=1e9, unit="Mflop") * 1e6,
                        m.number("compute_exponent", high=10.0),
                    ),
                    m.number("GBps", high=1e5, unit="GB/s") * 1e9,
                    Efficiency(
                        1.0,
                        m.number("half_MiB", strict=False, high=1e6, unit="MiB") * 2**20,
                        m.number("memory_exponent", high=10.0),
                    ),
                    m.number("launch_us", strict=False, high=1e6, unit="microseconds") * 1e-6,
                ),
            )
        )
    return tuple(rooflines)


def _collectives(f: Fields, where: str) -> list:
    """The fitted collectives of ``collectives``."""
    colls = []
    for i, c in enumerate(_list(f, "collectives")):
        cf = Fields(c, where, f"collectives[{i}].", _WHAT)
        cf.only({"kind", "ranks", "alpha_us", "GBps", "points"})
        kind = cf.text("kind")
        if kind not in COLLECTIVE_KINDS:
            raise cf.error("kind", f"is {kind!r}; choose {choices(COLLECTIVE_KINDS)}")
        pts = tuple((float(n), float(t) * 1e-6) for n, t in _pairs(cf, "points")) if "points" in cf.obj else ()
        colls.append(
            CollectiveFit(
                kind,
                cf.integer("ranks"),
                AlphaBeta(
                    cf.number("alpha_us", strict=False, high=1e7, unit="microseconds") * 1e-6,
                    cf.number("GBps", high=1e5, unit="GB/s") * 1e9,
                ),
                pts,
            )
        )
    return colls


def _kernels(f: Fields, where: str) -> list:
    """The measured kernels of ``kernels``."""
    kernels = []
    for i, k in enumerate(_list(f, "kernels")):
        kf = Fields(k, where, f"kernels[{i}].", _WHAT)
        kf.only({"phase", "kind", "dtype", "shape", "flop", "bytes", "time_us"})
        phase = kf.text("phase")
        if phase not in ("F", "B"):
            raise kf.error("phase", f"is {phase!r}; choose 'F' or 'B'")
        dtype = kf.text("dtype")
        if dtype not in DTYPES:
            raise kf.error("dtype", f"is {dtype!r}; choose {choices(DTYPES)}")
        shape = kf.get("shape")
        if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 1 for s in shape):
            raise kf.error("shape", f"must be a list of positive integers, got {shape!r}")
        kernels.append(
            KernelTime(
                phase,
                kf.text("kind"),
                dtype,
                tuple(shape),
                kf.number("flop", strict=False, unit="floating-point operations"),
                kf.number("bytes", strict=False, unit="bytes of memory traffic"),
                kf.number("time_us", high=1e8, unit="microseconds") * 1e-6,
            )
        )
    return kernels


def _list(f: Fields, key: str) -> list:
    val = f.get(key)
    if not isinstance(val, list):
        raise f.error(key, f"must be a JSON list, got {val!r}")
    return val


def _pairs(f: Fields, key: str) -> list:
    val = _list(f, key)
    for v in val:
        if not (
            isinstance(v, list)
            and len(v) == 2
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in v)
        ):
            raise f.error(key, f"must be a list of [bytes, microseconds] pairs, got {v!r}")
    return val
