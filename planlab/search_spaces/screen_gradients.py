"""How the explorer's screen reduces a weight's gradient, as the plan passes do: along which
mesh positions an operator's gradients stay partial sums over data-parallel replicas until they
reach its weights (:func:`deferred_positions`, after :mod:`planlab.plan.partial_grads`), and
which of a weight gradient's reduction axes ZeRO shards over and which tensor parallelism sums
first (:func:`zero_axes`, after :func:`planlab.plan.passes.gradients.zero_groups`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from planlab.search_spaces.screen_structure import Tables


def deferred_positions(t: Tables, live: list[int], cols: list) -> dict[int, tuple[int, ...]]:
    """Per operator with any, the live positions (indices into ``live``) along which its
    gradients stay partial sums over data-parallel replicas, as
    :func:`planlab.plan.partial_grads.deferred_axes` decides on a plan's meshes (here without its
    pipeline stages: one mesh for all); operators in reverse order, consumers first."""
    out: dict[int, tuple[int, ...]] = {}
    for i in range(t.n - 1, -1, -1):
        edges = t.out_edges[i]
        if not edges or t.makes_loss[i]:
            continue
        keep = []
        for j, col in enumerate(cols):
            if col[i] is not None:
                continue
            for k in edges:
                e = t.edges[k]
                c = e.consumer
                d = col[c]
                if not (j in out.get(c, ()) or (d is not None and d == t.batch_dim[c] and d not in e.need)):
                    break
            else:
                keep.append(j)
        if keep:
            out[i] = tuple(keep)
    return out


def zero_axes(red: tuple[tuple[int, bool], ...], weight_axes: set[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A weight gradient's reduction axes ``red`` (``(axis, splits the owner's batch)``) as ``(shard
    axes, tensor-parallel axes)``: ZeRO shards it over its data-parallel axes and first sums it over
    the axes that split another of its owner's dimensions along which some weight is split
    (``weight_axes``), as :func:`planlab.plan.passes.gradients.zero_groups` does; all its axes are
    shard axes when no data-parallel one remains. Without ZeRO the gradient is all-reduced over both."""
    tp = tuple(a for a, batch in red if not batch and a in weight_axes)
    shard = tuple(a for a, _ in red if a not in tp)
    if not shard:
        return tuple(a for a, _ in red), ()
    return shard, tp
