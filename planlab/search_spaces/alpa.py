"""The ``alpa`` space: Alpa's automatic search (Zheng et al., OSDI 2022, "Alpa").

The knobs pick only the shape: ``pp`` pipeline stages, each on a ``dp x tp`` logical mesh of the
``devices / pp`` devices (``tp`` chosen, ``dp`` what is left), and the ``microbatch`` size per
data-parallel replica. Everything else is solved when the plan is built:

- intra-operator pass: an integer program (:func:`planlab.search_spaces.alpa_ilp.solve_strategies`,
  scipy's HiGHS ``milp``) picks each operator's split over the mesh (replicated, or along one
  of its splittable dimensions per mesh axis, :mod:`planlab.search_spaces.alpa_costs`),
  minimising compute, resharding on every producer -> consumer edge and gradient all-reduces
  under the device's memory. As Alpa clusters operators, the program covers one representative
  transformer layer (``blocks.0``, with its edges into ``blocks.1``) and its solution is used by
  every layer; the operators before and after the layers get their own small programs, with the
  first and last layer's strategies fixed. Several solutions are kept along the layer's
  time/memory trade-off (the program re-solved under tighter memory bounds), so that a stage
  holding more layers or more micro-batches in flight can pick one that fits.
- inter-operator pass: a dynamic program (:func:`planlab.search_spaces.alpa_ilp.slice_stages`)
  cuts the layers into ``pp`` contiguous, possibly uneven, stages minimising the pipeline's
  ``sum t_s + (M - 1) max t_s``, each stage's time that of its best solution that fits memory
  with the micro-batches 1F1B keeps in flight on it.

The result is a Draft with per-operator dimensions on the ``dp`` and ``tp`` axes, per-operator
stages and the 1F1B schedule. Solutions are cached per graph, cluster, mesh and micro-batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from planlab.costmodel import CostModel
from planlab.errors import ConfigError, InfeasiblePlan
from planlab.graph.ir import Graph
from planlab.plan.materialize import precision_for
from planlab.search_spaces.alpa_costs import CostTables, Mesh2D
from planlab.search_spaces.alpa_ilp import Edge, Solution, slice_stages, solve_strategies
from planlab.search_spaces.builtin import _BLOCK, _divisors, _pow2_upto, _tp_limit
from planlab.search_spaces.registry import register_space
from planlab.search_spaces.space import Constraint, Context, Draft, Knob, Space

FRONTIER_POINTS = 5  # solutions kept along a layer's time/memory trade-off
TIGHTEN = 0.75  # each further solution must use at most this fraction of the previous one's memory


@dataclass(frozen=True)
class Layers:
    """The graph's operators before the layers, per layer, and after them."""

    pre: tuple[str, ...]
    blocks: tuple[tuple[str, ...], ...]
    post: tuple[str, ...]


_LAYERS: dict[int, tuple[Graph, Layers]] = {}


def layers_of(g: Graph) -> Layers:
    """The transformer layers (operators of module ``blocks.<i>``) and the operators around
    them; ConfigError when the layers are not alike (the representative layer would not fit)."""
    hit = _LAYERS.get(id(g))
    if hit is not None and hit[0] is g:
        return hit[1]
    pre, post, blocks = [], [], {}
    for op in g.operators:
        m = _BLOCK.search(op.module)
        if m:
            if post:
                raise ConfigError(f"space 'alpa': operator {post[0]!r} sits between transformer layers; alpa "
                                  "solves one representative layer and needs the layers back to back")
            blocks.setdefault(int(m.group(2)), []).append(op.name)
        elif blocks:
            post.append(op.name)
        else:
            pre.append(op.name)
    order = [blocks[i] for i in sorted(blocks)]
    if order:
        kinds0 = [g.op(n).kind for n in order[0]]
        for i, b in enumerate(order[1:], 1):
            if [g.op(n).kind for n in b] != kinds0 or \
                    [g.op(n).dim_sizes for n in b] != [g.op(n).dim_sizes for n in order[0]]:
                raise ConfigError(f"space 'alpa': layer {i} differs from layer 0 (operators or shapes); alpa "
                                  "solves one representative layer and needs identical layers")
    out = Layers(tuple(pre), tuple(tuple(b) for b in order), tuple(post))
    _LAYERS.clear()
    _LAYERS[id(g)] = (g, out)
    return out


@dataclass(frozen=True)
class Part:
    """One solved group of operators: strategy per operator, seconds per iteration, static and
    per-micro-batch activation bytes per device."""

    strategies: dict
    time_s: float
    static_bytes: float
    act_bytes: float

    def memory(self, inflight: int) -> float:
        return self.static_bytes + self.act_bytes * inflight


@dataclass(frozen=True)
class Point:
    """A layer solution and the pre/post solutions that go with it."""

    layer: Part
    pre: Part
    post: Part


class _Problem:
    """The integer programs of one graph on one mesh."""

    def __init__(self, g: Graph, tables: CostTables, layers: Layers) -> None:
        self.g, self.t, self.L = g, tables, layers
        self._node: dict[str, tuple] = {}

    def node(self, name: str) -> tuple:
        got = self._node.get(name)
        if got is None:
            got = self._node[name] = self.t.node_costs(self.g.op(name))
        return got

    def solve(self, names: tuple[str, ...], edges: list[tuple[str, str, str]], *, fixed_in: dict, fixed_out: dict,
              inflight: int, bound: float = math.inf, objective: str = "time",
              alias: dict | None = None) -> Part | None:
        """Strategies for ``names``: ``edges`` (producer, consumer, tensor) inside them, and edges
        to operators whose strategy is fixed (``fixed_in``: consumer outside -> strategy index;
        ``fixed_out``: producer outside -> index); ``alias`` maps a consumer to the operator
        whose strategy it takes (the next layer's operators to the representative's)."""
        alias = alias or {}
        index = {n: i for i, n in enumerate(names)}
        times, mems, statics, acts = [], [], [], []
        for n in names:
            t, st, act = self.node(n)
            times.append(t.copy())
            statics.append(st), acts.append(act)
            mems.append(st + act * inflight)
        es = []
        for p, c, tensor in edges:
            m = self.t.edge_costs(self.g.op(p), self.g.op(c), tensor)
            c = alias.get(c, c)
            if p in index and c in index:
                es.append(Edge(index[p], index[c], m))
            elif p in index and c in fixed_in:
                times[index[p]] += m[:, fixed_in[c]]
            elif c in index and p in fixed_out:
                times[index[c]] += m[fixed_out[p], :]
        cost = mems if objective == "memory" else times
        sol: Solution | None = solve_strategies(cost, es, node_memory=mems, memory_bound=bound)
        if sol is None:
            return None
        time = float(sum(times[i][s] for i, s in enumerate(sol.choice)) +
                     sum(e.cost[sol.choice[e.src], sol.choice[e.dst]] for e in es))
        strategies = {n: self.t.strategies(self.g.op(n))[s] for n, s in zip(names, sol.choice)}
        return Part(strategies, time, float(sum(statics[i][s] for i, s in enumerate(sol.choice))),
                    float(sum(acts[i][s] for i, s in enumerate(sol.choice))))

    def frontier(self, inflight: int) -> list[Point]:
        """Layer solutions from the fastest down to the smallest, each with its pre/post parts."""
        g, L = self.g, self.L
        edges = _edges(g)
        if not L.blocks:
            part = self.solve(L.pre, edges, fixed_in={}, fixed_out={}, inflight=inflight)
            empty = Part({}, 0.0, 0.0, 0.0)
            return [Point(empty, part, empty)] if part else []
        b0 = L.blocks[0]
        pos0 = {n: j for j, n in enumerate(b0)}
        inside = set(b0)
        layer_edges = [(p, c, t) for p, c, t in edges if p in inside and c in inside]
        if len(L.blocks) > 1:  # layer i feeds layer i + 1: an edge between the representative's operators
            alias = {n: b0[j] for j, n in enumerate(L.blocks[1])}
            layer_edges += [(p, c, t) for p, c, t in edges if p in inside and c in alias]
        else:
            alias = {}
        layers: list[Part] = []
        fast = self.solve(b0, layer_edges, fixed_in={}, fixed_out={}, inflight=inflight, alias=alias)
        if fast is None:
            return []
        layers.append(fast)
        small = self.solve(b0, layer_edges, fixed_in={}, fixed_out={}, inflight=inflight, objective="memory",
                           alias=alias)
        floor = small.memory(inflight) if small else 0.0
        while len(layers) < FRONTIER_POINTS - 1:
            bound = layers[-1].memory(inflight) * TIGHTEN
            if bound < floor:
                break
            nxt = self.solve(b0, layer_edges, fixed_in={}, fixed_out={}, inflight=inflight, bound=bound,
                             alias=alias)
            if nxt is None:
                break
            layers.append(nxt)
        if small is not None and small.memory(inflight) < layers[-1].memory(inflight):
            layers.append(small)
        pre_set, post_set = set(L.pre), set(L.post)
        pre_edges = [(p, c, t) for p, c, t in edges if p in pre_set]
        last = {n: j for j, n in enumerate(L.blocks[-1])}
        post_edges = [(p, c, t) for p, c, t in edges if c in post_set]
        points = []
        for lay in layers:
            idx = [self.t.strategies(g.op(n)).index(lay.strategies[n]) for n in b0]
            into = {n: idx[j] for b in L.blocks for j, n in enumerate(b)}  # every layer takes the solution
            outof = {n: idx[last[n]] for n in L.blocks[-1]}
            pre = self.solve(L.pre, pre_edges, fixed_in=into, fixed_out={}, inflight=inflight)
            post = self.solve(L.post, post_edges, fixed_in={}, fixed_out=outof, inflight=inflight)
            if pre is not None and post is not None:
                points.append(Point(lay, pre, post))
        return points


_EDGES: dict[int, tuple[Graph, list]] = {}


def _edges(g: Graph) -> list[tuple[str, str, str]]:
    """Every producer -> consumer edge of ``g`` with its tensor (cached per graph)."""
    hit = _EDGES.get(id(g))
    if hit is None or hit[0] is not g:
        out = [(g.producer[t].name, op.name, t) for op in g.operators for t in dict.fromkeys(op.inputs)
               if t in g.producer]
        _EDGES.clear()
        hit = _EDGES[id(g)] = (g, out)
    return hit[1]


@dataclass(frozen=True)
class AlpaPlan:
    """The solved plan: stage of every layer (``bounds``), the point each stage uses, the
    pipeline's estimated latency per iteration, and whether it fits the device memory."""

    bounds: tuple[int, ...]
    points: tuple[Point, ...]
    latency_s: float
    fits: bool = True  # False: no slicing fits the device memory; the least memory is kept


_SOLVED: dict[tuple, tuple[Graph, object]] = {}


def _cost_of(ctx: Context) -> CostModel:
    key = ("cost", ctx.cluster, ctx.nodes)
    hit = _SOLVED.get(key)
    if hit is None:
        hit = _SOLVED[key] = (None, CostModel.load(ctx.cluster, ctx.nodes))
    return hit[1]


def frontier(ctx: Context, dp: int, tp: int, microbatches: int, inflight: int) -> list[Point]:
    """The layer's solutions on a ``dp x tp`` mesh (cached per graph, cluster, mesh, micro-batches)."""
    key = (id(ctx.graph), ctx.cluster, ctx.nodes, dp, tp, microbatches, inflight)
    hit = _SOLVED.get(key)
    if hit is not None and hit[0] is ctx.graph:
        return hit[1]
    if len(_SOLVED) > 256:
        _SOLVED.clear()
    tables = CostTables(ctx.graph, _cost_of(ctx), precision_for(ctx.cluster), Mesh2D((dp, tp)), microbatches)
    pts = _Problem(ctx.graph, tables, layers_of(ctx.graph)).frontier(inflight)
    _SOLVED[key] = (ctx.graph, pts)
    return pts


def solve(ctx: Context, pp: int, tp: int, microbatches: int) -> AlpaPlan:
    """Alpa's two passes for ``pp`` stages of ``dp x tp`` meshes. When no slicing fits the device
    memory, the slicing with the least memory per stage (``fits`` False); InfeasiblePlan when
    no strategy exists at all."""
    dp = ctx.num_devices // (pp * tp)
    L = layers_of(ctx.graph)
    n_layers = max(1, len(L.blocks))
    cap = _cost_of(ctx).device_memory_bytes
    pts = frontier(ctx, dp, tp, microbatches, min(pp, microbatches))
    if not pts:
        raise InfeasiblePlan(f"alpa: no strategy of the operators fits a {dp} x {tp} mesh with {microbatches} "
                             "micro-batches")
    chosen: dict[tuple[int, int], int] = {}

    def stage_time_s(a: int, b: int, s: int, bound: float) -> float:
        """Per micro-batch: the fastest point that fits ``bound`` (inf: the smallest point)."""
        k, inflight = b - a, min(pp - s, microbatches)
        best, arg = (math.inf, math.inf), -1
        for i, pt in enumerate(pts):
            mem = k * pt.layer.memory(inflight) if L.blocks else 0.0
            t = k * pt.layer.time_s if L.blocks else 0.0
            if s == 0:
                mem += pt.pre.memory(inflight)
                t += pt.pre.time_s
            if s == pp - 1:
                mem += pt.post.memory(inflight)
                t += pt.post.time_s
            key = (t, mem) if math.isfinite(bound) else (mem, t)
            if mem <= bound and key < best:
                best, arg = key, i
        chosen[(k, s)] = arg
        return (best[0] if math.isfinite(bound) else best[1]) / microbatches

    try:
        sl = slice_stages(lambda a, b, s: stage_time_s(a, b, s, cap), n_layers, pp, microbatches)
        fits = True
    except InfeasiblePlan:
        # nothing fits the device: the plan with the least memory per stage, which the explorer's
        # memory bound then rejects with the simulated peak (as an out-of-memory Megatron plan)
        chosen.clear()
        sl = slice_stages(lambda a, b, s: stage_time_s(a, b, s, math.inf), n_layers, pp, microbatches)
        fits = False
    points = tuple(pts[chosen[(sl.bounds[s + 1] - sl.bounds[s], s)]] for s in range(pp))
    return AlpaPlan(sl.bounds, points, sl.latency_s, fits)


def _valid_tp(c: Context) -> tuple[int, ...]:
    return tuple(v for v in _pow2_upto(_tp_limit(c)) if c.num_devices % v == 0)


def _dp(k, c: Context) -> int:
    return c.num_devices // (k["pp"] * k["tp"])


class Alpa(Space):
    """Alpa's automatic search: ``pp`` stages (sliced by a dynamic program), each a ``dp x tp``
    mesh whose per-operator splits an integer program chooses (scipy HiGHS), 1F1B."""

    name = "alpa"
    knobs = (
        Knob.int("pp", lambda c: tuple(d for d in _divisors(c.num_devices) if d <= max(1, c.layers)),
                 "pipeline stages (layers sliced unevenly by a dynamic program)", default=1,
                 range="divisors of the device count up to the layers"),
        Knob.int("tp", _valid_tp, "second axis of each stage's logical mesh (dp = devices / (pp x tp))",
                 default=1, range="powers of 2 up to the devices of a node"),
        Knob.int("microbatch", lambda c: _pow2_upto(c.global_batch), "micro-batch size per data-parallel replica",
                 range="powers of 2 up to the global batch"),
    )
    constraints = (
        Constraint.where(lambda k, c: (c.num_devices // k["pp"]) % k["tp"] == 0,
                         lambda a, c: f"tp={a['tp']} does not divide the {c.num_devices // a['pp']} devices of a "
                                      f"stage (pp={a['pp']} stages of {c.num_devices} devices)"),
        Constraint.where(lambda k, c: c.global_batch % (_dp(k, c) * k["microbatch"]) == 0,
                         lambda a, c: f"dp={c.num_devices // (a['pp'] * a['tp'])} x microbatch={a['microbatch']} "
                                      f"does not divide the global batch {c.global_batch}"),
    )

    def apply(self, draft: Draft, values: dict) -> None:
        ctx = draft.ctx
        pp, tp = values.get("pp") or 1, values.get("tp") or 1
        dp = ctx.num_devices // (pp * tp)
        mbs = values.get("microbatch") or ctx.global_batch // dp
        m = ctx.global_batch // (dp * mbs)
        sol = solve(ctx, pp, tp, m)
        L = layers_of(ctx.graph)
        dims: dict[str, tuple] = {}
        stages: dict[str, int] = {}
        for s, pt in enumerate(sol.points):
            for i in range(sol.bounds[s], sol.bounds[s + 1]):
                if i < len(L.blocks):
                    for j, n in enumerate(L.blocks[i]):
                        dims[n] = pt.layer.strategies[L.blocks[0][j]]
                        stages[n] = s
        for n in L.pre:
            dims[n], stages[n] = sol.points[0].pre.strategies[n], 0
        for n in L.post:
            dims[n], stages[n] = sol.points[-1].post.strategies[n], pp - 1
        draft.add_axis("dp", dp, {n: d[0] for n, d in dims.items()})
        draft.add_axis("tp", tp, {n: d[1] for n, d in dims.items()})
        draft.microbatches = m
        draft.num_stages = pp
        draft.schedule = "1f1b"
        if pp > 1:
            draft.stages = stages


register_space("alpa", Alpa)
