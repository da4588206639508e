"""The fine-grained space ``fine``: per pipeline stage its own layer count, its own number of
recomputed layers and its own choice of offloading the optimizer, chosen by an integer program.

Mist (Zhu et al., EuroSys'25) and Aceso (Liu et al., EuroSys'24) beat Megatron-LM's grid by
tuning per stage what the grid fixes for all. Composed with the grid (``megatron*fine``), for
each point of it (tp, pp, dp, micro-batch, schedule, ZeRO, the base recomputation) this space
reads per-layer costs from the screen (planlab/search_spaces/fine_costs.py) and solves, with
``scipy.optimize.milp`` (HiGHS), for ``n_s`` layers, ``k_s`` of them recomputed in full (the
stage's first ones: Megatron-LM's block method per stage) and ``o_s`` (ZeRO-Offload) per stage:

    minimize   (M - 1) T + sum_s t_s + S           (1F1B's M max_s t_s + the bubble, and the sync)
    t_s = e_s + n_s l + k_s r                     T >= t_s,  S >= sync_s(n_s, o_s)
    static_s + f_s activations_s + work_s <= the device's memory, f_s = micro-batches in flight
    sum_s n_s = layers,  1 <= n_s,  0 <= k_s <= n_s

(``e_s``: the first stage's embedding and the last stage's output layer and loss). The plan the
solution describes is then simulated like any other: the simulator judges, not the program.
"""

from __future__ import annotations

import functools

import numpy as np

from planlab.costmodel import CostModel
from planlab.errors import ConfigError
from planlab.plan.materialize import precision_for
from planlab.search_spaces.builtin import pipeline_stages, recompute_groups
from planlab.search_spaces.fine_costs import StageCosts, stage_costs
from planlab.search_spaces.registry import register_space
from planlab.search_spaces.screen import GroupCost, Screen
from planlab.search_spaces.space import Constraint, Context, Draft, Knob, Space
from planlab.search_spaces.stages import StageLayout, layout_problem

FINE_SCHEDULES = ("1f1b", "gpipe")
TIE = 1e-3  # the weight of the stages' own sync in the objective, which breaks ties


def in_flight(schedule: str, stage: int, stages: int, m: int) -> int:
    """Micro-batches whose activations ``stage`` keeps at its peak (1F1B: ``stages - stage``; GPipe: all)."""
    return m if schedule == "gpipe" else min(m, stages - stage)


def solve_layout(
    c: StageCosts, layers: int, stages: int, m: int, cap_bytes: float, schedule: str = "1f1b"
) -> StageLayout | None:
    """The :class:`StageLayout` minimizing the pipeline's time under ``cap_bytes`` per device
    (HiGHS), or None when no layout fits."""
    from scipy.optimize import Bounds, LinearConstraint, milp  # on first use: scipy takes a second to import

    G = stages
    n, k, o, z, T, S = 0, G, 2 * G, 3 * G, 4 * G, 4 * G + 1
    nv = 4 * G + 2
    rows, lo, hi = [], [], []

    def row(coefs: dict[int, float], low: float, high: float) -> None:
        r = np.zeros(nv)
        for i, v in coefs.items():
            r[i] += v
        rows.append(r)
        lo.append(low)
        hi.append(high)

    for s in range(G):
        ex = _extras(c, s, G)
        p2p = c.p2p_s if s else 0.0
        f = in_flight(schedule, s, G, m)
        row({T: 1.0, n + s: -c.layer_s, k + s: -c.recompute_s}, ex.time_s + p2p, np.inf)
        row({S: 1.0, n + s: -c.sync_s, z + s: c.sync_s - c.offload_sync_s}, ex.sync_s, np.inf)
        room = cap_bytes - ex.static_bytes - f * ex.saved_bytes - max(c.work_bytes, c.work_bytes + ex.work_bytes)
        mem = {
            n + s: c.static_bytes + f * c.saved_bytes,
            k + s: f * (c.recompute_saved_bytes - c.saved_bytes),
            z + s: c.offload_static_bytes - c.static_bytes,
        }
        row({i: v / cap_bytes for i, v in mem.items()}, -np.inf, room / cap_bytes)
        row({k + s: 1.0, n + s: -1.0}, -np.inf, 0.0)
        # z = n o (offloaded layers): z <= L o, z <= n, z >= n - L (1 - o)
        row({z + s: 1.0, o + s: -layers}, -np.inf, 0.0)
        row({z + s: 1.0, n + s: -1.0}, -np.inf, 0.0)
        row({z + s: 1.0, n + s: -1.0, o + s: -layers}, -layers, np.inf)
    row({n + s: 1.0 for s in range(G)}, layers, layers)
    cost = np.zeros(nv)
    cost[T], cost[S] = m - 1, 1.0
    cost[n : n + G], cost[k : k + G] = c.layer_s, c.recompute_s
    # ties (the bottleneck's sync hides the others'): offload no stage more than the memory asks
    cost[n : n + G] += TIE * c.sync_s
    cost[z : z + G] = TIE * (c.offload_sync_s - c.sync_s)
    upper = np.array([layers] * (2 * G) + [1 if c.can_offload else 0] * G + [layers] * G + [np.inf, np.inf])
    lower = np.array([1] * G + [0] * (3 * G) + [0, 0])
    integ = np.array([1] * (4 * G) + [0, 0])
    res = milp(
        cost, constraints=LinearConstraint(np.array(rows), lo, hi), integrality=integ, bounds=Bounds(lower, upper)
    )
    if res.x is None:
        return None
    x = np.round(res.x).astype(int)
    return StageLayout(
        layers=tuple(int(v) for v in x[n : n + G]),
        recompute=tuple(int(v) for v in x[k : k + G]),
        offload=tuple(bool(v) for v in x[o : o + G]),
    )


def _extras(c: StageCosts, s: int, G: int) -> GroupCost:
    """Stage ``s``'s extras: the first stage's, the last's, or both's on one stage."""
    parts = ([c.first] if s == 0 else []) + ([c.last] if s == G - 1 else [])
    return GroupCost(
        *(sum(getattr(p, f) for p in parts) for f in ("time_s", "sync_s", "static_bytes", "saved_bytes", "work_bytes"))
    )


def apply_layout(draft: Draft, layout: StageLayout) -> None:
    """Put ``layout`` on ``draft``: the stages' layer counts, each stage's first ``recompute[s]``
    layers recomputed in full (the others keep the draft's recomputation), per-stage offloading.
    ConfigError in one line if the layout does not fit the draft's layers and stages."""
    ctx = draft.ctx
    G, L = draft.num_stages, ctx.layers
    problem = layout_problem(layout, L, G)
    if problem:
        raise ConfigError(f"fine: {problem}")
    if G > 1:
        draft.stages = pipeline_stages(ctx.graph, G, L, layout.layers)
    starts = np.cumsum((0,) + layout.layers)
    redo = {int(starts[s]) + i + 1 for s in range(G) for i in range(layout.recomputed(s))}  # groups: layer + 1
    if redo:
        draft.recompute = dict(draft.recompute)
        draft.recompute.update({op: grp for op, grp in recompute_groups(ctx.graph, "full").items() if grp in redo})
    if any(layout.offloads(s) for s in range(G)):
        draft.offload_optimizer = True
        draft.offload_stages = tuple(s for s in range(G) if layout.offloads(s))
    draft.layout = layout


@functools.lru_cache(maxsize=16)
def _cost_model(cluster: str, nodes: int) -> CostModel:
    return CostModel.load(cluster, nodes)


def _has_host(cluster: str, nodes: int) -> bool:
    return _cost_model(cluster, nodes).cluster.node.host is not None


def _screen(ctx: Context) -> Screen:
    """One screen per graph and cluster (kept in the graph's memo)."""
    key = ("fine_screen", ctx.cluster, ctx.nodes)
    return ctx.graph.memo(
        key, lambda: Screen(ctx.graph, _cost_model(ctx.cluster, ctx.nodes), precision_for(ctx.cluster))
    )


def choose_layout(draft: Draft, offload: bool) -> StageLayout | None:
    """The layout the integer program picks for ``draft``'s grid point (None: none fits)."""
    ctx = draft.ctx
    cost = _cost_model(ctx.cluster, ctx.nodes)
    costs = stage_costs(_screen(ctx), draft, offload)
    return solve_layout(
        costs, ctx.layers, draft.num_stages, draft.microbatches, cost.device_memory_bytes, draft.schedule
    )


def _unset(name: str, allowed: tuple) -> Constraint:
    return Constraint(
        lambda a, c: a.get(name) in (None,) + allowed,
        lambda a, c: (
            f"the fine space chooses per-stage layers and recomputation itself: {name}={a.get(name)!r} "
            f"does not go with it; choose {' or '.join(map(repr, allowed))}"
        ),
    )


class FineStages(Space):
    """Per stage, its layers, recomputed layers and offloading, by an integer program over the
    screen's per-layer costs (module docstring); compose it with the grid: ``megatron*fine``."""

    name = "fine"
    order = 5  # after the stages, the mesh axes and the recomputation it refines
    knobs = (Knob.bool("fine_offload", "let the integer program offload the optimizer per stage (ZeRO-Offload)"),)
    constraints = (
        _unset("schedule", FINE_SCHEDULES),
        _unset("virtual_stages", (1,)),
        _unset("recompute", ("none", "selective")),
        _unset("offload_optimizer", (False,)),
        Constraint(
            lambda a, c: not a.get("fine_offload") or _has_host(c.cluster, c.nodes),
            lambda a, c: (
                f"fine_offload=True on cluster {c.cluster!r}, which gives no host side; set fine_offload=false"
            ),
        ),
    )

    def apply(self, draft: Draft, values: dict) -> None:
        if draft.chunks != 1 or draft.mirror or draft.spread or draft.recycles > 1:
            return
        layout = choose_layout(draft, bool(values.get("fine_offload")))
        if layout is not None:  # none fits: the grid's plan stays, out of memory
            apply_layout(draft, layout)


register_space("fine", FineStages)
