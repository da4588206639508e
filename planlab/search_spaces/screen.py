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
recomputation; ``screen_structure``) is computed once per structure and shared by every plan that differs only in the
number of micro-batches, the ZeRO stage or the schedule: a few microseconds per plan after that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from planlab.costmodel import CostModel
from planlab.costmodel.host import copy_time_s, host_of
from planlab.gcpause import paused_gc
from planlab.graph.ir import Graph
from planlab.plan.passes.gradients import BUCKET_ELEMENTS
from planlab.plan.program import Precision
from planlab.plan.expert_dispatch import node_share, routing_of
from planlab.plan.fused_gemms import output_width
from planlab.search_spaces.schedule_walks import (
    flight_counts,
    in_flight,
    paired_actions,
    paired_interleaved,
    zb_counts,
)
from planlab.search_spaces.schedules_v import V_SCHEDULES, v_rank
from planlab.search_spaces.screen_structure import (
    aggregate,
    Ids,
    ScreenProfile,
    split_work,
    Split,
    Structure,
    Tables,
    colocated,
    local_shapes,
)
from planlab.search_spaces.space import Draft


def pipeline_view(d: Draft) -> Draft:
    """A draft with operators on every device (``Draft.spread``, the interlaced pipeline) as the
    screen sees it: each on the nearest pipeline group (the embedding on the first, the output
    layer on the last), split as the mesh axes split it, under 1F1B. A rough estimate (it puts the
    shared stages' work and weights on one group), enough to rank such plans for simulation."""
    import dataclasses

    last = d.groups - 1
    stages = {op: min(max(s - d.stage_base, 0), last) for op, s in d.stages.items()}
    return dataclasses.replace(d, stages=stages, spread={}, stage_base=0, schedule="1f1b")


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
        return (
            f"~{self.time_s * 1e3:.1f} ms, ~{self.mem_bytes / 2**30:.2f} GiB (compute {self.compute_s * 1e3:.1f} "
            f"ms, comm {self.comm_s * 1e3:.1f} ms, bubble {self.bubble_s * 1e3:.1f} ms)"
        )


@dataclass(frozen=True)
class _Priced:
    fwd_s: float
    bwd_s: float
    comm_s: float  # collectives on the critical path, and ZeRO-3's gathers the computation does not hide
    sync_s: float  # exposed gradient reduction or ZeRO collectives, and the optimizer step
    static_bytes: float
    wgt_s: float = 0.0  # the weight-gradient part of bwd_s (zero-bubble's W)
    gathered_bytes: float = 0.0  # ZeRO-3: a prefetched unit's weights and a unit's full gradient, besides static
    a2a_s: float = 0.0  # the all-to-alls among comm_s (the expert dispatch and combine)


class Screen:
    """Estimates plans of one graph and cluster; ``estimate(draft)`` costs microseconds once
    the draft's structure has been seen."""

    def __init__(self, graph: Graph, cost: CostModel, precision: Precision) -> None:
        self.graph, self.cost, self.prec = graph, cost, precision
        # the graph's tables, once per precision and software (the graph's memo: shared by every Screen of it)
        self.t = graph.memo(
            ("screen tables", precision, cost.software), lambda: Tables(graph, precision, cost.software)
        )
        self._splits: dict[Any, Split] = {}
        self._structures: dict[Any, Structure] = {}
        self._arrays: dict[tuple, np.ndarray] = {}  # per operator: recompute groups, co-located pieces (by key number)
        self._priced: dict[tuple, _Priced] = {}
        self._micro: dict[tuple, tuple] = {}
        self._grad: dict[tuple, tuple] = {}
        self._zero3: dict[tuple, tuple] = {}
        self._profile_ids: dict[ScreenProfile, int] = {}
        self._ids: dict[int, tuple[Any, int]] = {}
        self._numbers: dict[tuple, int] = {}
        self._values = Ids()  # the keys of splits and profiles
        self._compute: dict[tuple, float] = {}
        self._coll: dict[tuple, float] = {}
        self._p2p: dict[tuple, float] = {}
        self._schedules: dict[tuple, Any] = {}  # walks of the pipeline schedules (flight_counts, ...), by shape
        self._routing = routing_of(graph)  # the routed layers' selection (expert dispatch sent once a node)
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

    def structure(self, d: Draft) -> Structure:
        names = self.t.names
        sizes = tuple(s for _, s in d.axes)
        axis_dims = d.op_dims()
        ring = frozenset(i for i, n in enumerate(names) if n in d.ring) if d.ring else frozenset()
        skey = (sizes, tuple(self._key(ad) for ad in axis_dims), ring)
        split = self._splits.get(skey)
        if split is None:
            split = self._splits[skey] = split_work(self.t, sizes, axis_dims, self._values, ring)
        if not d.stages:
            stages = None
        elif len(d.stages) == len(names) and list(d.stages) == names:
            stages = tuple(d.stages.values())  # every operator, in graph order: the values will do
        else:
            stages = tuple(d.stages.get(n, 0) for n in names)
        if stages and d.vshape:  # stage s on group s % G as chunk s // G: the V's way back numbered G + group
            G = d.groups
            stages = tuple(s if s < G else G + v_rank(s, G) for s in stages)
        rc = (tuple(d.recompute.items()), tuple(sorted(d.discard_outputs))) if d.recompute else None
        co = tuple(d.colocate.items()) if d.colocate else None  # (op, (dim, k)): k is what counts
        off = tuple(sorted(d.offload_acts)) if d.offload_acts else None
        key = (
            skey,
            self._numbers.setdefault(stages, len(self._numbers)),
            self._numbers.setdefault(rc, len(self._numbers)),
            d.groups,
            self._numbers.setdefault(co, len(self._numbers)),
            self._numbers.setdefault(off, len(self._numbers)),
        )
        got = self._structures.get(key)
        if got is None:
            n = self.t.n
            rcs = self._arrays.get(("rc", key[2]))  # plans of several structures share their recomputation
            if rcs is None:
                rcs = self._arrays[("rc", key[2])] = np.array(
                    [d.recompute.get(x, 0) for x in names] if rc else [0] * n, dtype=np.int64
                )
            pieces = None
            if co:  # coshard: the base split's work in k tasks of 1/k each, recomputed (d.recompute says so)
                pieces = self._arrays.get(("co", key[4]))
                if pieces is None:
                    pieces = self._arrays[("co", key[4])] = np.array(
                        [d.colocate[x][1] if x in d.colocate else 1 for x in names], dtype=np.int64
                    )
                split = self._splits.get((skey, key[4]))
                if split is None:
                    split = self._splits[(skey, key[4])] = colocated(self._splits[skey], pieces, self._values)
            offs = np.array([x in d.offload_acts for x in names], dtype=bool) if off else None
            gone = self._discarded(d, names, split) if rc and d.discard_outputs else None
            got = self._structures[key] = aggregate(
                self.t,
                split,
                np.array(stages or [0] * n, dtype=np.int64),
                rcs,
                d.groups,
                self._values,
                pieces,
                offs,
                gone,
            )
            got.ids = [self._profile_ids.setdefault(p, len(self._profile_ids)) for p in got.profiles]
        return got

    def _discarded(self, d, names, split) -> np.ndarray:
        """Per saved buffer of ``split``, whether it is an output of a recompute group whose outputs
        are discarded too (``Draft.discard_outputs``): its readers keep the remade one instead."""
        groups = set(d.discard_outputs)
        made = {t for x in names if d.recompute.get(x, 0) in groups for t in self.graph.op(x).outputs}
        return np.array([self._values.values[k][0] in made for k in split.s_key.tolist()], dtype=bool)

    # -- prices ------------------------------------------------------------------------
    def _compute_s(self, work: int, pieces: int, m: int, phase: str, cut: tuple = ()) -> float:
        """The device's seconds for one piece of a work class in ``phase`` (see :meth:`_compute_dh`)."""
        return self._compute_dh(work, pieces, m, phase, cut)[0]

    def _compute_dh(self, work: int, pieces: int, m: int, phase: str, cut: tuple = ()) -> tuple[float, float]:
        """(device, host) seconds of one piece of a work class, one micro-batch of ``m``, in ``phase``
        (F, B, or zero-bubble's I and W parts), its dimensions split by ``cut`` ((dimension, pieces),
        ...): the roofline on the piece's share of the flop and bytes, times the implementation's
        factor over the roofline at the piece's shapes (its kernels' tiles and waves and extra passes,
        as the kernel model prices them for the simulator; 1 off the kernel level), and the host's
        issue time."""
        key = (work, pieces, m, phase, cut)
        got = self._compute.get(key)
        if got is None:
            flops, nbytes, ratio, share = self.t.works[work][:4]
            if phase == "B":
                flops *= ratio
            elif phase == "W":  # the weight-gradient part of the backward (zero-bubble's split)
                flops, nbytes = flops * ratio * share, nbytes * share
            elif phase == "I":  # the rest, the input gradients
                flops, nbytes = flops * ratio * (1 - share), nbytes * (1 - share)
            # the factor at the split's piece (``cut``); co-located pieces (coshard) divide it further,
            # ``pieces`` over the split's, and take its factor
            base = math.prod(n for _, n in cut)
            factor, host = self._kernel_factor(work, phase, flops / m / base, nbytes / m / base, cut, m)
            dev = (
                factor
                * self.cost.compute_time_s(flops=flops / m / pieces, bytes_moved=nbytes / m / pieces, dtype=self.dtype)
                if (flops or nbytes)
                else 0.0
            )
            got = self._compute[key] = (dev, host)
        return got

    def _kernel_factor(
        self, work: int, phase: str, flops: float, nbytes: float, cut: tuple, m: int
    ) -> tuple[float, float]:
        """The kernel model's device time over the roofline's for a piece of the operator (``flops``
        and ``nbytes``, its dimensions split by ``cut``, the batch over ``m``) in ``phase``,
        and the host's time to issue it (1.0 and 0.0 off the kernel level): the cost model prices a
        Task with the fields materialize and the software's passes give the simulator's (its fused
        GEMM's share, a fused token permutation's operators inside their kernels: no time)."""
        from planlab.plan.buffer import contribution, weight_grad
        from planlab.plan.program import Task, TaskKind
        from planlab.plan.saved import step_microbatches

        kind, whole, causal, fusion, widths, in_kernel, weight_matmul, output_layer = self.t.works[work][4:12]
        if not self.cost.host_bound:  # the roofline: only what runs inside another kernel changes it
            return (0.0 if in_kernel else 1.0), 0.0
        op = self.t.work_op[work]
        shapes = local_shapes(self.graph, op, cut, m)
        if widths:  # the fused group's local widths: each whole width as this projection's is cut
            own = output_width(kind, whole[1])
            widths = tuple(w * output_width(kind, shapes[1]) // own for w in widths)
        weights = self.t.work_params.get(work, False)
        x, w = contribution("x", "op", 0), weight_grad("w")  # what gradient_parts asks: their kinds
        writes = {
            "F": (),
            "B": (x,) + ((w,) if weights else ()),
            "I": (x,),
            "W": (None, w),
        }[phase]
        task = Task(
            "screen",
            TaskKind.FORWARD if phase == "F" else TaskKind.BACKWARD,
            writes=writes,
            flops=flops,
            bytes_moved=nbytes,
            op_kind=kind,
            shapes=shapes,
            causal=causal,
            fusion=fusion,
            fused_widths=widths,
            in_kernel=in_kernel,
            weight_matmul=weight_matmul,
            output_layer=output_layer,
            step_microbatches=step_microbatches(kind, weight_matmul, m),  # as forward_pieces gives it
        )
        dev, host = self.cost.device_and_host_s(task, self.dtype)
        roof = self.cost.compute_time_s(flops=flops, bytes_moved=nbytes, dtype=self.dtype) if (flops or nbytes) else 0.0
        return (dev / roof if roof > 0 else 1.0), host

    @staticmethod
    def _group(axes: tuple[int, ...], sizes: tuple[int, ...], order: tuple[int, ...] = ()) -> tuple[int, ...]:
        """The devices of the first group along ``axes`` of the first stage's mesh (row-major, or
        placed by ``order``: ``Draft.stage_order``)."""
        strides = [math.prod(sizes[a + 1 :]) for a in range(len(sizes))]
        members = [0]
        for a in axes:
            members = [m + k * strides[a] for m in members for k in range(sizes[a])]
        return tuple(sorted(order[m] for m in members) if order else sorted(members))

    def _coll_s(
        self,
        kind: str,
        nbytes: float,
        axes: tuple[int, ...],
        sizes: tuple[int, ...],
        order: tuple[int, ...] = (),
        dispatch: bool = False,
    ) -> float:
        """A collective's seconds on the first group along ``axes``; ``dispatch``: a routed layer's
        all-to-all that the software sends once to each node (its share of the bytes for other nodes
        that crosses the network, as :func:`planlab.plan.expert_dispatch.dedup_expert_dispatch` marks it)."""
        key = (kind, nbytes, axes, sizes, order, dispatch)
        got = self._coll.get(key)
        if got is None:
            group = self._group(axes, sizes, order)
            share = node_share(self._routing, len({self.cost.cluster.node_of(d) for d in group})) if dispatch else 1.0
            if share < 1.0:
                got = self.cost.collective_time_s(kind, nbytes, group, share)
            else:
                got = self.cost.collective_time_s(kind, nbytes, group)
            self._coll[key] = got
        return got

    def _p2p_s(self, nbytes: float, src: int, dst: int, per: int) -> float:
        key = (nbytes, src, dst, per)
        got = self._p2p.get(key)
        if got is None:
            got = self._p2p[key] = self.cost.p2p_time_s(nbytes, src * per, dst * per)
        return got

    def _price(
        self,
        p: ScreenProfile,
        pid: int,
        sizes: tuple[int, ...],
        m: int,
        zero: int,
        zb: bool,
        regather: bool = False,
        order: tuple[int, ...] = (),
        offload: bool = False,
    ) -> _Priced:
        key = (pid, sizes, m, zero, zb, regather, order, offload)
        got = self._priced.get(key)
        if got is None:
            f, b, cm, w, split, a2a = self._micro_s(p, pid, sizes, m, order)
            if zb:
                b += split
            fixed, ar, last, opt_s, static, gathered = self._grads(p, pid, sizes, zero, order, offload)
            if zero >= 3:  # per micro-batch, each unit gathered twice and its gradient reduce-scattered, one
                zc, first = self._units_s(
                    p, pid, sizes, regather, order
                )  # unit ahead: computation hides all but the first
                cm += max(first, zc - (f + b))
            # buckets overlap the last micro-batch's backward, the last one does not; a software that
            # all-reduces after the backward (Megatron-LM's default) exposes them all
            exposed = max(last, ar - b) if self.cost.software.grad_reduce == "overlapped" else ar
            got = self._priced[key] = _Priced(f, b, cm, fixed + exposed + opt_s, static, w, gathered, a2a)
        return got

    def walked(self, walk, *shape):
        """``walk(*shape)``, a pure walk of a pipeline schedule (:func:`flight_counts`,
        :func:`paired_actions`, ...), once per screen: plans of one shape share it."""
        key = (walk, *shape)
        got = self._schedules.get(key)
        if got is None:
            got = self._schedules[key] = walk(*shape)
        return got

    def regathers(self, d: Draft) -> bool:
        """Whether ZeRO-3 gathers a unit's weights again for its recomputation under ``d``."""
        return d.zero >= 3 and bool(d.recompute) and self.cost.software.zero3_regather_for_recompute

    def p2p_in_s(self, s: Structure, r: int, m: int, per: int, ranks: int = 0) -> float:
        """Seconds of the pipeline transfers into device group ``r`` per micro-batch (groups of ``per``
        devices); ``ranks`` takes groups modulo that many pipeline ranks (a probe with more groups
        than the cluster has)."""

        def rank(g: int) -> int:
            return g % ranks if ranks else g

        return sum(
            n * self._p2p_s(numel / (m if batch else 1) * eb, rank(src), rank(r), per)
            for (numel, batch, eb, src), n in s.p2p[r]
        )

    def _micro_s(
        self, p: ScreenProfile, pid: int, sizes: tuple[int, ...], m: int, order: tuple[int, ...] = ()
    ) -> tuple[float, ...]:
        """Forward, backward, collectives, the backward's weight-gradient part, what splitting the
        backward into two tasks per operator adds (smaller kernels), and the all-to-alls among the
        collectives, one micro-batch of ``m``."""
        key = (pid, sizes, m, order)
        got = self._micro.get(key)
        if got is None:
            # the device waits for the host where the host is slower (planlab.costmodel.host_bound_elapsed_s)
            f = self._block_s(p.fwd, m)
            b = self._block_s(p.bwd, m)
            each = [
                (kind, c * self._coll_s(kind, numel / (m if batch else 1) * eb, (axis,), sizes, order, dispatch))
                for (kind, axis, numel, batch, eb, dispatch), c in p.comm
            ]
            cm = sum(t for _, t in each)
            a2a = sum(t for kind, t in each if kind == "all_to_all")
            wg = split = 0.0
            for (w, pieces, _, cut), c in p.wgt:
                one = self._compute_s(w, pieces, m, "W", cut)
                wg += c * one
                split += c * (self._compute_s(w, pieces, m, "I", cut) + one - self._compute_s(w, pieces, m, "B", cut))
            got = self._micro[key] = (f, b, cm, wg, split, a2a)
        return got

    def _block_s(self, entries, m: int) -> float:
        """A block's compute: the device's time, or the host's to issue it where that is longer."""
        dev = host = 0.0
        for (w, pieces, ph, cut), c in entries:
            d, h = self._compute_dh(w, pieces, m, ph, cut)
            dev, host = dev + c * d, host + c * h
        return max(dev, host)

    def _units_s(
        self, p: ScreenProfile, pid: int, sizes: tuple[int, ...], regather: bool = False, order: tuple[int, ...] = ()
    ) -> tuple[float, float]:
        """ZeRO-3 per micro-batch: (every unit's weight all-gathers, two or with ``regather`` three
        (the recomputed forward gathers again), and gradient reduce-scatter, the first unit's gathers
        in the forward and the backward), seconds."""
        key = (pid, sizes, regather, order)
        got = self._zero3.get(key)
        if got is None:
            prec = self.prec
            total = first = 0.0
            for axes, (n_units, _) in p.units:
                if math.prod(sizes[a] for a in axes) == 1:
                    continue
                mine = [(tp, e / n_units) for (shard, tp), e in p.params if shard == axes]  # units are alike (layers)
                elems = sum(e for _, e in mine)
                ag = self._coll_s("all_gather", elems * prec.param_bytes, axes, sizes, order)
                gathers = 3 if regather else 2
                total += n_units * (
                    gathers * ag + self._coll_s("reduce_scatter", elems * prec.grad_bytes, axes, sizes, order)
                )
                for tp, e in mine:  # what tensor parallelism sums first (FSDP2's post-backward redistribute)
                    if math.prod(sizes[a] for a in tp) > 1:
                        total += n_units * self._coll_s("all_reduce", e * prec.grad_bytes, tp, sizes, order)
                first = max(first, 2 * ag)
            got = self._zero3[key] = (total, first)
        return got

    def _grads(
        self,
        p: ScreenProfile,
        pid: int,
        sizes: tuple[int, ...],
        zero: int,
        order: tuple[int, ...] = (),
        offload: bool = False,
    ) -> tuple:
        """``(ZeRO's collectives, all-reduces in all, the last bucket's, the optimizer step, static
        bytes, ZeRO-3's gathered bytes)`` of the group's parameters (seconds, bytes); with
        ``offload`` (ZeRO-Offload) the optimizer's states leave the device and the step is the
        copies over the host link and Adam on the host CPU."""
        key = (pid, sizes, zero, order, offload)
        got = self._grad.get(key)
        if got is not None:
            return got
        prec = self.prec
        sync = opt = static = ar = last = gathered = 0.0
        units = dict(p.units)
        unit_groups: set[tuple[int, ...]] = set()
        for (shard, tp), elems in p.params:
            # ZeRO shards over the data-parallel axes after a sum over the tensor-parallel ones; without
            # ZeRO one all-reduce over both (plan.passes.gradients.zero_groups)
            axes = shard if zero else tuple(sorted(shard + tp))
            n_red = math.prod(sizes[a] for a in axes)
            if zero and n_red > 1 and math.prod(sizes[a] for a in tp) > 1 and zero < 3:
                sync += self._coll_s("all_reduce", elems * prec.grad_bytes, tp, sizes, order)  # in the update block
            static += elems * (prec.param_bytes + prec.grad_bytes + prec.optimizer_bytes)
            if n_red > 1 and zero >= 3:
                # weights, gradients and states sharded; the unit computed is gathered (static: a lower
                # bound), the next one prefetched and a unit's full gradient alive (gathered)
                static -= elems * (prec.param_bytes + prec.grad_bytes + prec.optimizer_bytes) * (n_red - 1) / n_red
                if shard not in unit_groups:  # a unit holds its weights of every grouping sharded alike
                    unit_groups.add(shard)
                    big = units[shard][1]
                    static += big * prec.param_bytes
                    gathered = max(gathered, big * (prec.param_bytes + prec.grad_bytes))
                    sync = max(
                        sync, self._coll_s("reduce_scatter", big * prec.grad_bytes, axes, sizes, order)
                    )  # the last unit's
                opt += elems / n_red
                continue
            if n_red > 1 and zero:
                sync += self._coll_s("reduce_scatter", elems * prec.grad_bytes, axes, sizes, order)
                sync += self._coll_s("all_gather", elems * prec.param_bytes, axes, sizes, order)
                static -= elems * prec.optimizer_bytes * (n_red - 1) / n_red
                if zero >= 2:
                    static -= elems * prec.grad_bytes * (n_red - 1) / n_red
                opt += elems / n_red
                continue
            opt += elems
            if n_red > 1:
                nb = max(1, math.ceil(elems / BUCKET_ELEMENTS))
                one = self._coll_s("all_reduce", elems * prec.grad_bytes / nb, axes, sizes, order)
                ar += nb * one
                last = max(last, one)
        per_param = prec.optimizer_pass_bytes or (2 * prec.param_bytes + prec.grad_bytes + 2 * prec.optimizer_bytes)
        opt_s = (
            self.cost.compute_time_s(flops=12.0 * opt, dtype=self.dtype, bytes_moved=opt * per_param) if opt else 0.0
        )
        if offload and opt:
            host = host_of(self.cost.cluster)
            static -= opt * prec.optimizer_bytes
            opt_s = copy_time_s(host, opt * (prec.grad_bytes + prec.param_bytes)) + opt / host.adam_params_per_s
        got = self._grad[key] = (sync, ar, last, opt_s, static, gathered)
        return got

    def _rings_s(self, d: Draft, sizes: tuple[int, ...], m: int) -> list[float]:
        """Per device group, what running its ring attentions as rings (``Draft.ring``) adds per
        micro-batch to their forward and backward priced as one piece each: the ring's steps at the pace of
        its slowest rank, overlapped with the key/value transfers (``CostModel.ring_attention_s``)."""
        out = [0.0] * d.groups
        if not d.ring:
            return out
        axis = next(a for a, (name, _) in enumerate(d.axes) if name == "cp")
        group = self._group((axis,), sizes, d.stage_order)
        per_axis = d.op_dims()
        for i, op in enumerate(self.graph.operators):
            if op.name not in d.ring:
                continue
            dims = tuple(ad[i] for ad in per_axis)
            key = ("ring", self.t.work_class[i], sizes, dims, m, group, d.zigzag, d.kv_gather)
            got = self._compute.get(key)
            if got is None:
                got = self._compute[key] = self._ring_extra_s(op, i, dims, sizes, m, group, d)
            out[d.group_of(d.stages.get(op.name, 0))] += got
        return out

    def _ring_extra_s(
        self, op, i: int, dims: tuple, sizes: tuple[int, ...], m: int, group: tuple[int, ...], d: Draft
    ) -> float:
        """One ring attention's forward and backward as a ring on ``group`` (``d.zigzag``: balanced;
        ``d.kv_gather``: by all-gather), less the same priced as one piece."""
        from planlab.plan.plan import causal_attention
        from planlab.plan.program import Ring, Task, TaskKind

        work = self.t.work_class[i]
        flops, nbytes, ratio, _, kind, _ = self.t.works[work][:6]
        pieces = math.prod(n for dim, n in zip(dims, sizes) if dim is not None)
        cut = tuple((dim, n) for dim, n in zip(dims, sizes) if dim is not None and n > 1)
        local = local_shapes(self.graph, op, cut, m, ring=True)  # the piece's shapes: every split, the batch over m
        ring = Ring(len(group), causal_attention(op), zigzag=d.zigzag, gather=d.kv_gather)
        extra = 0.0
        for tk, f, phase in ((TaskKind.FORWARD, flops, "F"), (TaskKind.BACKWARD, flops * ratio, "B")):
            task = Task(
                "screen",
                tk,
                flops=f / m / pieces,
                bytes_moved=nbytes / m / pieces,
                op_kind=kind,
                shapes=tuple(local),
                group=group,
                ring=ring,
            )
            extra += self.cost.ring_attention_s(task, self.dtype)[0] - self._compute_s(work, pieces, m, phase, cut)
        return extra

    # -- the estimate --------------------------------------------------------------------
    def _copies(self, p: ScreenProfile, m: int, c) -> tuple[float, float]:
        """Activation offload, one micro-batch of the group: the seconds of its copies to the host and
        back (each direction on a copy stream of its own) that its computation does not cover, and the offloaded
        bytes still on the device when its forward ends (a copy frees its activations once done)."""
        b, o = p.offloaded
        if not (b or o):
            return 0.0, 0.0
        nbytes = b / m + o
        out_s = copy_time_s(host_of(self.cost.cluster), nbytes)
        # each direction its own stream (PCIe is full duplex): either paces the group beyond its computation
        return max(0.0, out_s - (c.fwd_s + c.bwd_s)), nbytes * max(0.0, 1.0 - c.fwd_s / out_s)

    def estimate(self, d: Draft) -> Estimate:
        """The estimated iteration time and memory of the plan ``d`` describes."""
        with paused_gc():  # keys and arrays per operator, no cycles: the collector would only walk the graph
            return self._estimate(d)

    def _estimate(self, d: Draft) -> Estimate:
        if d.spread:
            d = pipeline_view(d)
        s = self.structure(d)
        sizes = tuple(x for _, x in d.axes)
        per = d.per_group  # devices of a pipeline group (a DualPipe stage spans two groups)
        m, G, v = d.microbatches, d.groups, max(1, d.chunks)
        schedule = d.schedule if v == 1 or d.vshape else "interleaved"
        if d.recycles > 1:  # a chunk per recycling pass: walk the schedule the plan runs (recycling.py)
            schedule = f"recycled:{d.schedule}"
        zb = schedule in ("zb-h1", "zb-v")
        paired = d.paired and d.dispatches_experts and v > 1 and not d.vshape  # as Draft.schedule_actions
        deferred = min(1.0, (m - 1) / max(1, G - 1))
        times, back, fill, syncs, mems, bounds, prices = [], [], [], [], [], [], []
        rings = self._rings_s(d, sizes, m)
        regather = self.regathers(d)
        for r in range(G):
            p = s.profiles[r]
            off = d.offload_optimizer and (not d.offload_stages or r in d.offload_stages)
            c = self._price(p, s.ids[r], sizes, m, d.zero, zb, regather, d.stage_order, off)
            prices.append(c)
            pp = self.p2p_in_s(s, r, m, per)
            exposed_s, unmoved = self._copies(p, m, c)
            times.append(c.fwd_s + c.bwd_s + c.comm_s + pp + rings[r] + exposed_s)
            # ZB-H1 defers the weight-gradient passes W into the bubble: a group's share of it shrinks
            # from F + B to F + I - W (B = I + W) with micro-batches enough to defer (m >= groups; with
            # one, each W only overlaps the I upstream: F + I), and its backward drains as its I passes
            back.append(c.bwd_s - c.wgt_s if zb else c.bwd_s)
            fill.append(max(0.0, times[-1] - (1 + deferred) * c.wgt_s) if zb else times[-1])
            syncs.append(c.sync_s)
            per_chunk = np.zeros(v)  # bytes one micro-batch keeps on each of the group's model chunks
            for stage, (b, o) in p.saved:
                per_chunk[min(v - 1, stage // G)] += b / m + o
            if v == 1 and schedule in ("1f1b", "gpipe"):
                act = in_flight(schedule, r, G, m, v) * per_chunk[0]
            elif schedule == "zb-h1":  # the activations until I; from I to W, what W reads: the output gradients and
                # about as much of the inputs (a product's dW = dY^T X)
                act = float((self.walked(zb_counts, r, G, m) @ np.array([per_chunk[0], p.dy / m])).max())
            else:
                act = float((self.walked(flight_counts, schedule, r, G, m, v, d.group, paired) @ per_chunk).max())
            # the bound: what 1F1B keeps at least (every schedule here keeps as much), of the smallest chunk
            bounds.append(c.static_bytes + min(m, G - r) * float(per_chunk.min()))
            # twice the largest working set, not working_bytes: with the recomputed layer's regrown activations
            # the estimate ran 36-74% over the simulated peak on nnScaler's Swin plans (ZeRO-3, full recompute)
            # and product spaces lost the fitting plans of their factors; the fine program charges it (group_costs)
            mems.append(c.static_bytes + c.gathered_bytes + act + unmoved + 2 * p.work / m)
        if d.mirror:  # DualPipe: group r runs half of stage r and half of stage G - 1 - r, and keeps both's weights
            hidden = self.pairs_hidden_s(d, prices)
            times = [times[r] + times[G - 1 - r] - hidden[r] for r in range(G)]
            mems = [mems[r] + prices[G - 1 - r].static_bytes for r in range(G)]
        elif paired:  # interleaved with paired steady-state steps: each pair hides a chunk's all-to-alls
            times = [t - h for t, h in zip(times, self.pairs_hidden_s(d, prices))]
        t_max = max(times)
        slow = max(range(G), key=lambda r: times[r])
        pipe = m * t_max + (sum(fill) - fill[slow]) / v
        # group r's last backward ends about r backward steps before the first group's (1F1B drains to it)
        total, before = 0.0, 0.0
        for r in range(G):
            total = max(total, pipe - before / v + syncs[r])
            before += back[r]
        worst = max(range(G), key=lambda r: mems[r])
        c = prices[slow]
        return Estimate(
            time_s=total,
            mem_bytes=mems[worst],
            bound_bytes=max(bounds),
            static_bytes=prices[worst].static_bytes,
            compute_s=m * (c.fwd_s + c.bwd_s),
            comm_s=m * c.comm_s,
            p2p_s=m * (times[slow] - c.fwd_s - c.bwd_s - c.comm_s),
            bubble_s=pipe - m * t_max,
            grad_sync_s=max(syncs),
        )

    def pairs_hidden_s(self, d: Draft, prices: list[_Priced]) -> list[float]:
        """Per device group of a mirrored (DualPipe) plan, the seconds per micro-batch its
        forward/backward pairs hide (:mod:`planlab.simulator.pairs`): each pair runs one chunk's
        all-to-alls beside the other's computation, so it hides a chunk's all-to-alls (forward and
        backward, the two stages' average) up to a chunk's computation; pairs only where the plan
        dispatches experts (:attr:`Draft.dispatches_experts`), as many as its schedule overlaps.
        An interleaved plan with paired steady-state steps (``Draft.paired``, Megatron-Core's expert
        all-to-all overlap) hides one of its chunks' all-to-alls per pair alike."""
        G, m = d.groups, d.microbatches
        if not d.dispatches_experts or not (d.schedule in V_SCHEDULES or (d.paired and d.chunks > 1)):
            return [0.0] * G
        if d.schedule not in V_SCHEDULES:  # interleaved: a group's own chunks, prices per micro-batch of all
            return [
                self.walked(paired_interleaved, r, G, m, d.chunks, d.group)
                * min(prices[r].a2a_s, prices[r].fwd_s + prices[r].bwd_s)
                / d.chunks
                / m
                for r in range(G)
            ]
        out = []
        for r in range(G):
            a, z = prices[r], prices[G - 1 - r]
            per_pair = min((a.a2a_s + z.a2a_s) / 2, (a.fwd_s + a.bwd_s + z.fwd_s + z.bwd_s) / 2)
            out.append(self.walked(paired_actions, d.schedule, r, G, m) * per_pair / m)
        return out


@dataclass(frozen=True)
class GroupCost:
    """One pipeline device group's figures from the screen (seconds and bytes per device): its time
    per micro-batch (forward, backward, collectives and pipeline transfers), its gradient
    reduction and optimizer step, its static memory, the activations one micro-batch keeps for
    the backward, and its working set."""

    time_s: float
    sync_s: float
    static_bytes: float
    saved_bytes: float
    work_bytes: float
    p2p_s: float = 0.0  # the pipeline transfers into the group (part of time_s)
    forward_s: float = 0.0  # the forward's part of time_s without p2p_s (its collectives by its share of the compute)


def group_costs(
    screen: Screen, d: Draft, offload: tuple[bool, ...] = (), only: tuple[int, ...] | None = None
) -> list[GroupCost]:
    """Per device group of ``d`` (one model chunk per group), its :class:`GroupCost`; ``offload[r]``
    prices group ``r``'s optimizer in host memory (default: ``d.offload_optimizer``); ``only``: just
    those groups, in that order (each group is priced on its own). The fine-grained space reads
    per-layer costs from it (planlab/search_spaces/fine_costs.py), on a probe with more groups than
    the cluster has: a transfer between groups is priced between the devices of those groups modulo
    the cluster's pipeline ranks."""
    s = screen.structure(d)
    sizes = tuple(x for _, x in d.axes)
    m = d.microbatches
    regather = screen.regathers(d)
    ranks = d.ctx.num_devices // d.per_group
    out = []
    for r in range(d.groups) if only is None else only:
        p = s.profiles[r]
        off = offload[r] if offload else d.offload_optimizer
        c = screen._price(p, s.ids[r], sizes, m, d.zero, False, regather, d.stage_order, off)  # 1F1B: no ZB split
        p2p = screen.p2p_in_s(s, r, m, d.per_group, ranks) if ranks > 1 else 0.0
        saved = sum(b / m + o for _, (b, o) in p.saved)
        work = working_bytes(p) / m + c.gathered_bytes
        busy = c.fwd_s + c.bwd_s
        forward = c.fwd_s + (c.comm_s * c.fwd_s / busy if busy > 0 else 0.0)
        out.append(GroupCost(busy + c.comm_s + p2p, c.sync_s, c.static_bytes, saved, work, p2p, forward))
    return out


def working_bytes(p: ScreenProfile) -> float:
    """Batch bytes a device group holds beyond its saved activations at its peak: twice the largest
    working set (an operator's output and its gradient), or in the backward of a recomputed group
    what its forward, run again, keeps for that backward and twice its largest working set."""
    return max(2 * p.work, p.regrow + 2 * p.regrow_work)
