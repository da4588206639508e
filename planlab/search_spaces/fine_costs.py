"""Per-layer costs for the fine-grained space, read from the screen (planlab/search_spaces/screen.py).

For one point of the grid (its mesh axes, micro-batches, ZeRO stage and recomputation), the
screen prices a probe draft that puts every layer in a pipeline stage of its own: a middle
layer's group gives one layer's time per micro-batch, gradient reduction and optimizer step,
static memory and saved activations; the first and the last groups, minus one layer, give the
first stage's extras (the embedding) and the last stage's (the output layer and the loss). The
probe is priced three times: as the grid point recomputes, with every layer recomputed in full,
and with the optimizer offloaded (when the cluster has a host side). Layers of one model are
alike (a transformer's blocks), which is what makes per-layer costs additive per stage.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from planlab.search_spaces.builtin import pipeline_stages, recompute_groups
from planlab.search_spaces.screen import GroupCost, Screen, group_costs
from planlab.search_spaces.space import Draft


@dataclass(frozen=True)
class StageCosts:
    """Additive costs of a stage of ``n`` layers, ``k`` of them recomputed, ``o`` offloaded
    (seconds per micro-batch, or per iteration for ``sync``; bytes per device)."""

    layer_s: float  # one layer's forward, backward and collectives per micro-batch
    recompute_s: float  # what recomputing one layer adds to its backward
    sync_s: float  # one layer's exposed gradient reduction and optimizer step
    offload_sync_s: float  # the same with its optimizer offloaded (ZeRO-Offload); = sync_s without a host
    static_bytes: float  # one layer's weights, gradients and optimizer states
    offload_static_bytes: float  # the same offloaded
    saved_bytes: float  # activations one layer keeps per micro-batch
    recompute_saved_bytes: float  # the same when it recomputes (its input only)
    work_bytes: float  # the largest working set of a layer
    p2p_s: float  # a stage's transfers per micro-batch (every stage but the first)
    first: GroupCost  # the first stage's extras (embedding), as differences from a layer
    last: GroupCost  # the last stage's extras (output layer, loss)
    can_offload: bool
    # what a device holds once whatever its layers (ZeRO-3: the unit it computes, gathered; its last
    # unit's reduce-scatter), so that a stage of n layers is unit + n x the per-layer figures above
    unit_static_bytes: float = 0.0
    unit_sync_s: float = 0.0
    # work_bytes when the stage recomputes a layer in full: its forward, run again, keeps its activations
    recompute_work_bytes: float = 0.0
    # the forward's share of layer_s and of the extras' time (the rest, and recompute_s, is the backward's):
    # what the schedule walk (fine_walk.py) needs to order a stage's forwards and backwards
    forward_share: float = 1 / 3
    # a stage's once-only time per micro-batch, whatever its layers (ZeRO-3: its first unit's gathers,
    # which no computation ahead of them hides; the next units' are prefetched behind the layer before)
    unit_s: float = 0.0


def _minus(a: GroupCost, b: GroupCost) -> GroupCost:
    return GroupCost(
        a.time_s - a.p2p_s - (b.time_s - b.p2p_s),
        a.sync_s - b.sync_s,
        a.static_bytes - b.static_bytes,
        a.saved_bytes - b.saved_bytes,
        max(0.0, a.work_bytes - b.work_bytes),
    )


def probe_key(d: Draft) -> tuple:
    """What the probe of grid point ``d`` is priced from, exactly: the mesh axes and each operator's
    split along them, ring attention, the recomputation, co-sharding, offloaded activations, the
    micro-batch count (with the axes, the micro-batch size), the ZeRO stage and the device order of
    a stage. Not the stages, chunks, schedule or optimizer offloading, which the probe replaces:
    grid points that differ only there share their probes (kept in the graph's memo)."""
    return (
        tuple(d.axes),
        tuple(d.op_dims()),
        d.ring,
        tuple(d.recompute.items()),
        tuple(d.colocate.items()),
        tuple(d.offload_acts.items()),
        d.microbatches,
        d.zero,
        d.stage_order,
    )


def stage_costs(screen: Screen, d: Draft, can_offload: bool) -> StageCosts:
    """The per-layer costs of grid point ``d`` (any stages; the probe replaces them). With 5 layers
    or more the probe's middle group holds two layers: its difference from a one-layer group is a
    layer's static memory and sync, and what is left of the one-layer group the device's once-only
    part (ZeRO-3's gathered unit and last reduce-scatter; 0 where those figures add up per layer);
    so is its time, less the once-only time a stage pays whatever its layers (``unit_s``: ZeRO-3's first
    unit's gathers, which a one-layer group exposes per layer and a stage of many layers once).
    Only the groups read here are priced (the first, the middle one or two and the last), each
    probe once per graph, cluster and :func:`probe_key` (the graph's memo): as the grid point
    recomputes, with every layer recomputed in full, and with the optimizer offloaded."""
    ctx = d.ctx
    g, L = ctx.graph, ctx.layers
    pair = (L - 1) // 2 if L >= 5 else None  # the probe group with two layers
    counts = tuple(2 if i == pair else 1 for i in range(L - 1)) if pair is not None else (1,) * L
    probe = dataclasses.replace(
        d,
        stages=pipeline_stages(g, len(counts), L, counts),
        num_stages=len(counts),
        chunks=1,
        schedule="1f1b",
        offload_optimizer=False,
        offload_stages=(),
        layout=None,
    )
    mid = pair - 1 if pair is not None else (L // 2 if L > 2 else min(1, L - 1))
    read = tuple(dict.fromkeys((0, mid) + ((pair,) if pair is not None else ()) + (len(counts) - 1,)))
    key = ("fine_probe", ctx.cluster, ctx.nodes, ctx.profile, ctx.software, ctx.precision, probe_key(d))

    def priced(variant: str) -> dict[int, GroupCost]:
        def compute() -> dict[int, GroupCost]:
            if variant == "full":
                got = group_costs(
                    screen, dataclasses.replace(probe, recompute=dict(recompute_groups(g, "full"))), only=read
                )
            else:
                got = group_costs(screen, probe, offload=(variant == "offload",) * len(counts), only=read)
            return dict(zip(read, got))

        return g.memo(key + (variant,), compute)

    base, full = priced("base"), priced("full")
    off = priced("offload") if can_offload else base
    a = base[mid]

    def per_layer(costs: dict[int, GroupCost], field: str) -> tuple[float, float]:
        """(a layer's, the device's once-only) part of ``field``."""
        one = getattr(costs[mid], field)
        if pair is None:
            return one, 0.0
        layer = getattr(costs[pair], field) - one
        return layer, max(0.0, one - layer)

    static, unit_static = per_layer(base, "static_bytes")
    sync, unit_sync = per_layer(base, "sync_s")
    # a layer's time: what the second layer of the two-layer group adds, never more than a one-layer
    # group's (screen.Screen._price: ZeRO-3 exposes a group's first unit's gathers once, not once a layer)
    busy = {i: base[i].time_s - base[i].p2p_s for i in base}
    layer_s = min(busy[mid], busy[pair] - busy[mid]) if pair is not None else busy[mid]
    return StageCosts(
        layer_s=layer_s,
        recompute_s=max(0.0, full[mid].time_s - a.time_s),
        sync_s=sync,
        offload_sync_s=per_layer(off, "sync_s")[0],
        static_bytes=static,
        offload_static_bytes=per_layer(off, "static_bytes")[0],
        saved_bytes=a.saved_bytes,
        recompute_saved_bytes=min(a.saved_bytes, full[mid].saved_bytes),
        work_bytes=a.work_bytes,
        p2p_s=a.p2p_s,
        first=_minus(base[0], a),
        last=_minus(base[len(counts) - 1], a),
        can_offload=can_offload,
        unit_static_bytes=unit_static,
        unit_sync_s=unit_sync,
        recompute_work_bytes=full[mid].work_bytes,
        forward_share=a.forward_s / (a.time_s - a.p2p_s) if a.time_s > a.p2p_s else 1 / 3,
        unit_s=busy[mid] - layer_s,
    )
