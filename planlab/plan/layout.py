"""Tensor layouts on device meshes, after DTensor's placements.

A :class:`Layout` says, for each axis of a device mesh, whether a tensor is
sharded along one of its axes (``S(a)``), replicated (``R``) or held as
partial sums (``P``). :func:`piece_boxes` gives the region each device holds.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Iterable

from planlab.errors import ConfigError

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
            raise ConfigError(
                f"mesh shape {self.shape} does not hold {len(self.devices)} devices; expected shape's product "
                f"{math.prod(self.shape)} devices"
            )

    def __hash__(self) -> int:
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.shape, self.devices))
            object.__setattr__(self, "_hash", h)
        return h

    def coord(self, flat: int) -> tuple[int, ...]:
        return self._coords[flat]

    @functools.cached_property
    def _coords(self) -> tuple[tuple[int, ...], ...]:
        out = []
        for flat in range(len(self.devices)):
            c = []
            for s in reversed(self.shape):
                c.append(flat % s)
                flat //= s
            out.append(tuple(reversed(c)))
        return tuple(out)

    @functools.cached_property
    def position(self) -> dict[int, int]:
        """``position[device]``: the device's flat index in the mesh."""
        return {d: i for i, d in enumerate(self.devices)}

    def flat(self, coord: tuple[int, ...]) -> int:
        i = 0
        for c, s in zip(coord, self.shape):
            i = i * s + c
        return i

    def groups(self, axis: int) -> list[tuple[int, ...]]:
        """Device groups that vary along ``axis`` with the other coordinates fixed."""
        return list(self.group_map((axis,)).values())

    def group_map(self, axes: tuple[int, ...]) -> dict[tuple[int, ...], tuple[int, ...]]:
        """The device groups that vary along ``axes`` with the other coordinates fixed, keyed by
        those other coordinates (cached per mesh)."""
        cache = self.__dict__.setdefault("_group_cache", {})
        got = cache.get(axes)
        if got is None:
            got = {}
            for flat, c in enumerate(self._coords):
                key = tuple(x for a, x in enumerate(c) if a not in axes)
                got.setdefault(key, []).append(self.devices[flat])
            got = cache[axes] = {k: tuple(v) for k, v in got.items()}
        return got

    def group_of(self, flat: int, axes: tuple[int, ...]) -> tuple[int, ...]:
        """The devices that share every coordinate of position ``flat`` but those along ``axes``."""
        c = self._coords[flat]
        return self.group_map(axes)[tuple(x for a, x in enumerate(c) if a not in axes)]

    def __str__(self) -> str:
        return f"{'x'.join(map(str, self.shape))}{list(self.devices)}"


@dataclass(frozen=True)
class Layout:
    """A tensor's placement over a mesh, one Placement per mesh axis."""

    mesh: Mesh
    placements: tuple[Placement, ...]

    def __hash__(self) -> int:  # kept: layouts key the caches of boxes and conversions
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.mesh, self.placements))
            object.__setattr__(self, "_hash", h)
        return h

    def __str__(self) -> str:
        return "[" + ",".join(map(str, self.placements)) + f"]@{self.mesh}"

    def shard_axes(self, dim: int) -> list[int]:
        """Mesh axes that shard tensor axis ``dim``, outermost first."""
        return [i for i, p in enumerate(self.placements) if isinstance(p, Shard) and p.dim == dim]

    @property
    def partial_axes(self) -> list[int]:
        return list(self._partial_axes())

    def _partial_axes(self) -> tuple[int, ...]:
        got = self.__dict__.get("_partial")  # kept, as the hash: conversions ask it for every position
        if got is None:
            got = tuple(i for i, p in enumerate(self.placements) if isinstance(p, Partial))
            object.__setattr__(self, "_partial", got)
        return got

    def normalized(self) -> tuple[Placement, ...]:
        """The placements with size-1 mesh axes replicated (kept, as the hash: every operator's inputs
        are compared with their producers' layouts)."""
        got = self.__dict__.get("_normal")
        if got is None:
            got = tuple(p if s > 1 else Replicate() for p, s in zip(self.placements, self.mesh.shape))
            object.__setattr__(self, "_normal", got)
        return got

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

    def boxes(self, shape: tuple[int, ...]) -> list[Box]:
        """:meth:`box` of every mesh position in order, in one pass: each tensor axis's mesh axes and
        step found once, and the axes no mesh axis shards (their whole extent) shared by every box."""
        mesh, dims = self.mesh, []
        for d, size in enumerate(shape):
            axes = self.shard_axes(d)
            n = math.prod(mesh.shape[ax] for ax in axes)
            dims.append((d, tuple((ax, mesh.shape[ax]) for ax in axes), size // n))
        sharded = [(d, axes, step) for d, axes, step in dims if axes]
        whole = [(0, size) for size in shape]
        out = []
        for c in mesh._coords:
            box = list(whole)
            for d, axes, step in sharded:
                idx = 0
                for ax, s in axes:
                    idx = idx * s + c[ax]
                box[d] = (idx * step, (idx + 1) * step)
            out.append(tuple(box))
        return out

    def partial_key(self, flat: int) -> tuple[int, ...]:
        c = self.mesh.coord(flat)
        return tuple(c[a] for a in self._partial_axes())


def positions(mesh: Mesh, only: frozenset[int] | None) -> Iterable[tuple[int, int]]:
    """``(flat, device)`` of a mesh's devices, or of those in ``only`` (cached per mesh)."""
    if only is None:
        return enumerate(mesh.devices)
    cache = mesh.__dict__.setdefault("_kept", {})
    got = cache.get(only)
    if got is None:
        pos = mesh.position
        got = cache[only] = sorted((pos[d], d) for d in only if d in pos)
    return got


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
