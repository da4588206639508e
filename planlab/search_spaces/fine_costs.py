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


def _minus(a: GroupCost, b: GroupCost) -> GroupCost:
    return GroupCost(
        a.time_s - a.p2p_s - (b.time_s - b.p2p_s),
        a.sync_s - b.sync_s,
        a.static_bytes - b.static_bytes,
        a.saved_bytes - b.saved_bytes,
        max(0.0, a.work_bytes - b.work_bytes),
    )


def stage_costs(screen: Screen, d: Draft, can_offload: bool) -> StageCosts:
    """The per-layer costs of grid point ``d`` (any stages; the probe replaces them)."""
    g, L = d.ctx.graph, d.ctx.layers
    probe = dataclasses.replace(
        d,
        stages=pipeline_stages(g, L, L),
        num_stages=L,
        chunks=1,
        schedule="1f1b",
        offload_optimizer=False,
        offload_stages=(),
        layout=None,
    )
    base = group_costs(screen, probe)
    full = group_costs(screen, dataclasses.replace(probe, recompute=dict(recompute_groups(g, "full"))))
    off = group_costs(screen, probe, offload=(True,) * L) if can_offload else base
    mid = L // 2 if L > 2 else min(1, L - 1)
    a = base[mid]
    return StageCosts(
        layer_s=a.time_s - a.p2p_s,
        recompute_s=max(0.0, full[mid].time_s - a.time_s),
        sync_s=a.sync_s,
        offload_sync_s=off[mid].sync_s,
        static_bytes=a.static_bytes,
        offload_static_bytes=off[mid].static_bytes,
        saved_bytes=a.saved_bytes,
        recompute_saved_bytes=min(a.saved_bytes, full[mid].saved_bytes),
        work_bytes=a.work_bytes,
        p2p_s=a.p2p_s,
        first=_minus(base[0], a),
        last=_minus(base[-1], a),
        can_offload=can_offload,
    )
