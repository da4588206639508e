"""Tensor layouts on device meshes, after DTensor's placements.

A :class:`Layout` says, for each axis of a device mesh, whether a tensor is
sharded along one of its axes (``S(a)``), replicated (``R``) or held as
partial sums (``P``). :func:`piece_boxes` gives the region each device holds.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

Box = tuple[tuple[int, int], ...]  # per tensor axis: [start, stop)


@dataclass(frozen=True)
class Shard:
    """The tensor is split along its axis ``dim`` across this mesh axis."""

    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class Replicate:
    """Every device along this mesh axis holds the same full values."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Partial:
    """The devices along this mesh axis hold addends of the full values."""

    def __str__(self) -> str:
        return "P"


Placement = Shard | Replicate | Partial


@dataclass(frozen=True)
class Mesh:
    """Devices arranged as an n-d array (row-major ``devices``)."""

    shape: tuple[int, ...]
    devices: tuple[int, ...]

    def __post_init__(self) -> None:
        if math.prod(self.shape) != len(self.devices):
            raise ValueError(f"mesh shape {self.shape} does not hold {len(self.devices)} devices")

    def coord(self, flat: int) -> tuple[int, ...]:
        out = []
        for s in reversed(self.shape):
            out.append(flat % s)
            flat //= s
        return tuple(reversed(out))

    def flat(self, coord: tuple[int, ...]) -> int:
        i = 0
        for c, s in zip(coord, self.shape):
            i = i * s + c
        return i

    def groups(self, axis: int) -> list[tuple[int, ...]]:
        """Device groups that vary along ``axis`` with the other coordinates fixed."""
        out = []
        for flat in range(len(self.devices)):
            c = self.coord(flat)
            if c[axis] != 0:
                continue
            out.append(tuple(self.devices[self.flat(c[:axis] + (k,) + c[axis + 1:])]
                             for k in range(self.shape[axis])))
        return out

    def __str__(self) -> str:
        return f"{'x'.join(map(str, self.shape))}{list(self.devices)}"


@dataclass(frozen=True)
class Layout:
    """A tensor's placement over a mesh, one Placement per mesh axis."""

    mesh: Mesh
    placements: tuple[Placement, ...]

    def __str__(self) -> str:
        return "[" + ",".join(map(str, self.placements)) + f"]@{self.mesh}"

    def shard_axes(self, dim: int) -> list[int]:
        """Mesh axes that shard tensor axis ``dim``, outermost first."""
        return [i for i, p in enumerate(self.placements) if isinstance(p, Shard) and p.dim == dim]

    @property
    def partial_axes(self) -> list[int]:
        return [i for i, p in enumerate(self.placements) if isinstance(p, Partial)]

    def box(self, flat: int, shape: tuple[int, ...]) -> Box:
        """Region of the tensor held by the ``flat``-th mesh position."""
        return _box(self, flat, tuple(shape))

    def _box(self, flat: int, shape: tuple[int, ...]) -> Box:
        c = self.mesh.coord(flat)
        out = []
        for d, size in enumerate(shape):
            idx, n = 0, 1
            for ax in self.shard_axes(d):
                idx = idx * self.mesh.shape[ax] + c[ax]
                n *= self.mesh.shape[ax]
            step = size // n
            out.append((idx * step, (idx + 1) * step))
        return tuple(out)

    def partial_key(self, flat: int) -> tuple[int, ...]:
        c = self.mesh.coord(flat)
        return tuple(c[a] for a in self.partial_axes)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def intersect(a: Box, b: Box) -> Box | None:
    out = []
    for (a0, a1), (b0, b1) in zip(a, b):
        lo, hi = max(a0, b0), min(a1, b1)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def relative(inner: Box, outer: Box) -> Box:
    """``inner`` in the coordinates of ``outer``."""
    return tuple((i0 - o0, i1 - o0) for (i0, i1), (o0, _) in zip(inner, outer))


def box_numel(box: Box) -> int:
    return math.prod(b - a for a, b in box)


@functools.lru_cache(maxsize=1 << 16)
def _box(layout: Layout, flat: int, shape: tuple[int, ...]) -> Box:
    return layout._box(flat, shape)
