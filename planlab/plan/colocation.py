"""Co-located pieces: an operator split into more pieces than the devices that hold them.

nnScaler's coshard (Lin et al., OSDI 2024) splits an operator into ``k x n`` pieces of which
each of ``n`` devices holds ``k``; a device runs its ``k`` pieces one after another and
recomputes each in the backward, so that only one piece's activations are alive at a time.
A plan says this with the primitives alone: ``op_trans`` into ``k * n`` pieces (or a further
``op_trans`` of the same dimension by ``k``) and ``op_assign`` with each device listed ``k``
times, e.g. ``[0, 0, 1, 1]``.

planlab keeps the representation local: the ``k`` pieces of a device must be neighbours along
one mesh axis that is the innermost split of its dimension, so that together they are one
contiguous ``1/n`` share of the dimension. The device then holds exactly what an ``n``-way
split gives it (same layouts, same collectives) and ``materialize`` runs its computation as
``k`` chunks of that share (:mod:`planlab.plan.coshard`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from planlab.errors import InfeasiblePlan
from planlab.plan.layout import Mesh


@dataclass(frozen=True)
class CoLocation:
    """``k`` neighbouring pieces along mesh ``axis`` (splitting dimension ``dim``) per device."""

    axis: int
    dim: str
    k: int

    def __str__(self) -> str:
        return f"{self.dim}/{self.k}@axis{self.axis}"

    def reduce(
        self, dims: tuple[str | None, ...], sizes: tuple[int, ...], devices: tuple[int, ...]
    ) -> tuple[tuple[str | None, ...], tuple[int, ...], tuple[int, ...]]:
        """The ``n``-way split each device's share is: mesh axis ``axis`` shrunk ``k`` times
        (dropped when that leaves it one piece wide), one entry per device."""
        return _reduce(self, tuple(dims), tuple(sizes), tuple(devices))


@functools.lru_cache(maxsize=1024)
def _reduce(
    co: CoLocation, dims: tuple[str | None, ...], sizes: tuple[int, ...], devices: tuple[int, ...]
) -> tuple[tuple[str | None, ...], tuple[int, ...], tuple[int, ...]]:
    """:meth:`CoLocation.reduce`, once per placement (operators share a few)."""
    mesh = Mesh(sizes, devices)
    a, k = co.axis, co.k
    out_sizes = list(sizes)
    out_sizes[a] //= k
    reduced = Mesh(tuple(out_sizes), tuple(range(len(devices) // k)))
    out_devices = []
    for flat in range(len(reduced.devices)):
        c = list(reduced.coord(flat))
        c[a] *= k
        out_devices.append(devices[mesh.flat(tuple(c))])
    out_dims = list(dims)
    if out_sizes[a] == 1:
        del out_sizes[a], out_dims[a]
    return tuple(out_dims), tuple(out_sizes), tuple(out_devices)


def colocation(
    op: str, dims: tuple[str | None, ...], sizes: tuple[int, ...], devices: tuple[int, ...]
) -> CoLocation | None:
    """How ``op``'s pieces share devices: None when every piece has a device of its own.

    Raises InfeasiblePlan, naming the operator and its devices, unless every device holds the
    same number ``k`` of pieces that are neighbours along one mesh axis (aligned to multiples of
    ``k``), that axis splits a dimension (not replicas) and no later mesh axis splits it again.
    """
    if len(set(devices)) == len(devices):
        return None
    got = _analyse(tuple(dims), tuple(sizes), tuple(devices))  # operators share a few placements
    if isinstance(got, str):
        raise InfeasiblePlan(f"operator {op!r} on devices {list(devices)}: {got}")
    return got


@functools.lru_cache(maxsize=1024)
def _analyse(dims: tuple[str | None, ...], sizes: tuple[int, ...], devices: tuple[int, ...]) -> CoLocation | str:
    """The co-location of pieces placed so, or what is wrong with it."""
    mesh = Mesh(sizes, devices)
    held: dict[int, list[tuple[int, ...]]] = {}
    for flat, d in enumerate(devices):
        held.setdefault(d, []).append(mesh.coord(flat))
    counts = sorted({len(v) for v in held.values()})
    if len(counts) > 1:
        return (
            f"devices hold {' or '.join(map(str, counts))} pieces; co-located pieces must be as many on "
            "every device (k of k x n pieces each)"
        )
    k = counts[0]
    axes = sorted({a for cs in held.values() for c in cs for a in range(len(sizes)) if c[a] != cs[0][a]})
    if len(axes) != 1:
        return f"a device's pieces differ along mesh axes {axes}; co-located pieces must be neighbours along one split"
    a = axes[0]
    for d, cs in held.items():
        idx = sorted(c[a] for c in cs)
        if idx != list(range(idx[0], idx[0] + k)) or idx[0] % k:
            return (
                f"device {d} holds pieces {idx} of the {sizes[a]} along mesh axis {a}; co-located pieces "
                f"must be {k} consecutive ones, e.g. devices {[x for x in sorted(held) for _ in range(k)]}"
            )
    dim = dims[a]
    if dim is None:
        return f"{k} replicas on one device; co-located pieces must split a dimension"
    inner = [b for b in range(a + 1, len(sizes)) if dims[b] == dim and sizes[b] > 1]
    if inner:
        return (
            f"mesh axis {inner[0]} splits dimension {dim!r} again inside the co-located pieces of axis {a}, "
            "so a device's pieces are not one contiguous share"
        )
    return CoLocation(a, dim, k)
