"""What the screen prices, before pricing: per device group of a plan's pipeline, the work,
communication, parameters and saved activations of one micro-batch (``ScreenProfile``).

Three levels, each cached by the screen (``planlab.search_spaces.screen``):

- ``Tables``: what the screen needs of the graph, once (operators and edges in flat arrays, and
  *classes*: operators or edges alike but for their names, as the layers of a model repeat);
- ``split_work``: what the mesh axes and the dimensions they split make of each operator and edge
  (pieces, local parameter and saved sizes, layout conversions); computed once per operator or
  edge class and split, so a 96-layer model costs about what one layer costs;
- ``aggregate``: per device group, given the stages and the recomputation, the counts and sums
  of the above (numpy over all operators and edges at once).

Every value is a plain key (work class, pieces, collective kind, axis, elements, ...) given a small
number by ``Ids``, so that counting and summing run on integer arrays.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from planlab.graph.ir import DTYPE_BYTES, Graph
from planlab.plan.backward_split import weight_share
from planlab.costmodel.software import Fusion, SoftwareSpec
from planlab.plan.expert_dispatch import dispatch_tensors, permutation_ops, routing_of
from planlab.plan.fused_gemms import fused_groups, whole_widths
from planlab.plan.plan import RING_DIM, RING_KV_DIM, causal_attention
from planlab.plan.program import Precision
from planlab.plan.shared_params import forward_only_of
from planlab.plan.saved import (
    INTERNAL,
    cast_inputs,
    internals,
    keeps_producer_layout,
    saved_tensors,
    view_of,
    output_layer,
    weight_matmul,
)
from planlab.plan.zero import unit_key
from planlab.search_spaces.screen_gradients import deferred_positions, zero_axes

_R = -1  # replicated (a placement: -1 replicated, -2 partial, i >= 0 sharded along tensor axis i)
_P = -2


class Ids:
    """Small numbers for hashable values (equal values, equal numbers), and back."""

    def __init__(self) -> None:
        self.index: dict[Any, int] = {}
        self.values: list[Any] = []

    def of(self, value: Any) -> int:
        got = self.index.get(value)
        if got is None:
            got = self.index[value] = len(self.values)
            self.values.append(value)
        return got


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
    dispatch: bool = False  # a routed layer's dispatch or combine that the software sends once to each node


def _placement(dim: str | None, where: dict[str, int]) -> int:
    if dim is None:
        return _R
    return where.get(dim, _R)


def _kind(have: int, need: int) -> str:
    """The collective that turns placement ``have`` into ``need`` along one mesh axis ('' if none)."""
    if have == need or have == _R:
        return ""  # the same, or a local slice of a replicated tensor
    if have == _P:
        return "all_reduce" if need == _R else "reduce_scatter"
    return "all_gather" if need == _R else "all_to_all"


def _conversions(have: tuple, need: tuple, live: list[int], sizes, numel: int) -> tuple:
    out = []
    for j, (h, w) in enumerate(zip(have, need)):
        kind = _kind(h, w)
        if kind:
            cut = math.prod(sizes[live[k]] for k in range(len(live)) if k != j and (have[k] >= 0 or need[k] >= 0))
            if kind == "all_to_all":  # priced on one rank's buffer (planlab.costmodel.comm), the others on the full one
                cut *= sizes[live[j]]
            out.append((kind, live[j], numel / cut))
    return tuple(out)


def shapes_of(g: Graph, op) -> tuple[tuple[int, ...], ...]:
    """The whole shapes of an operator's inputs, then its outputs (as a Task's ``shapes``)."""
    return tuple(tuple(g.tensors[t].shape) for t in op.inputs + op.outputs)


def local_shapes(g: Graph, op, cut: tuple[tuple[str, int], ...], m: int, ring: bool = False) -> tuple:
    """The shapes of one piece of ``op`` (its inputs, then its outputs, as a Task's ``shapes``): each
    dimension of ``cut`` ((dimension, pieces), ...) divided, the batch over ``m`` micro-batches; a
    ``ring`` attention's keys and values split along their sequence where its queries are."""
    out = []
    for k, t in enumerate(op.inputs + op.outputs):
        shape = list(g.tensors[t].shape)
        names = [ax[0] if ax else None for ax in op.axes_of(t)]
        for dim, n in cut:
            dim = RING_KV_DIM if ring and dim == RING_DIM and k in (1, 2) else dim
            if dim in names:
                shape[names.index(dim)] = max(1, shape[names.index(dim)] // n)
        for a in range(len(shape)):
            if g.labels.get((t, a)) == g.batch_label:
                shape[a] = max(1, shape[a] // m)
        out.append(tuple(shape))
    return tuple(out)


def work_of(
    g: Graph, op, w_share: float, fused: tuple[Fusion | None, tuple[int, ...]] = (None, ()), in_kernel: bool = False
) -> tuple:
    """An operator's class of work for the screen: (flops, bytes, backward flops ratio, weight-gradient
    share, kind, shapes of its inputs and outputs, whether it is a causal attention, the fusion and
    whole output widths of the GEMM it is fused into (:func:`planlab.plan.fused_gemms.whole_widths`),
    whether it runs inside another operator's kernel (a fused token permutation), whether it is a
    matrix product with a weight (FP8 where the software runs those in FP8), whether it is the
    output projection (16 bits under FP8)): the fields of the
    Task the simulator prices (:meth:`planlab.search_spaces.screen.Screen._kernel_factor`)."""
    causal = op.kind == "attention" and causal_attention(op)
    shapes = shapes_of(g, op)
    return (
        op.flops,
        op.bytes_moved,
        op.bwd_flops_ratio,
        w_share,
        op.kind,
        shapes,
        causal,
        *fused,
        in_kernel,
        weight_matmul(op, g),
        output_layer(op, g),
    )


def _software_work(g: Graph, software: SoftwareSpec | None) -> tuple[dict, frozenset[str]]:
    """What the software changes of the operators' work, as its passes change the simulator's tasks:
    per projection it runs fused, the fusion and the group's whole widths; the operators a fused
    token permutation runs inside its kernels (:mod:`planlab.plan.expert_dispatch`)."""
    if software is None:
        return {}, frozenset()
    groups = fused_groups(g)
    fused = {n: whole_widths(g, n) for n, grp in groups.items() if software.fuses(grp.fusion)}
    return fused, permutation_ops(g) if software.fused_permute else frozenset()


class Tables:
    """What the screen needs of a graph, once."""

    @staticmethod
    def _saves_of(g: Graph, op, software, prec, fwd_only, index, axis_map, is_batch, ebytes) -> tuple:
        """What ``op`` keeps for its backward as the software keeps it (:mod:`planlab.plan.saved`):
        ``(elements, dims, batch, bytes[, producer dims])`` entries, their names, and per entry the
        producer whose cut a kept input takes (or None)."""
        ss, names, prods = [], [], []
        if op.name in fwd_only:
            return ss, names, prods
        cast = cast_inputs(op, g, prec, software)
        for t in saved_tensors(op, software, g, prec):
            spec = g.tensors[t]
            if spec.role == "param":
                continue
            view = view_of(t, g)
            if view is not None:  # a broadcast view keeps the storage under it (planlab.plan.saved), split
                base = view.inputs[0]  # along the view's axes that are the base's
                kept = {a for a, ax in enumerate(view.axes_of(t)) if ax and ax[0] in axis_map(view, base)}
                dims = frozenset(d for d, a in axis_map(op, t).items() if a in kept)
                ss.append((g.tensors[base].numel, dims, is_batch(base), ebytes(base)))
                names.append(base)
                prods.append(None)
                continue
            kept = keeps_producer_layout(op, t, g, software)  # cut as its producer cuts it, where more
            prod = g.producer[t] if kept else None
            fp8 = t in cast  # its cast instead (planlab.plan.saved.cast_inputs)
            ss.append(
                (spec.numel, frozenset(axis_map(op, t)), is_batch(t), cast[t] if fp8 else ebytes(t))
                + ((frozenset(axis_map(prod, t)),) if kept else ())
            )
            names.append(f"{INTERNAL}{t}:fp8" if fp8 else t)
            prods.append(index[prod.name] if kept else None)
        for tag, base, per, nbytes in internals(op, g, software, prec.activation_bytes):
            ss.append((g.tensors[base].numel * per, frozenset(axis_map(op, base)), is_batch(base), nbytes))
            names.append(f"{INTERNAL}{op.name}:{tag}")
            prods.append(None)
        return ss, names, prods

    def _classify_work(self, g: Graph, share: list[float], software: SoftwareSpec | None, index: dict) -> None:
        """Each operator's work class (``work_class``, ``works``), as the software runs it; a fused
        projection's work as its own GEMM too (``unfused_class``), for a plan that splits its group
        apart (the simulator fuses only pieces that read one buffer under one split:
        :func:`planlab.plan.fused_gemms.fused_fields`), and its group's other members (``fused_with``)."""
        ops = g.operators
        works: dict[tuple, int] = {}
        fused, inside = _software_work(g, software)
        self.work_class = [
            works.setdefault(work_of(g, op, w, fused.get(op.name, (None, ())), op.name in inside), len(works))
            for op, w in zip(ops, share)
        ]
        self.unfused_class = [
            works.setdefault(work_of(g, op, w, (None, ()), op.name in inside), len(works)) if op.name in fused else c
            for op, w, c in zip(ops, share, self.work_class)
        ]
        groups = fused_groups(g)
        self.fused_with = [
            tuple(index[n] for n in groups[op.name].ops if n != op.name) if op.name in fused else () for op in ops
        ]
        self.works = list(works)
        self.work_op = {}  # per work class: an operator of it (its axes name the dimensions a cut splits)
        for op, c in zip(ops + ops, self.work_class + self.unfused_class):
            self.work_op.setdefault(c, op)

    def __init__(self, g: Graph, prec: Precision, software: SoftwareSpec | None = None) -> None:
        ops = g.operators
        per_module = software is not None and software.zero3_unit == "module"  # DeepSpeed's ZeRO-3 units
        self.n = len(ops)
        self.names = [op.name for op in ops]
        index = {op.name: i for i, op in enumerate(ops)}

        def grads(op, role: str) -> int:  # the gradients its backward writes for inputs of ``role``
            return sum(1 for t in op.inputs if g.tensors[t].is_float and g.tensors[t].role == role)

        # the share of its backward that computes weight gradients (zero-bubble's W)
        share = [weight_share(op.kind, grads(op, "param"), grads(op, "activation")) for op in ops]
        self._classify_work(g, share, software, index)
        self.work_params = {c: grads(op, "param") > 0 for op, c in zip(ops + ops, self.work_class + self.unfused_class)}
        batch = g.batch_label
        # per operator, its batch dimension's name (None: no batch): the axes splitting another dimension
        # of a weight's owner are tensor-parallel ranks of its gradient's reduction (ZeRO shards over the rest)
        self.batch_dim = [g.dim_with_label(op, batch) if batch else None for op in ops]

        def is_batch(t: str) -> bool:
            return any(g.labels.get((t, a)) == batch for a in range(len(g.tensors[t].shape)))

        def ebytes(t: str) -> int:
            spec = g.tensors[t]
            return prec.activation_bytes if spec.is_float else DTYPE_BYTES.get(spec.dtype, 4)

        def axis_map(op, t: str) -> dict[str, int]:
            return {ax[0]: i for i, ax in enumerate(op.axes_of(t)) if ax}

        self.params: list[list[tuple[int, frozenset[str]]]] = []
        self.param_units: list[tuple[int, ...]] = []  # per operator, per parameter: its ZeRO-3 unit (a layer)
        units: dict[str, int] = {}
        self.saves: list[list[tuple[int, frozenset[str], bool, int]]] = []  # (elements, dims, batch, bytes)
        self.save_names: list[tuple[str, ...]] = []
        self.save_producers: list[tuple[int | None, ...]] = []  # the producer whose cut a kept input takes
        self.out: list[tuple[int, frozenset[str], bool, int]] = []
        self.edges: list[_Edge] = []
        has_backward = []
        fwd_only = forward_only_of(g)  # recycling passes behind a detach: no backward, nothing saved
        dedup = software is not None and software.expert_dispatch == "node_dedup" and routing_of(g) is not None
        moved = dispatch_tensors(g) if dedup else frozenset()
        self.fwd_only = np.array([op.name in fwd_only for op in ops], dtype=bool)
        owned: set[str] = set()  # parameters read with a backward so far: a tied one is held once (shared_params)
        for i, op in enumerate(ops):
            held = [t for t in op.inputs if g.tensors[t].role == "param" and (op.name in fwd_only or t not in owned)]
            ps = [(g.tensors[t].numel, frozenset(axis_map(op, t))) for t in held]
            us = [units.setdefault(unit_key(t, per_module), len(units)) for t in held]
            owned.update(t for t in op.inputs if g.tensors[t].role == "param" and op.name not in fwd_only)
            ss, names, prods = self._saves_of(g, op, software, prec, fwd_only, index, axis_map, is_batch, ebytes)
            self.save_producers.append(tuple(prods))
            self.params.append(ps)
            self.param_units.append(tuple(us))
            self.saves.append(ss)
            self.save_names.append(tuple(names))
            o = op.outputs[0]
            self.out.append((g.tensors[o].numel, frozenset(axis_map(op, o)), is_batch(o), ebytes(o)))
            has_backward.append(
                op.name not in fwd_only
                and any(g.tensors[t].is_float and g.tensors[t].role in ("activation", "param") for t in op.inputs)
            )
            for t in dict.fromkeys(op.inputs):
                prod = g.producer.get(t)
                if prod is None or g.tensors[t].role == "param":
                    continue
                have = axis_map(prod, t)
                have.update({d: _P for d in prod.signature.reduce if d not in have})
                self.edges.append(
                    _Edge(
                        index[prod.name],
                        i,
                        t,
                        g.tensors[t].numel,
                        is_batch(t),
                        ebytes(t),
                        have,
                        axis_map(op, t),
                        t in moved,
                    )
                )
        self.has_backward = np.array(has_backward, dtype=bool)
        self._partial_grad_tables(g)
        classes: dict[tuple, int] = {}
        self.op_class = [
            classes.setdefault((tuple(self.params[i]), tuple(self.saves[i]), self.out[i]), len(classes))
            for i in range(self.n)
        ]
        classes = {}
        self.edge_class = [
            classes.setdefault(
                (e.numel, e.batch, e.ebytes, tuple(sorted(e.have.items())), tuple(sorted(e.need.items())), e.dispatch),
                len(classes),
            )
            for e in self.edges
        ]
        tensors: dict[str, int] = {}
        self.e_tensor = np.array([tensors.setdefault(e.tensor, len(tensors)) for e in self.edges], dtype=np.int64)
        self.e_producer = np.array([e.producer for e in self.edges], dtype=np.int64)
        self.e_consumer = np.array([e.consumer for e in self.edges], dtype=np.int64)
        self.e_batch = np.array([e.batch for e in self.edges], dtype=bool)
        self.e_ebytes = np.array([e.ebytes for e in self.edges], dtype=np.float64)

    def _partial_grad_tables(self, g: Graph) -> None:
        """What :func:`~planlab.search_spaces.screen_gradients.deferred_positions` reads (as :func:`planlab.plan.partial_grads.deferred_axes` does): per
        operator, its batch dimension, whether it makes the loss, and the edges (indices) of its
        floating outputs to their consumers."""
        ops = g.operators
        self.makes_loss = [g.loss in op.outputs for op in ops]
        self.out_edges: list[list[int]] = [[] for _ in ops]
        for j, e in enumerate(self.edges):
            if g.tensors[e.tensor].is_float:
                self.out_edges[e.producer].append(j)


@dataclass
class Split:
    """Per operator and edge, what the mesh axes and their dimensions make of it (stages aside);
    keys are numbers of the screen's ``Ids``."""

    fkey: np.ndarray  # per operator: its forward's price key, (work class, pieces, "F", cut): cut ((dim, pieces), ...)
    bkey: np.ndarray  # per operator: its backward's, (work class, pieces, "B", cut)
    wkey: np.ndarray  # per operator: its backward's weight-gradient part, (work class, pieces, "W", cut); -1: none
    work: np.ndarray  # per operator: its local output's batch bytes (a working set)
    s_op: np.ndarray  # per saved tensor of an operator: the operator
    s_key: np.ndarray  # ... (tensor, cut): the buffer (several operators may save one)
    s_bytes: np.ndarray  # ... (batch bytes, other bytes), shape (saves, 2)
    p_op: np.ndarray  # per parameter of an operator: the operator
    p_red: np.ndarray  # ... its gradient's reduction axes (a tuple)
    p_elems: np.ndarray  # ... local elements
    p_unit: np.ndarray  # ... its ZeRO-3 unit
    recv: np.ndarray  # per edge: elements each device of the consumer's stage needs (across stages)
    keep: np.ndarray  # per edge: elements of the buffer the consumer reads (a local slice reads the whole)
    cf_edge: np.ndarray  # per conversion of an activation: its edge
    cf_key: np.ndarray  # ... (kind, axis, local elements, batch, element bytes)
    cb_edge: np.ndarray  # per conversion of a gradient contribution: its edge
    cb_key: np.ndarray


def _ints(xs) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


def split_work(
    t: Tables, sizes: tuple[int, ...], dims: list[tuple], ids: Ids, ring: frozenset[int] = frozenset()
) -> Split:
    """What ``sizes`` and ``dims`` (per mesh axis, per operator) make of every operator and edge;
    ``ring`` (operator indices) run as ring attention: their keys and values split along their
    sequence where the queries are, so no conversion meets them (``PlanBuilder.ring``)."""
    live = [a for a, s in enumerate(sizes) if s > 1]
    cols = [dims[a] for a in live]
    n = t.n
    deferred = deferred_positions(t, live, cols)
    fkey, bkey, wkey, work = [0] * n, [0] * n, [0] * n, [0.0] * n
    s_op, s_key, s_bytes, p_op, p_red, p_elems, p_unit = [], [], [], [], [], [], []
    weight_axes: set[int] = set()  # the mesh axes along which some weight is split (tensor/expert parallelism)
    memo: dict[tuple, tuple] = {}
    for i in range(n):
        od = tuple(c[i] for c in cols)
        pods = tuple(None if j is None else tuple(c[j] for c in cols) for j in t.save_producers[i])
        w = t.work_class[i]
        if any(tuple(c[j] for c in cols) != od for j in t.fused_with[i]):  # its fused group split apart
            w = t.unfused_class[i]
        key = (t.op_class[i], od, w, pods, i in ring, t.batch_dim[i], deferred.get(i))
        got = memo.get(key)
        if got is None:
            got = memo[key] = _op_split(t, i, w, live, sizes, od, ids, pods, i in ring, deferred.get(i, ()))
        fkey[i], bkey[i], wkey[i], work[i], params, saves, sharding = got
        weight_axes |= sharding
        for (red, elems), unit in zip(params, t.param_units[i]):
            p_op.append(i)
            p_red.append(red)
            p_elems.append(elems)
            p_unit.append(unit)
        for name, (cut, sb, so) in zip(t.save_names[i], saves):
            s_op.append(i)
            s_key.append(ids.of((name, cut)))
            s_bytes.append((sb, so))
    groupings: dict[tuple, int] = {}
    p_red = [groupings.setdefault(r, ids.of(zero_axes(r, weight_axes))) for r in p_red]
    recv, keep, cf_edge, cf_key, cb_edge, cb_key = [], [], [], [], [], []
    fdone: set = set()
    bdone: set = set()
    memo = {}
    for j, e in enumerate(t.edges):
        pd = tuple(c[e.producer] for c in cols)
        cd = tuple(c[e.consumer] for c in cols)
        if e.consumer in ring and RING_KV_DIM in e.need and RING_DIM not in e.need:  # its keys or values
            cd = tuple(RING_KV_DIM if x == RING_DIM else x for x in cd)
        pdef, cdef = deferred.get(e.producer, ()), deferred.get(e.consumer, ())
        key = (t.edge_class[j], pd, cd, pdef, cdef)
        got = memo.get(key)
        if got is None:
            got = memo[key] = _edge_split(e, live, sizes, pd, cd, ids, pdef, cdef)
        need, r, k, cf, contrib, cb = got
        recv.append(r)
        keep.append(k)
        if cf and (e.tensor, need) not in fdone:  # one conversion per tensor and layout, shared by its consumers
            fdone.add((e.tensor, need))
            cf_edge.extend([j] * len(cf))
            cf_key.extend(cf)
        if cb and (e.tensor, contrib) not in bdone:  # contributions in one layout are summed before converting
            bdone.add((e.tensor, contrib))
            cb_edge.extend([j] * len(cb))
            cb_key.extend(cb)
    return Split(
        _ints(fkey),
        _ints(bkey),
        _ints(wkey),
        np.array(work),
        _ints(s_op),
        _ints(s_key),
        np.array(s_bytes, dtype=np.float64).reshape(-1, 2),
        _ints(p_op),
        _ints(p_red),
        np.array(p_elems, dtype=np.float64),
        _ints(p_unit),
        np.array(recv, dtype=np.float64),
        np.array(keep, dtype=np.float64),
        _ints(cf_edge),
        _ints(cf_key),
        _ints(cb_edge),
        _ints(cb_key),
    )


def _op_split(
    t: Tables,
    i: int,
    w: int,
    live: list[int],
    sizes,
    od: tuple,
    ids: Ids,
    pods: tuple = (),
    ring: bool = False,
    deferred: tuple[int, ...] = (),
) -> tuple:
    """(forward key, backward key, weight-gradient key or -1, working set, (((axis, splits its batch)
    per reduction axis, elements), ...), ((cut, batch bytes, other bytes), ...), the axes splitting a weight)
    of operator ``i`` (work class ``w``) split along ``od``
    (per live axis); ``pods``, per saved tensor, its producer's split where the tensor is kept in
    the producer's layout (else None); a ``ring`` attention keeps its keys and values split along
    their sequence as its queries are; its weights' gradients are also reduced along the live
    positions ``deferred`` (:func:`~planlab.search_spaces.screen_gradients.deferred_positions`)."""
    split = [(a, d) for a, d in zip(live, od) if d is not None]
    pieces = math.prod(sizes[a] for a, _ in split)
    params = []
    sharding: set[int] = set()
    for numel, pdims in t.params[i]:
        cut = math.prod(sizes[a] for a, dm in split if dm in pdims)
        sharding.update(a for a, dm in split if dm in pdims)
        # reduced along the axes splitting another of its dimensions, and along those its gradient
        # stays a partial sum over (deferred: data-parallel replicas, like a batch split)
        red = tuple(
            (a, j in deferred or od[j] == t.batch_dim[i])
            for j, a in enumerate(live)
            if j in deferred or (od[j] is not None and od[j] not in pdims)
        )
        params.append((red, numel / cut))
    saves = []
    for k, (numel, sdims, batch, eb, *pdims) in enumerate(t.saves[i]):
        if ring and RING_KV_DIM in sdims:
            sdims = sdims | {RING_DIM}
        cut = math.prod(sizes[a] for a, dm in split if dm in sdims)
        if pdims and k < len(pods) and pods[k] is not None:
            cut = max(cut, math.prod(sizes[a] for a, dm in zip(live, pods[k]) if dm is not None and dm in pdims[0]))
        saves.append((cut, numel / cut * eb if batch else 0.0, 0.0 if batch else numel / cut * eb))
    numel, odset, batch, eb = t.out[i]
    work = numel / math.prod(sizes[a] for a, dm in split if dm in odset) * eb if batch else 0.0
    cut = tuple((dm, sizes[a]) for a, dm in split)  # the piece's shapes: planlab.search_spaces.screen prices them
    wkey = ids.of((w, pieces, "W", cut)) if t.works[w][3] > 0 else -1
    return (
        ids.of((w, pieces, "F", cut)),
        ids.of((w, pieces, "B", cut)),
        wkey,
        work,
        tuple(params),
        tuple(saves),
        frozenset(sharding),
    )


def _edge_split(
    e: _Edge, live: list[int], sizes, pd: tuple, cd: tuple, ids: Ids, pdef: tuple = (), cdef: tuple = ()
) -> tuple:
    """(the consumer's layout, elements received, elements kept, activation conversions, the
    gradient contribution's layout, its conversions) of edge ``e``; conversions as key numbers;
    ``pdef`` and ``cdef``: the live positions along which the producer's and the consumer's
    gradients stay partial sums (:func:`~planlab.search_spaces.screen_gradients.deferred_positions`)."""
    need = tuple(_placement(d, e.need) for d in cd)
    have = tuple(_placement(d, e.have) for d in pd)
    recv = e.numel / math.prod(sizes[a] for a, x in zip(live, need) if x >= 0)
    keep = e.numel / math.prod(sizes[a] for a, x, h in zip(live, need, have) if x >= 0 and h >= 0)
    cf = tuple(
        ids.of((kind, axis, numel, e.batch, e.ebytes, e.dispatch and kind == "all_to_all"))
        for kind, axis, numel in _conversions(have, need, live, sizes, e.numel)
    )
    # the gradient contribution: partial where the consumer splits a dimension the tensor lacks
    contrib = tuple(_P if (j in cdef or (d is not None and x == _R)) else x for j, (d, x) in enumerate(zip(cd, need)))
    target = tuple(_P if j in pdef else _R if h == _P else h for j, h in enumerate(have))
    cb = tuple(
        ids.of((kind, axis, numel, e.batch, e.ebytes, e.dispatch and kind == "all_to_all"))
        for kind, axis, numel in _conversions(contrib, target, live, sizes, e.numel)
    )
    return need, recv, keep, cf, contrib, cb


@dataclass(frozen=True)
class ScreenProfile:
    """What one device group computes and communicates per micro-batch, before pricing."""

    fwd: tuple  # ((work class, pieces, priced as phase, cut), tasks), ...
    bwd: tuple  # the backward's, with recomputed forwards
    wgt: tuple  # the weight-gradient part of the backward's (zero-bubble's W), ((work class, pieces, "W", cut), tasks)
    comm: tuple  # ((kind, axis, elements, batch, element bytes, an expert dispatch sent once a node), collectives), ...
    params: tuple  # (((shard axes, tensor-parallel axes), elements), ...): see screen_gradients.zero_axes
    units: tuple  # ((shard axes, (ZeRO-3 units, the largest's elements)), ...)
    saved: tuple[tuple[int, tuple[float, float]], ...]  # (stage, (batch, other) bytes one micro-batch keeps)
    work: float  # the largest operator's working set, batch bytes
    dy: float = 0.0  # output-gradient and saved-input batch bytes of the operators with weights (what
    # zero-bubble's W reads: a product's dW = dY^T X)
    # a recomputed group's forward runs again just before its backward and keeps for it what it would
    # have saved: the largest such group's saved batch bytes, and the largest working set of a recomputed task
    regrow: float = 0.0
    regrow_work: float = 0.0
    # activation offload: the (batch, other) bytes of one micro-batch's saved activations the group's
    # offloaded operators copy to the host and back (left out of ``saved``)
    offloaded: tuple[float, float] = (0.0, 0.0)


@dataclass
class Structure:
    """What the screen prices of one plan: each device group's profile, and the messages between groups."""

    profiles: list[ScreenProfile]  # per device group of the pipeline
    ids: list[int]  # per group: its profile's number (equal profiles, equal numbers)
    p2p: list[tuple]  # per group: ((elements, batch, element bytes, peer group), transfers), ...


def _first(keys: np.ndarray) -> np.ndarray:
    """Positions of the first occurrence of each value of ``keys``, in order."""
    _, first = np.unique(keys, return_index=True)
    first.sort()
    return first


def _per_group(groups: np.ndarray, keys: np.ndarray, G: int, ids: Ids, weights: np.ndarray | None = None) -> list:
    """Per group, ``((value of key, count or sum of weights), ...)`` sorted by value."""
    out: list[list] = [[] for _ in range(G)]
    if len(keys):
        k = len(ids.values) + 1
        u, inv = np.unique(groups * k + keys, return_inverse=True)
        tot = np.bincount(inv.ravel(), weights=weights)
        for code, x in zip(u.tolist(), tot.tolist()):
            out[code // k].append((ids.values[code % k], x if weights is not None else int(x)))
    return [tuple(sorted(o)) for o in out]


def _units(groups: np.ndarray, red: np.ndarray, unit: np.ndarray, elems: np.ndarray, G: int, ids: Ids) -> list:
    """Per group, ``((shard axes, (units, the largest unit's elements)), ...)``: a ZeRO-3 unit (a
    layer) holds its weights of every reduction grouping (``red``) that shards over those axes."""
    out: list[dict] = [{} for _ in range(G)]
    if len(red):
        shard: dict[int, int] = {}
        red = np.array([shard.setdefault(r, ids.of(ids.values[r][0])) for r in red.tolist()], dtype=np.int64)
        nu, nr = int(unit.max()) + 1, len(ids.values) + 1
        u, inv = np.unique((groups * nr + red) * nu + unit, return_inverse=True)
        tot = np.bincount(inv.ravel(), weights=elems)
        for code, x in zip(u.tolist(), tot.tolist()):
            r, rd = divmod(code // nu, nr)
            n, big = out[r].get(rd, (0, 0.0))
            out[r][rd] = (n + 1, max(big, x))
    return [tuple(sorted((ids.values[rd], v) for rd, v in o.items())) for o in out]


def colocated(sp: Split, pieces: np.ndarray, ids: Ids) -> Split:
    """``sp`` with each operator's work in ``pieces[i]`` times smaller tasks (co-located pieces,
    run one after another: ``aggregate`` counts them ``pieces[i]`` times)."""
    keys = {}
    at = np.nonzero(pieces > 1)[0]
    span = int(pieces.max()) + 1
    for name in ("fkey", "bkey", "wkey"):
        old = getattr(sp, name)
        new = old.copy()
        sel = at[old[at] >= 0]
        # each distinct (key, pieces) once: operators of a class repeat over the layers
        pairs, inv = np.unique(old[sel] * span + pieces[sel], return_inverse=True)
        made = []
        for code in pairs.tolist():
            w, n, ph, cut = ids.values[code // span]
            made.append(ids.of((w, n * (code % span), ph, cut)))
        new[sel] = np.array(made, dtype=np.int64)[inv.ravel()] if made else new[sel]
        keys[name] = new
    return dataclasses.replace(sp, **keys)


def _offloaded(grp, s_op, s_bytes, key, first, offs, G: int) -> tuple[np.ndarray, np.ndarray]:
    """Activation offload: per group the (batch, other) bytes of the saved buffers (``first``: each
    once per group, ``key`` the group's key of each) that only offloaded operators keep, and
    ``first`` without them."""
    offloaded = np.zeros((G, 2))
    if offs is None:
        return offloaded, first
    moved = offs[s_op][first]
    stays = set(key[~offs[s_op]].tolist())  # what an operator that is not offloaded keeps stays
    moved &= np.array([k not in stays for k in key[first].tolist()], dtype=bool)
    np.add.at(offloaded, grp[s_op[first][moved]], s_bytes[first][moved])
    return offloaded, first[~moved]


def aggregate(
    t: Tables,
    sp: Split,
    stage: np.ndarray,
    rcs: np.ndarray,
    G: int,
    ids: Ids,
    pieces: np.ndarray | None = None,
    offs: np.ndarray | None = None,
    gone: np.ndarray | None = None,
) -> Structure:
    """Per device group (stage ``s`` runs on group ``s % G``), the profile of one micro-batch;
    ``pieces[i]``: tasks operator ``i`` runs in turn per micro-batch (co-located pieces; None: 1);
    ``offs[i]``: operator ``i``'s saved activations are offloaded to the host (None: none are);
    ``gone[j]``: saved buffer ``j`` is remade for its readers' backward (None: none is)."""
    grp = stage % G
    rc = (rcs != 0) & ~t.fwd_only  # a pass without backward has nothing to recompute
    hb = t.has_backward
    task = np.arange(t.n) if pieces is None else np.repeat(np.arange(t.n), pieces)  # operator of each task
    tg, trc, thb = grp[task], rc[task], hb[task]
    fwd = _per_group(tg, sp.fkey[task], G, ids)
    # the backward, and a recomputed operator's forward again before it
    bwd = _per_group(
        np.concatenate([tg[thb], tg[trc]]), np.concatenate([sp.bkey[task][thb], sp.fkey[task][trc]]), G, ids
    )
    w = thb & (sp.wkey[task] >= 0)
    wgt = _per_group(tg[w], sp.wkey[task][w], G, ids)
    params = _per_group(grp[sp.p_op], sp.p_red, G, ids, sp.p_elems)
    units = _units(grp[sp.p_op], sp.p_red, sp.p_unit, sp.p_elems, G, ids)
    work = np.zeros(G)  # the largest working set of one task (a co-located piece's is 1/pieces of its operator's)
    np.maximum.at(work, grp, sp.work if pieces is None else sp.work / pieces)
    wop = hb & (sp.wkey >= 0)  # operators with a weight-gradient part
    dy = np.bincount(grp[wop], weights=sp.work[wop], minlength=G)
    # saved activations: each buffer once per group (several operators may save one), not when recomputed
    keep = ~rc[sp.s_op] if gone is None else ~rc[sp.s_op] & ~gone
    s_op, s_bytes, s_key = sp.s_op[keep], sp.s_bytes[keep], sp.s_key[keep]
    key = grp[s_op] * (len(ids.values) + 1) + s_key  # a buffer in a group
    offloaded, first = _offloaded(grp, s_op, s_bytes, key, _first(key), offs, G)
    add_stage, add_bytes = [stage[s_op[first]]], [s_bytes[first]]
    xw = wop[s_op[first]]  # inputs saved by operators with weights
    if xw.any():
        dy += np.bincount(grp[s_op[first][xw]], weights=s_bytes[first][xw, 0], minlength=G)
    # edges: across stages, a transfer (once per tensor and receiving stage); within one, conversions
    sp_, sc = stage[t.e_producer], stage[t.e_consumer]
    cross = sp_ != sc
    xe = np.nonzero(cross)[0]
    xe = xe[_first(t.e_tensor[xe] * (int(stage.max()) + 1) + sc[xe])] if len(xe) else xe
    p2p: list[dict] = [{} for _ in range(G)]
    for j in xe.tolist():
        a, b = int(sp_[j]) % G, int(sc[j]) % G
        e = t.edges[j]
        for r, peer in ((b, a), (a, b)):  # the activation, then its gradient
            key = (float(sp.recv[j]), e.batch, e.ebytes, peer)
            p2p[r][key] = p2p[r].get(key, 0) + 1
    same = ~cross
    cf = same[sp.cf_edge]
    cb = same[sp.cb_edge]
    comm = _per_group(
        np.concatenate([sc[sp.cf_edge[cf]], sp_[sp.cb_edge[cb]]]) % G,
        np.concatenate([sp.cf_key[cf], sp.cb_key[cb]]),
        G,
        ids,
    )
    # a recomputed consumer runs again from a received tensor, or from an input read from outside its
    # recomputed group (each once per group): it keeps them
    rx = xe[rc[t.e_consumer[xe]]]
    outside = same & rc[t.e_consumer] & (rcs[t.e_producer] != rcs[t.e_consumer])
    if pieces is not None:  # co-located pieces recomputed on their own read what their layer's recomputation remade
        outside &= ~((pieces[t.e_consumer] > 1) & rc[t.e_producer])
    inside = np.nonzero(outside)[0]
    if len(inside):
        inside = inside[_first((sc[inside] % G) * (len(t.edges) + 1) + t.e_tensor[inside])]
    held = np.sort(np.concatenate([rx, inside]))
    if len(held):
        elems = np.where(cross[held], sp.recv[held], sp.keep[held]) * t.e_ebytes[held]
        b = t.e_batch[held]
        add_stage.append(sc[held])
        add_bytes.append(np.stack([np.where(b, elems, 0.0), np.where(b, 0.0, elems)], axis=1))
    st = np.concatenate(add_stage)
    by = np.concatenate(add_bytes)
    n_st = int(stage.max()) + 1
    touched = np.bincount(st, minlength=n_st)
    sb = np.bincount(st, weights=by[:, 0], minlength=n_st)
    so = np.bincount(st, weights=by[:, 1], minlength=n_st)
    saved: list[list] = [[] for _ in range(G)]
    for s in np.nonzero(touched)[0].tolist():
        saved[s % G].append((s, (float(sb[s]), float(so[s]))))
    regrow, regrow_work = _regrown(sp, grp, rc, rcs, G, ids, task, trc, pieces)
    profiles = [
        ScreenProfile(
            *(fwd[r], bwd[r], wgt[r], comm[r], params[r], units[r], tuple(saved[r]), float(work[r]), float(dy[r])),
            float(regrow[r]),
            float(regrow_work[r]),
            (float(offloaded[r, 0]), float(offloaded[r, 1])),
        )
        for r in range(G)
    ]
    return Structure(profiles, [], [tuple(sorted(p.items())) for p in p2p])


def _regrown(
    sp: Split,
    grp: np.ndarray,
    rc: np.ndarray,
    rcs: np.ndarray,
    G: int,
    ids: Ids,
    task: np.ndarray,
    trc: np.ndarray,
    pieces: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray]:
    """Per device group, the batch bytes the largest recomputed group saves again when its forward
    reruns before its backward (each buffer once), and the largest working set of a recomputed task."""
    regrow, rwork = np.zeros(G), np.zeros(G)
    works = sp.work[task] if pieces is None else (sp.work / pieces)[task]
    np.maximum.at(rwork, grp[task][trc], works[trc])
    sel = rc[sp.s_op]
    if not sel.any():
        return regrow, rwork
    ops, nbytes = sp.s_op[sel], sp.s_bytes[sel, 0]
    span = int(rcs.max()) + 1
    owner = grp[ops] * span + rcs[ops]  # (device group, recompute group)
    first = _first(owner * (len(ids.values) + 1) + sp.s_key[sel])
    u, inv = np.unique(owner[first], return_inverse=True)
    np.maximum.at(regrow, u // span, np.bincount(inv.ravel(), weights=nbytes[first]))
    return regrow, rwork
