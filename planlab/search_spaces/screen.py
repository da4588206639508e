"""The fast screen: an analytic estimate of a plan's iteration time and peak memory, from its
Draft and the cost model, without materializing.

Per device group of the pipeline (one representative device per group) and per micro-batch:

- compute: each operator's forward and backward on its piece (``flops / (micro-batches x
  pieces)``) priced by ``CostModel.compute_time_s``, recomputed forwards again in the backward;
- tensor-parallel (and any mesh-axis) communication: between each producer and consumer in one
  stage, the layout conversion materialize would insert (partial -> replicated: all-reduce,
  partial -> sharded: reduce-scatter, sharded -> replicated: all-gather, one shard to another:
  all-to-all), once per tensor and layout, and in the backward the conversion of the gradient
  contributions back to the producer's layout; priced by ``CostModel.collective_time_s``;
- pipeline communication: tensors crossing stages, priced by ``CostModel.p2p_time_s``.

The pipeline runs ``M`` micro-batches; with ``t_r`` the time of group ``r`` per micro-batch and
``v`` model chunks per device, ``pipeline = M max t_r + (sum t_r - max t_r) / v`` (the bubble of
1F1B; interleaving divides it by ``v``). Data-parallel gradient reduction follows: all-reduces in
buckets of 40M elements overlapped with the last micro-batch's backward (exposed: what the
backward does not hide, at least the last bucket), or with ZeRO a reduce-scatter and an
all-gather; then the optimizer step (12 flop per parameter, Adam).

Memory per device: weights, gradients and optimizer states (ZeRO shards the latter over the
reduction group), plus the activations one micro-batch saves for the backward times the
micro-batches the schedule keeps in flight (``bound_bytes``, a lower bound), plus the largest
operator's working set (``mem_bytes``, the estimate).

Everything that depends on the plan's structure (its mesh axes, their dimensions, its stages and
recomputation) is computed once per structure and shared by every plan that differs only in the
number of micro-batches, the ZeRO stage or the schedule: a few microseconds per plan after that.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
from planlab.costmodel import CostModel
from planlab.graph.ir import DTYPE_BYTES, Graph
from planlab.plan.materialize import BUCKET_ELEMENTS
from planlab.plan.program import Precision
from planlab.search_spaces.schedules import SCHEDULES, interleaved_1f1b, one_f_one_b
from planlab.search_spaces.space import Draft

_R = -1  # replicated (a placement: -1 replicated, -2 partial, i >= 0 sharded along tensor axis i)
_P = -2


@dataclass(frozen=True)
class Estimate:
    """The screen's estimate of one plan (seconds and bytes per device)."""

    time_s: float
    mem_bytes: float
    bound_bytes: float
    static_bytes: float
    compute_s: float
    comm_s: float  # collectives on the critical path, per iteration, the slowest group
    p2p_s: float
    bubble_s: float
    grad_sync_s: float  # exposed gradient reduction (or ZeRO's reduce-scatter + all-gather) and optimizer

    def __str__(self) -> str:
        return (f"~{self.time_s * 1e3:.1f} ms, ~{self.mem_bytes / 2**30:.2f} GiB (compute {self.compute_s * 1e3:.1f} "
                f"ms, comm {self.comm_s * 1e3:.1f} ms, bubble {self.bubble_s * 1e3:.1f} ms)")


@dataclass
class _Edge:
    producer: int
    consumer: int
    tensor: str
    numel: int
    batch: bool
    ebytes: int
    have: dict[str, int]  # producer's dims -> the tensor axis they shard, or _P for its reductions
    need: dict[str, int]  # consumer's dims -> the tensor axis they shard


def _placement(dim: str | None, where: dict[str, int]) -> int:
    if dim is None:
        return _R
    return where.get(dim, _R)


class _Tables:
    """What the screen needs of a graph, once."""

    def __init__(self, g: Graph, prec: Precision) -> None:
        ops = g.operators
        self.n = len(ops)
        self.names = [op.name for op in ops]
        index = {op.name: i for i, op in enumerate(ops)}
        works: dict[tuple, int] = {}
        self.work_class = [works.setdefault((op.flops, op.bytes_moved, op.bwd_flops_ratio), len(works)) for op in ops]
        self.works = list(works)  # class -> (flops, bytes, backward flops ratio)
        batch = g.batch_label

        def is_batch(t: str) -> bool:
            return any(g.labels.get((t, a)) == batch for a in range(len(g.tensors[t].shape)))

        def ebytes(t: str) -> int:
            spec = g.tensors[t]
            return prec.activation_bytes if spec.is_float else DTYPE_BYTES.get(spec.dtype, 4)

        def axis_map(op, t: str) -> dict[str, int]:
            return {ax[0]: i for i, ax in enumerate(op.axes_of(t)) if ax}

        self.params: list[list[tuple[int, frozenset[str]]]] = []
        self.saves: list[list[tuple[str, int, frozenset[str], bool, int]]] = []
        self.out: list[tuple[int, frozenset[str], bool, int]] = []
        self.edges: list[_Edge] = []
        self.has_backward = []
        for i, op in enumerate(ops):
            ps, ss = [], []
            for t in op.inputs:
                if g.tensors[t].role == "param":
                    ps.append((g.tensors[t].numel, frozenset(axis_map(op, t))))
            for t in op.saves:
                spec = g.tensors[t]
                if spec.role != "param":
                    ss.append((t, spec.numel, frozenset(axis_map(op, t)), is_batch(t), ebytes(t)))
            self.params.append(ps)
            self.saves.append(ss)
            o = op.outputs[0]
            self.out.append((g.tensors[o].numel, frozenset(axis_map(op, o)), is_batch(o), ebytes(o)))
            self.has_backward.append(any(g.tensors[t].is_float and g.tensors[t].role in ("activation", "param")
                                         for t in op.inputs))
            for t in dict.fromkeys(op.inputs):
                prod = g.producer.get(t)
                if prod is None or g.tensors[t].role == "param":
                    continue
                have = axis_map(prod, t)
                have.update({d: _P for d in prod.signature.reduce if d not in have})
                self.edges.append(_Edge(index[prod.name], i, t, g.tensors[t].numel, is_batch(t), ebytes(t),
                                        have, axis_map(op, t)))


@dataclass
class _Split:
    """Per operator and edge, what the mesh axes and their dimensions make of it (stages aside)."""

    pieces: list[int]  # per operator: pieces its work is split into
    fkeys: list[tuple]  # per operator: (work class, pieces, "F"), its forward's price key
    bkeys: list[tuple]  # per operator: (work class, pieces, "B")
    params: list[tuple]  # per operator: ((reduction axes, local elements), ...)
    saves: list[tuple]  # per operator: ((tensor, cut, batch bytes, other bytes), ...)
    work: list[float]  # per operator: its local output's batch bytes (a working set)
    conv_f: list[tuple]  # per edge: ((kind, axis, local elements), ...) converting the activation
    conv_b: list[tuple]  # per edge: the same for the gradient contribution
    recv: list[float]  # per edge: elements each device of the consumer's stage needs (across stages)
    keep: list[float]  # per edge: elements of the buffer the consumer reads (a local slice reads the whole)


def _split(t: _Tables, sizes: tuple[int, ...], dims: list[tuple]) -> _Split:
    live = [a for a, s in enumerate(sizes) if s > 1]
    pieces, params, saves, work = [], [], [], []
    for i in range(t.n):
        od = [(a, dims[a][i]) for a in live if dims[a][i] is not None]
        pieces.append(math.prod(sizes[a] for a, _ in od))
        ps = []
        for numel, pdims in t.params[i]:
            cut = math.prod(sizes[a] for a, dm in od if dm in pdims)
            ps.append((tuple(a for a, dm in od if dm not in pdims), numel / cut))
        params.append(tuple(ps))
        ss = []
        for name, numel, sdims, batch, eb in t.saves[i]:
            cut = math.prod(sizes[a] for a, dm in od if dm in sdims)
            ss.append((name, cut, numel / cut * eb if batch else 0.0, 0.0 if batch else numel / cut * eb))
        saves.append(tuple(ss))
        numel, odset, batch, eb = t.out[i]
        work.append(numel / math.prod(sizes[a] for a, dm in od if dm in odset) * eb if batch else 0.0)
    conv_f, conv_b, recv, keep = [], [], [], []
    fdone: set = set()
    bdone: set = set()
    for e in t.edges:
        p, c = e.producer, e.consumer
        need = tuple(_placement(dims[a][c], e.need) for a in live)
        have = tuple(_placement(dims[a][p], e.have) for a in live)
        recv.append(e.numel / math.prod(sizes[a] for a, x in zip(live, need) if x >= 0))
        keep.append(e.numel / math.prod(sizes[a] for a, x, h in zip(live, need, have) if x >= 0 and h >= 0))
        cf = ()
        if (e.tensor, need) not in fdone:  # one conversion per tensor and layout, shared by its consumers
            fdone.add((e.tensor, need))
            cf = _conversions(have, need, live, sizes, e.numel)
        conv_f.append(cf)
        # the gradient contribution: partial where the consumer splits a dimension the tensor lacks
        contrib = tuple(_P if (dims[a][c] is not None and x == _R) else x for a, x in zip(live, need))
        target = tuple(_R if h == _P else h for h in have)
        cb = ()
        if (e.tensor, contrib) not in bdone:  # contributions in one layout are summed before converting
            bdone.add((e.tensor, contrib))
            cb = _conversions(contrib, target, live, sizes, e.numel)
        conv_b.append(cb)
    fkeys = [(w, n, "F") for w, n in zip(t.work_class, pieces)]
    bkeys = [(w, n, "B") for w, n in zip(t.work_class, pieces)]
    return _Split(pieces, fkeys, bkeys, params, saves, work, conv_f, conv_b, recv, keep)


def _conversions(have: tuple, need: tuple, live: list[int], sizes, numel: int) -> tuple:
    out = []
    for j, (h, w) in enumerate(zip(have, need)):
        kind = _kind(h, w)
        if kind:
            cut = math.prod(sizes[live[k]] for k in range(len(live)) if k != j and (have[k] >= 0 or need[k] >= 0))
            out.append((kind, live[j], numel / cut))
    return tuple(out)


@dataclass(frozen=True)
class _Profile:
    """What one device group computes and communicates per micro-batch, before pricing."""

    fwd: tuple  # ((work class, pieces, priced as phase), tasks), ...
    bwd: tuple  # the backward's, with recomputed forwards
    comm: tuple  # ((kind, axis, elements, batch, element bytes), collectives), ...
    params: tuple  # ((reduction axes, elements), ...)
    saved: tuple[tuple[int, tuple[float, float]], ...]  # (stage, (batch, other) bytes one micro-batch keeps)
    work: float  # the largest operator's working set, batch bytes


@dataclass
class _Structure:
    profiles: list[_Profile]  # per device group of the pipeline
    ids: list[int]  # per group: its profile's number (equal profiles, equal numbers)
    p2p: list[tuple]  # per group: ((elements, batch, element bytes, peer group), transfers), ...


def _aggregate(t: _Tables, sp: _Split, stage: tuple, rcs: tuple, G: int) -> _Structure:
    fwd: list[dict] = [{} for _ in range(G)]
    bwd: list[dict] = [{} for _ in range(G)]
    comm = [Counter() for _ in range(G)]
    p2p = [Counter() for _ in range(G)]
    params = [Counter() for _ in range(G)]
    saved: list[dict] = [defaultdict(lambda: [0.0, 0.0]) for _ in range(G)]  # per group: stage -> bytes
    work = [0.0] * G
    seen: list[set] = [set() for _ in range(G)]
    hb = t.has_backward
    for i, (fk, bk) in enumerate(zip(sp.fkeys, sp.bkeys)):
        r = stage[i] % G
        f, b = fwd[r], bwd[r]
        f[fk] = f.get(fk, 0) + 1
        if hb[i]:
            b[bk] = b.get(bk, 0) + 1
        if rcs[i]:
            b[fk] = b.get(fk, 0) + 1  # its forward again, before the backward
        elif sp.saves[i]:
            for name, cut, sb, so in sp.saves[i]:
                if (name, cut) not in seen[r]:  # one buffer, saved by several operators
                    seen[r].add((name, cut))
                    acc = saved[r][stage[i]]
                    acc[0] += sb
                    acc[1] += so
        if sp.params[i]:
            for red, elems in sp.params[i]:
                params[r][red] += elems
        if sp.work[i] > work[r]:
            work[r] = sp.work[i]
    for j, e in enumerate(t.edges):
        sp_, sc = stage[e.producer], stage[e.consumer]
        if sp_ != sc:
            if (e.tensor, sc) not in seen[sc % G]:  # sent once to each stage that reads it
                seen[sc % G].add((e.tensor, sc))
                p2p[sc % G][(sp.recv[j], e.batch, e.ebytes, sp_ % G)] += 1  # the activation
                p2p[sp_ % G][(sp.recv[j], e.batch, e.ebytes, sc % G)] += 1  # its gradient
                if rcs[e.consumer]:  # a recomputed consumer runs again from the received tensor
                    saved[sc % G][sc][0 if e.batch else 1] += sp.recv[j] * e.ebytes
            continue
        for kind, axis, numel in sp.conv_f[j]:
            comm[sc % G][(kind, axis, numel, e.batch, e.ebytes)] += 1
        for kind, axis, numel in sp.conv_b[j]:
            comm[sp_ % G][(kind, axis, numel, e.batch, e.ebytes)] += 1
        if rcs[e.consumer] and rcs[e.producer] != rcs[e.consumer]:
            r = sc % G  # a recomputed group keeps the inputs it reads from outside the group
            if (e.tensor, "in") not in seen[r]:
                seen[r].add((e.tensor, "in"))
                saved[r][sc][0 if e.batch else 1] += sp.keep[j] * e.ebytes
    profiles = [_Profile(tuple(sorted(fwd[r].items())), tuple(sorted(bwd[r].items())),
                         tuple(sorted(comm[r].items())), tuple(sorted(params[r].items())),
                         tuple((x, tuple(saved[r][x])) for x in sorted(saved[r])), work[r]) for r in range(G)]
    return _Structure(profiles, [], [tuple(sorted(p.items())) for p in p2p])


@dataclass(frozen=True)
class _Priced:
    fwd_s: float
    bwd_s: float
    comm_s: float
    sync_s: float  # exposed gradient reduction or ZeRO collectives, and the optimizer step
    static_bytes: float


class Screen:
    """Estimates plans of one graph and cluster; ``estimate(draft)`` costs microseconds once
    the draft's structure has been seen."""

    def __init__(self, graph: Graph, cost: CostModel, precision: Precision) -> None:
        self.graph, self.cost, self.prec = graph, cost, precision
        self.t = _Tables(graph, precision)
        self._splits: dict[Any, _Split] = {}
        self._structures: dict[Any, _Structure] = {}
        self._priced: dict[tuple, _Priced] = {}
        self._profile_ids: dict[_Profile, int] = {}
        self._ids: dict[int, tuple[Any, int]] = {}
        self._numbers: dict[tuple, int] = {}
        self._compute: dict[tuple, float] = {}
        self._coll: dict[tuple, float] = {}
        self._p2p: dict[tuple, float] = {}
        self.dtype = precision.compute_dtype

    def _key(self, t: tuple | None) -> int | None:
        """A small number for a long tuple (equal tuples, equal numbers): hashed by value once per
        tuple object, since the spaces hand the same objects to many plans."""
        if t is None:
            return None
        hit = self._ids.get(id(t))
        if hit is not None and hit[0] is t:
            return hit[1]
        if len(self._ids) > 4096:
            self._ids.clear()
        n = self._numbers.setdefault(t, len(self._numbers))
        self._ids[id(t)] = (t, n)
        return n

    def structure(self, d: Draft) -> _Structure:
        names = self.t.names
        sizes = tuple(s for _, s in d.axes)
        axis_dims = d.op_dims()
        skey = (sizes, tuple(self._key(ad) for ad in axis_dims))
        split = self._splits.get(skey)
        if split is None:
            split = self._splits[skey] = _split(self.t, sizes, axis_dims)
        if not d.stages:
            stages = None
        elif len(d.stages) == len(names) and list(d.stages) == names:
            stages = tuple(d.stages.values())  # every operator, in graph order: the values will do
        else:
            stages = tuple(d.stages.get(n, 0) for n in names)
        rc = tuple(d.recompute.items()) if d.recompute else None
        key = (skey, self._numbers.setdefault(stages, len(self._numbers)),
               self._numbers.setdefault(rc, len(self._numbers)), d.groups)
        got = self._structures.get(key)
        if got is None:
            rcs = tuple(d.recompute.get(n, 0) for n in names) if rc else (0,) * self.t.n
            got = self._structures[key] = _aggregate(self.t, split, stages or (0,) * self.t.n, rcs, d.groups)
            got.ids = [self._profile_ids.setdefault(p, len(self._profile_ids)) for p in got.profiles]
        return got

    # -- prices ------------------------------------------------------------------------
    def _compute_s(self, work: int, pieces: int, m: int, phase: str) -> float:
        key = (work, pieces, m, phase)
        got = self._compute.get(key)
        if got is None:
            flops, nbytes, ratio = self.t.works[work]
            if phase == "B":
                flops *= ratio
            got = self._compute[key] = self.cost.compute_time_s(
                flops=flops / m / pieces, bytes_moved=nbytes / m / pieces, dtype=self.dtype) \
                if (flops or nbytes) else 0.0
        return got

    @staticmethod
    def _group(axes: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[int, ...]:
        """The devices of the first group along ``axes`` of the first stage's mesh (row-major)."""
        strides = [math.prod(sizes[a + 1:]) for a in range(len(sizes))]
        members = [0]
        for a in axes:
            members = [m + k * strides[a] for m in members for k in range(sizes[a])]
        return tuple(sorted(members))

    def _coll_s(self, kind: str, nbytes: float, axes: tuple[int, ...], sizes: tuple[int, ...]) -> float:
        key = (kind, nbytes, axes, sizes)
        got = self._coll.get(key)
        if got is None:
            got = self._coll[key] = self.cost.collective_time_s(kind, nbytes, self._group(axes, sizes))
        return got

    def _p2p_s(self, nbytes: float, src: int, dst: int, per: int) -> float:
        key = (nbytes, src, dst, per)
        got = self._p2p.get(key)
        if got is None:
            got = self._p2p[key] = self.cost.p2p_time_s(nbytes, src * per, dst * per)
        return got

    def _price(self, p: _Profile, pid: int, sizes: tuple[int, ...], m: int, zero: int) -> _Priced:
        key = (pid, sizes, m, zero)
        got = self._priced.get(key)
        if got is not None:
            return got
        prec = self.prec
        f = sum(c * self._compute_s(w, pieces, m, ph) for (w, pieces, ph), c in p.fwd)
        b = sum(c * self._compute_s(w, pieces, m, ph) for (w, pieces, ph), c in p.bwd)
        cm = sum(c * self._coll_s(kind, numel / (m if batch else 1) * eb, (axis,), sizes)
                 for (kind, axis, numel, batch, eb), c in p.comm)
        sync = opt = static = ar = last = 0.0
        for axes, elems in p.params:
            n_red = math.prod(sizes[a] for a in axes)
            static += elems * (prec.param_bytes + prec.grad_bytes + prec.optimizer_bytes)
            if n_red > 1 and zero:
                sync += self._coll_s("reduce_scatter", elems * prec.grad_bytes, axes, sizes)
                sync += self._coll_s("all_gather", elems * prec.param_bytes, axes, sizes)
                static -= elems * prec.optimizer_bytes * (n_red - 1) / n_red
                if zero >= 2:
                    static -= elems * prec.grad_bytes * (n_red - 1) / n_red
                opt += elems / n_red
                continue
            opt += elems
            if n_red > 1:
                nb = max(1, math.ceil(elems / BUCKET_ELEMENTS))
                one = self._coll_s("all_reduce", elems * prec.grad_bytes / nb, axes, sizes)
                ar += nb * one
                last = max(last, one)
        sync += max(last, ar - b)  # buckets overlap the last micro-batch's backward; the last one does not
        if opt:
            sync += self.cost.compute_time_s(
                flops=12.0 * opt, dtype=self.dtype,
                bytes_moved=opt * (2 * prec.param_bytes + prec.grad_bytes + 2 * prec.optimizer_bytes))
        got = self._priced[key] = _Priced(f, b, cm, sync, static)
        return got

    # -- the estimate --------------------------------------------------------------------
    def estimate(self, d: Draft) -> Estimate:
        """The estimated iteration time and memory of the plan ``d`` describes."""
        s = self.structure(d)
        sizes = tuple(x for _, x in d.axes)
        per = math.prod(sizes)
        m, G, v = d.microbatches, d.groups, max(1, d.chunks)
        schedule = d.schedule if v == 1 else "interleaved"
        times, back, syncs, mems, bounds, prices = [], [], [], [], [], []
        for r in range(G):
            p = s.profiles[r]
            c = self._price(p, s.ids[r], sizes, m, d.zero)
            prices.append(c)
            pp = sum(n * self._p2p_s(numel / (m if batch else 1) * eb, src, r, per)
                     for (numel, batch, eb, src), n in s.p2p[r])
            times.append(c.fwd_s + c.bwd_s + c.comm_s + pp)
            back.append(c.bwd_s)
            syncs.append(c.sync_s)
            per_chunk = np.zeros(v)  # bytes one micro-batch keeps on each of the group's model chunks
            for stage, (b, o) in p.saved:
                per_chunk[min(v - 1, stage // G)] += b / m + o
            if v == 1 and schedule in ("1f1b", "gpipe"):
                act = _in_flight(schedule, r, G, m, v) * per_chunk[0]
            else:
                act = float((flight_counts(schedule, r, G, m, v) @ per_chunk).max())
            # the bound: what 1F1B keeps at least (every schedule here keeps as much), of the smallest chunk
            bounds.append(c.static_bytes + min(m, G - r) * float(per_chunk.min()))
            mems.append(c.static_bytes + act + 2 * p.work / m)
        t_max = max(times)
        pipe = m * t_max + (sum(times) - t_max) / v
        # group r's last backward ends about r backward steps before the first group's (1F1B drains to it)
        total, before = 0.0, 0.0
        for r in range(G):
            total = max(total, pipe - before / v + syncs[r])
            before += back[r]
        worst = max(range(G), key=lambda r: mems[r])
        slow = max(range(G), key=lambda r: times[r])
        c = prices[slow]
        return Estimate(time_s=total, mem_bytes=mems[worst], bound_bytes=max(bounds),
                        static_bytes=prices[worst].static_bytes,
                        compute_s=m * (c.fwd_s + c.bwd_s), comm_s=m * c.comm_s,
                        p2p_s=m * (times[slow] - c.fwd_s - c.bwd_s - c.comm_s),
                        bubble_s=pipe - m * t_max, grad_sync_s=max(syncs))


def _kind(have: int, need: int) -> str:
    """The collective that turns placement ``have`` into ``need`` along one mesh axis ('' if none)."""
    if have == need or have == _R:
        return ""  # the same, or a local slice of a replicated tensor
    if have == _P:
        return "all_reduce" if need == _R else "reduce_scatter"
    return "all_gather" if need == _R else "all_to_all"


def _in_flight(schedule: str, r: int, groups: int, m: int, chunks: int) -> int:
    """Micro-batch units (one chunk's activations each) device group ``r`` keeps at its peak."""
    if schedule == "interleaved":
        return min(m * chunks, 2 * (groups - r - 1) + (chunks - 1) * groups + 1)
    if schedule == "1f1b":
        return min(m, groups - r)
    if schedule == "gpipe":
        return m
    return min(m, groups - r) * chunks  # another schedule: as 1F1B


_FLIGHT: dict[tuple, np.ndarray] = {}


def flight_counts(schedule: str, r: int, groups: int, m: int, chunks: int) -> np.ndarray:
    """The distinct vectors of micro-batches in flight per model chunk of device group ``r`` (one
    row after each forward of its schedule; forwards add one, full or weight backwards take one
    away), walking the schedule the plan will run. The activation peak for per-chunk bytes ``w``
    is ``max(rows @ w)``. Cached per schedule and shape."""
    key = (schedule, r, groups, m, chunks)
    got = _FLIGHT.get(key)
    if got is None:
        if chunks > 1:
            actions = interleaved_1f1b(r, groups, m, chunks)
        elif schedule in SCHEDULES:
            actions = SCHEDULES[schedule](r, groups, m)
        else:
            actions = one_f_one_b(r, groups, m)
        steps = np.zeros((len(actions), chunks), dtype=np.int32)
        fwd = np.zeros(len(actions), dtype=bool)
        for k, a in enumerate(actions):
            c = a.stage // groups
            if a.phase == "F":
                steps[k, c] = 1
                fwd[k] = True
            elif a.phase in ("B", "W"):
                steps[k, c] = -1
        rows = np.cumsum(steps, axis=0)[fwd] if len(actions) else np.zeros((1, chunks), dtype=np.int32)
        got = np.unique(rows, axis=0)
        if len(_FLIGHT) > 4096:
            _FLIGHT.clear()
        _FLIGHT[key] = got
    return got
