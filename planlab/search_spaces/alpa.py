"""The ``alpa`` space: Alpa's automatic search (Zheng et al., OSDI 2022, "Alpa").

The knobs pick only the shape: ``pp`` pipeline stages, each on a ``dp x tp`` logical mesh of the
``devices / pp`` devices (``tp`` chosen, ``dp`` what is left), and the ``microbatch`` size per
data-parallel replica. Everything else is solved when the plan is built:

- intra-operator pass: an integer program (:func:`planlab.search_spaces.alpa_ilp.solve_strategies`,
  scipy's HiGHS ``milp``) picks each operator's split over the mesh (replicated, or along one
  of its splittable dimensions per mesh axis, :mod:`planlab.search_spaces.alpa_costs`),
  minimising compute, resharding on every producer -> consumer edge and gradient all-reduces
  under the device's memory. As Alpa clusters operators, the program covers one representative
  per kind of layer (``blocks.<i>`` with the same operators and shapes, with its edges into the
  next layer when alike) and every layer of that kind uses its solution; the operators before,
  between and after the layers get their own small programs, their neighbouring layers'
  strategies fixed. Several solutions are kept along each layer's time/memory trade-off (the
  program re-solved under tighter memory bounds), so that a stage holding more layers or more
  micro-batches in flight can pick one that fits.
- inter-operator pass: a dynamic program (:func:`planlab.search_spaces.alpa_ilp.slice_stages`)
  cuts the layers into ``pp`` contiguous, possibly uneven, stages minimising the pipeline's
  ``sum t_s + (M - 1) max t_s``, each stage's time that of its best solution that fits memory
  with the micro-batches 1F1B keeps in flight on it.

The result is a Draft with per-operator dimensions on the ``dp`` and ``tp`` axes, per-operator
stages and the 1F1B schedule. Solutions are cached per graph, cluster, mesh and micro-batches.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import numpy as np

from planlab.costmodel import CostModel
from planlab.errors import ConfigError, InfeasiblePlan
from planlab.graph.ir import Graph
from planlab.plan.materialize import precision_for
from planlab.search_spaces.alpa_costs import CostTables, Mesh2D
from planlab.search_spaces.alpa_ilp import Edge, Solution, slice_stages, solve_strategies
from planlab.search_spaces.builtin import LAYER_MODULE, divisors, powers_of_two_upto, tp_limit
from planlab.search_spaces.registry import register_space
from planlab.search_spaces.space import Constraint, Context, Draft, Knob, Space

FRONTIER_POINTS = 5  # solutions kept along a layer's time/memory trade-off
TIGHTEN = 0.75  # each further solution must use at most this fraction of the previous one's memory


@dataclass(frozen=True)
class Layers:
    """The graph's operators in order: those before the layers (``pre``), per layer its operators
    (``blocks``) and the operators between it and the previous layer (``glue``, e.g. Swin's patch
    merging), those after the layers (``post``); ``kind[i]``: the first layer alike to layer ``i``
    (same operators and shapes), whose solution layer ``i`` takes."""

    pre: tuple[str, ...]
    blocks: tuple[tuple[str, ...], ...]
    glue: tuple[tuple[str, ...], ...]
    post: tuple[str, ...]
    kind: tuple[int, ...]

    @property
    def kinds(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys(self.kind))


def _likeness(g: Graph, names: list[str]) -> tuple:
    return tuple((g.op(n).kind, str(g.op(n).signature), tuple(sorted(g.op(n).dim_sizes.items()))) for n in names)


def layers_of(g: Graph) -> Layers:
    """The layers (operators of module ``blocks.<i>``), the operators around and between them, and
    which layers are alike (cached per graph); ConfigError when a layer's operators are not
    contiguous (a layer run twice, or interleaved with another)."""
    return g.memo(("layers_of",), lambda: _layers_of(g))


def _layers_of(g: Graph) -> Layers:
    pre: list[str] = []
    blocks: list[list[str]] = []
    glue: list[tuple[str, ...]] = []
    pending: list[str] = []
    index: list[int] = []
    for op in g.operators:
        m = LAYER_MODULE.search(op.module)
        if not m:
            (pending if blocks else pre).append(op.name)
            continue
        i = int(m.group(2))
        if not blocks or i != index[-1]:
            if i in index:
                raise ConfigError(
                    f"space 'alpa': operator {op.name!r} of layer {i} comes after other operators "
                    f"(layer {index[-1]} or operators outside the layers); alpa needs each layer's "
                    "operators back to back, so it cannot plan a model that runs its layers more "
                    "than once (such as a recycling Evoformer, recycles > 1)"
                )
            blocks.append([])
            index.append(i)
            glue.append(tuple(pending) if len(blocks) > 1 else ())
            pending = []
        elif pending:
            raise ConfigError(
                f"space 'alpa': operator {pending[0]!r} sits inside layer {i}; alpa needs each "
                "layer's operators back to back"
            )
        blocks[-1].append(op.name)
    first: dict[tuple, int] = {}
    kind = tuple(first.setdefault(_likeness(g, b), k) for k, b in enumerate(blocks))
    out = Layers(tuple(pre), tuple(tuple(b) for b in blocks), tuple(glue), tuple(pending), kind)
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


EMPTY = Part({}, 0.0, 0.0, 0.0)


@dataclass(frozen=True)
class Solved:
    """Per kind of layer (by its first layer), its solutions from the fastest to the smallest;
    per solution index ``p`` of the layer that follows them, the solutions of the operators
    before the layers (``pre[p]``), between layer ``i - 1`` and ``i`` (``glue[i][p]``) and after
    the layers (``post[p]``, by the last layer's solution)."""

    layers: dict[int, tuple[Part, ...]]
    pre: tuple[Part, ...]
    glue: tuple[tuple[Part, ...], ...]
    post: tuple[Part, ...]


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

    def solve(
        self,
        names: tuple[str, ...],
        edges: list[tuple[str, str, str]],
        *,
        fixed: dict | None = None,
        inflight: int,
        bound: float = math.inf,
        objective: str = "time",
        alias: dict | None = None,
    ) -> Part | None:
        """Strategies for ``names``: ``edges`` (producer, consumer, tensor) inside them, and edges
        to operators whose strategy is ``fixed`` (operator -> strategy index); ``alias`` maps a
        consumer to the operator whose strategy it takes (the next layer's operators to the
        representative's)."""
        alias, fixed = alias or {}, fixed or {}
        if not names:
            return EMPTY
        index = {n: i for i, n in enumerate(names)}
        times, mems, statics, acts = [], [], [], []
        for n in names:
            t, st, act = self.node(n)
            times.append(t.copy())
            statics.append(st), acts.append(act)
            mems.append(st + act * inflight)
        es = []
        for p, c, tensor in edges:
            if not ((p in index or p in fixed) and (alias.get(c, c) in index or c in fixed)):
                continue
            m = self.t.edge_costs(self.g.op(p), self.g.op(c), tensor)
            c = alias.get(c, c)
            if p in index and c in index:
                es.append(Edge(index[p], index[c], m))
            elif p in index:
                times[index[p]] += m[:, fixed[c]]
            elif c in index:
                times[index[c]] += m[fixed[p], :]
        cost = mems if objective == "memory" else times
        sol: Solution | None = solve_strategies(cost, es, node_memory=mems, memory_bound=bound)
        if sol is None:
            return None
        time = float(
            sum(times[i][s] for i, s in enumerate(sol.choice))
            + sum(e.cost[sol.choice[e.src], sol.choice[e.dst]] for e in es)
        )
        strategies = {n: self.t.strategies(self.g.op(n))[s] for n, s in zip(names, sol.choice)}
        return Part(
            strategies,
            time,
            float(sum(statics[i][s] for i, s in enumerate(sol.choice))),
            float(sum(acts[i][s] for i, s in enumerate(sol.choice))),
        )

    def layer_frontier(self, k: int, inflight: int) -> tuple[Part, ...]:
        """Layer ``k``'s solutions from the fastest down to the smallest (it stands for every
        layer alike: with its edges into the next layer when that one is alike too)."""
        g, L = self.g, self.L
        edges = _edges(g)
        b0 = L.blocks[k]
        inside = set(b0)
        layer_edges = [(p, c, t) for p, c, t in edges if p in inside and c in inside]
        alias = {}
        if k + 1 < len(L.blocks) and L.kind[k + 1] == L.kind[k] and not L.glue[k + 1]:
            alias = {n: b0[j] for j, n in enumerate(L.blocks[k + 1])}
            layer_edges += [(p, c, t) for p, c, t in edges if p in inside and c in alias]
        fast = self.solve(b0, layer_edges, inflight=inflight, alias=alias)
        if fast is None:
            return ()
        layers = [fast]
        small = self.solve(b0, layer_edges, inflight=inflight, objective="memory", alias=alias)
        floor = small.memory(inflight) if small else 0.0
        while len(layers) < FRONTIER_POINTS - 1:
            bound = layers[-1].memory(inflight) * TIGHTEN
            if bound < floor:
                break
            nxt = self.solve(b0, layer_edges, inflight=inflight, bound=bound, alias=alias)
            if nxt is None:
                break
            layers.append(nxt)
        if small is not None and small.memory(inflight) < layers[-1].memory(inflight):
            layers.append(small)
        return tuple(layers)

    def _index(self, layer: int, part: Part) -> dict:
        g, L = self.g, self.L
        rep = L.blocks[L.kind[layer]]
        return {n: self.t.strategies(g.op(n)).index(part.strategies[r]) for n, r in zip(L.blocks[layer], rep)}

    def solve_all(self, inflight: int) -> Solved | None:
        g, L = self.g, self.L
        edges = _edges(g)
        if not L.blocks:
            part = self.solve(L.pre, edges, inflight=inflight)
            return Solved({}, (part,), (), (EMPTY,)) if part else None
        layers = {}
        for k in L.kinds:
            layers[k] = self.layer_frontier(k, inflight)
            if not layers[k]:
                return None
        last = len(L.blocks) - 1

        def around(names: tuple[str, ...], before: int | None, after: int | None) -> tuple[Part, ...] | None:
            """Solutions of ``names`` per solution index of layer ``after`` (or ``before``), the
            other neighbour at its fastest solution."""
            if not names:
                return (EMPTY,)
            own = set(names)
            es = [(p, c, t) for p, c, t in edges if p in own or c in own]
            varying = after if after is not None else before
            out = []
            for part in layers[L.kind[varying]]:
                fixed = dict(self._index(varying, part))
                other = before if after is not None else None
                if other is not None:
                    fixed.update(self._index(other, layers[L.kind[other]][0]))
                got = self.solve(names, es, fixed=fixed, inflight=inflight)
                if got is None:
                    return None
                out.append(got)
            return tuple(out)

        pre = around(L.pre, None, 0)
        post = around(L.post, last, None)
        glue = [(EMPTY,)] + [around(L.glue[i], i - 1, i) for i in range(1, len(L.blocks))]
        if pre is None or post is None or any(x is None for x in glue):
            return None
        return Solved(layers, pre, tuple(glue), post)


def _edges(g: Graph) -> list[tuple[str, str, str]]:
    """Every producer -> consumer edge of ``g`` with its tensor (cached per graph)."""
    return g.memo(
        ("alpa_edges",),
        lambda: [
            (g.producer[t].name, op.name, t) for op in g.operators for t in dict.fromkeys(op.inputs) if t in g.producer
        ],
    )


@dataclass(frozen=True)
class AlpaPlan:
    """The solved plan: stage of every layer (``bounds``), the solution index of every layer
    (``choice``), the pipeline's estimated latency per iteration, and whether it fits the device
    memory."""

    bounds: tuple[int, ...]
    choice: tuple[int, ...]
    solved: Solved
    latency_s: float
    fits: bool = True  # False: no slicing fits the device memory; the least memory is kept


@functools.lru_cache(maxsize=16)
def _cost_of(cluster, nodes) -> CostModel:
    """The cost model of a cluster (cached on its frozen name and node count)."""
    return CostModel.load(cluster, nodes)


def solutions(ctx: Context, dp: int, tp: int, microbatches: int, inflight: int) -> Solved | None:
    """The solutions on a ``dp x tp`` mesh (cached per graph, cluster, mesh, micro-batches)."""

    def compute() -> Solved | None:
        tables = CostTables(
            ctx.graph, _cost_of(ctx.cluster, ctx.nodes), precision_for(ctx.cluster), Mesh2D((dp, tp)), microbatches
        )
        return _Problem(ctx.graph, tables, layers_of(ctx.graph)).solve_all(inflight)

    key = ("alpa_solutions", ctx.cluster, ctx.nodes, dp, tp, microbatches, inflight)
    return ctx.graph.memo(key, compute)


MAX_COMBINATIONS = 256  # per stage, solution indices tried per kind of layer (more: each kind's alone)


def solve(ctx: Context, pp: int, tp: int, microbatches: int) -> AlpaPlan:
    """Alpa's two passes for ``pp`` stages of ``dp x tp`` meshes. When no slicing fits the device
    memory, the slicing with the least memory per stage (``fits`` False); InfeasiblePlan when
    no strategy exists at all."""
    dp = ctx.num_devices // (pp * tp)
    L = layers_of(ctx.graph)
    n = max(1, len(L.blocks))
    cap = _cost_of(ctx.cluster, ctx.nodes).device_memory_bytes
    sol = solutions(ctx, dp, tp, microbatches, min(pp, microbatches))
    if sol is None:
        raise InfeasiblePlan(
            f"alpa: no strategy of the operators fits a {dp} x {tp} mesh with {microbatches} micro-batches"
        )
    kinds = L.kinds if L.blocks else (0,)
    npts = {c: len(sol.layers[c]) if L.blocks else 1 for c in kinds}
    layer_kind = L.kind if L.blocks else (0,)
    # prefix sums per kind and solution: time, static and activation bytes of layers [0, i) of that kind
    pref = {}
    for c in kinds:
        for p in range(npts[c]):
            arr = np.zeros((3, n + 1))
            for i in range(n):
                arr[:, i + 1] = arr[:, i]
                if layer_kind[i] == c and L.blocks:
                    for part in (sol.layers[c][p], sol.glue[i][min(p, len(sol.glue[i]) - 1)]):
                        arr[:, i + 1] += (part.time_s, part.static_bytes, part.act_bytes)
            pref[c, p] = arr
    chosen: dict[tuple[int, int, int], tuple] = {}

    def stage_time_s(a: int, b: int, s: int, bound: float) -> float:
        """Per micro-batch: the fastest solutions that fit ``bound`` (inf: the smallest)."""
        inflight = min(pp - s, microbatches)
        present = tuple(dict.fromkeys(layer_kind[a:b]))
        combos = itertools.product(*(range(npts[c]) for c in present))
        if math.prod(npts[c] for c in present) > MAX_COMBINATIONS:
            combos = [tuple(p for _ in present) for p in range(max(npts.values()))]
        best, arg = (math.inf, math.inf), None
        for combo in combos:
            pick = dict(zip(present, combo))
            t = mem = 0.0
            for c, p in pick.items():
                p = min(p, npts[c] - 1)
                d = pref[c, p][:, b] - pref[c, p][:, a]
                t += d[0]
                mem += d[1] + d[2] * inflight
            if s == 0:
                part = sol.pre[min(pick[layer_kind[0]], len(sol.pre) - 1)]
                t, mem = t + part.time_s, mem + part.memory(inflight)
            if s == pp - 1:
                part = sol.post[min(pick[layer_kind[-1]], len(sol.post) - 1)]
                t, mem = t + part.time_s, mem + part.memory(inflight)
            key = (t, mem) if math.isfinite(bound) else (mem, t)
            if mem <= bound and key < best:
                best, arg = key, pick
        chosen[(a, b, s)] = arg
        return (best[0] if math.isfinite(bound) else best[1]) / microbatches

    try:
        sl = slice_stages(lambda a, b, s: stage_time_s(a, b, s, cap), n, pp, microbatches)
        fits = True
    except InfeasiblePlan:
        # nothing fits the device: the plan with the least memory per stage, which the explorer's
        # memory bound then rejects with the simulated peak (as an out-of-memory Megatron plan)
        chosen.clear()
        sl = slice_stages(lambda a, b, s: stage_time_s(a, b, s, math.inf), n, pp, microbatches)
        fits = False
    choice = []
    for s in range(pp):
        a, b = sl.bounds[s], sl.bounds[s + 1]
        pick = chosen[(a, b, s)]
        choice += [min(pick[layer_kind[i]], npts[layer_kind[i]] - 1) for i in range(a, b)]
    return AlpaPlan(sl.bounds, tuple(choice), sol, sl.latency_s, fits)


def _valid_tp(c: Context) -> tuple[int, ...]:
    return tuple(v for v in powers_of_two_upto(tp_limit(c)) if c.num_devices % v == 0)


def _dp(k, c: Context) -> int:
    return c.num_devices // (k["pp"] * k["tp"])


class Alpa(Space):
    """Alpa's automatic search: ``pp`` stages (sliced by a dynamic program), each a ``dp x tp``
    mesh whose per-operator splits an integer program chooses (scipy HiGHS), 1F1B."""

    name = "alpa"
    knobs = (
        Knob.int(
            "pp",
            lambda c: tuple(d for d in divisors(c.num_devices) if d <= max(1, c.layers)),
            "pipeline stages (layers sliced unevenly by a dynamic program)",
            default=1,
            range="divisors of the device count up to the layers",
        ),
        Knob.int(
            "tp",
            _valid_tp,
            "second axis of each stage's logical mesh (dp = devices / (pp x tp))",
            default=1,
            range="powers of 2 up to the devices of a node",
        ),
        Knob.int(
            "microbatch",
            lambda c: powers_of_two_upto(c.global_batch),
            "micro-batch size per data-parallel replica",
            range="powers of 2 up to the global batch",
        ),
    )
    constraints = (
        Constraint.where(
            lambda k, c: (c.num_devices // k["pp"]) % k["tp"] == 0,
            lambda a, c: (
                f"tp={a['tp']} does not divide the {c.num_devices // a['pp']} devices of a "
                f"stage (pp={a['pp']} stages of {c.num_devices} devices)"
            ),
        ),
        # a one-axis mesh already tries every dimension on its axis: tp = the stage's devices (dp = 1)
        # with a micro-batch that tp divides repeats tp = 1 (dp = the stage's devices) with microbatch / tp
        Constraint.where(
            lambda k, c: k["tp"] == 1 or _dp(k, c) > 1 or k["microbatch"] % k["tp"] != 0,
            lambda a, c: (
                f"tp={a['tp']} leaves dp=1, a one-axis mesh: with microbatch={a['microbatch']} "
                f"it is the plan of tp=1, microbatch={a['microbatch'] // a['tp']}"
            ),
        ),
        Constraint.where(
            lambda k, c: c.global_batch % (_dp(k, c) * k["microbatch"]) == 0,
            lambda a, c: (
                f"dp={c.num_devices // (a['pp'] * a['tp'])} x microbatch={a['microbatch']} "
                f"does not divide the global batch {c.global_batch}"
            ),
        ),
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
        for s in range(pp):
            for i in range(sol.bounds[s], min(sol.bounds[s + 1], len(L.blocks))):
                p = sol.choice[i]
                rep = L.blocks[L.kind[i]]
                part = sol.solved.layers[L.kind[i]][p]
                for n, r in zip(L.blocks[i], rep):
                    dims[n], stages[n] = part.strategies[r], s
                glue = sol.solved.glue[i][min(p, len(sol.solved.glue[i]) - 1)]
                for n in L.glue[i]:
                    dims[n], stages[n] = glue.strategies[n], s
        first = sol.choice[0] if L.blocks else 0
        pre = sol.solved.pre[min(first, len(sol.solved.pre) - 1)]
        for n in L.pre:
            dims[n], stages[n] = pre.strategies[n], 0
        last = sol.choice[-1] if L.blocks else 0
        post = sol.solved.post[min(last, len(sol.solved.post) - 1)]
        for n in L.post:
            dims[n], stages[n] = post.strategies[n], pp - 1
        draft.add_axis("dp", dp, {n: d[0] for n, d in dims.items()})
        draft.add_axis("tp", tp, {n: d[1] for n, d in dims.items()})
        draft.microbatches = m
        draft.num_stages = pp
        draft.schedule = "1f1b"
        if pp > 1:
            draft.stages = stages


register_space("alpa", Alpa)
