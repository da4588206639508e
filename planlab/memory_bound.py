"""A plan's memory lower bound without simulating it: the static bytes (weights, gradients,
optimizer states under ZeRO) and the activations saved in flight on its fullest device. The
explorer prunes the plans whose bound exceeds the device's memory and reports it for a plan it
does not simulate (:func:`planlab.explore.evaluate`)."""

from __future__ import annotations

import math

from planlab.costmodel.precision import Precision
from planlab.costmodel.software import SoftwareSpec
from planlab.graph.ir import Graph
from planlab.graph.ir import Operator
from planlab.plan.layout import Mesh
from planlab.plan.materialize import precision_for
from planlab.plan.partial_grads import deferred_axes
from planlab.plan.plan import OpPlan, Plan
from planlab.plan.saved import saved_activations
from planlab.plan.shared_params import forward_only_of


def memory_lower_bound_bytes(
    plan: Plan, graph: Graph, precision: Precision | None = None, software: SoftwareSpec | None = None
) -> tuple[int, int]:
    """``(static, activations)`` bytes on the fullest device, without simulating: weights,
    gradients and optimizer states (ZeRO keeps a 1/n share of the optimizer states, of the
    gradients from stage 2, of the weights at stage 3, where n devices sum a weight's gradient),
    plus the activations saved for the backward (each tensor once per stage, however many
    operators save it; what the ``software``'s implementation keeps, :mod:`planlab.plan.saved`)
    of the micro-batches the device's schedule keeps in flight at its fullest moment (until their
    backward, or its input-gradient part ``I``). ``precision``: the cost model's (default: the
    cluster's, ``precision_for``)."""
    prec = precision or precision_for(plan.cluster)
    m = plan.microbatches
    # device set -> [static bytes, {stage: saved bytes of one micro-batch}, tensors counted]
    by_devices: dict[tuple[int, ...], list] = {}
    fwd_only = forward_only_of(graph)  # recycling: passes without backward keep nothing, share the weights
    plans = {p.op: p for p in plan.ops}
    shards = _ShardAxes(plan, graph)
    gone = discarded_tensors(plan, graph)  # remade for the backward of the operators reading them
    tied: set[tuple[str, frozenset[int]]] = set()  # a tied weight is held once on its devices (shared_params)
    for p in plan.ops:
        acc = by_devices.setdefault(p.devices, [0.0, {}, set()])
        op = graph.op(p.op)
        for t in dict.fromkeys(op.inputs):
            spec = graph.tensors[t]
            if spec.role != "param":
                continue
            if fwd_only:
                if (t, "param") in acc[2]:
                    continue  # held once, however many passes read it
                acc[2].add((t, "param"))
            elif (t, frozenset(p.devices)) in tied:
                continue  # a tied weight's later reader adds into the first's gradient
            else:
                tied.add((t, frozenset(p.devices)))
            held = {ax[0] for ax in op.axes_of(t) if ax}
            cut = math.prod(n for d, n in zip(p.dims, p.sizes) if d is not None and d in held)
            # the gradient is summed over the axes that split a dimension the weight lacks: ZeRO shards
            # over those of them that are data-parallel (planlab.plan.passes.gradients.zero_groups)
            red = math.prod(p.sizes[i] for i in shards.axes(p, op, held)) if plan.zero else 1
            weights = prec.param_bytes / red if plan.zero >= 3 else prec.param_bytes
            grad = prec.grad_bytes / red if plan.zero >= 2 else prec.grad_bytes
            opt = prec.optimizer_bytes / red if plan.zero >= 1 else prec.optimizer_bytes
            opt = 0.0 if plan.offload_optimizer else opt  # ZeRO-Offload: the states are in host memory
            acc[0] += spec.numel / cut * (weights + grad + opt)
        if p.recompute or p.offload or p.op in fwd_only:
            continue  # a recomputed operator keeps nothing for its backward, an offloaded one nothing on the device
        for key, nbytes in saved_activations(op, p, graph, software, prec, m, plans):
            if key not in acc[2] and key[0] not in gone:
                acc[2].add(key)
                acc[1][p.stage] = acc[1].get(p.stage, 0.0) + nbytes
    static = [0.0] * plan.num_devices
    saved: list[dict[int, float]] = [{} for _ in range(plan.num_devices)]
    for devs, (st, sv, _) in by_devices.items():
        for dev in devs:
            static[dev] += st
            for s, b in sv.items():
                saved[dev][s] = saved[dev].get(s, 0.0) + b
    peaks: dict[tuple, float] = {}
    worst = (0.0, 0.0)
    for dev in range(plan.num_devices):
        sched = plan.schedule[dev] if plan.schedule and plan.schedule[dev] else None
        key = (id(sched), tuple(sorted(saved[dev].items())))
        if key not in peaks:
            peaks[key] = _activation_peak(sched, saved[dev], m)
        total = (static[dev], peaks[key])
        if sum(total) > sum(worst):
            worst = total
    return int(worst[0]), int(worst[1])


def discarded_tensors(plan: Plan, graph: Graph) -> frozenset[str]:
    """The outputs of the operators of a plan's recompute groups whose outputs are discarded too
    (``Plan.discard_outputs``): no operator keeps them across the step's forward and backward."""
    if not plan.discard_outputs:
        return frozenset()
    groups = set(plan.discard_outputs)
    return frozenset(t for p in plan.ops if p.recompute in groups for t in graph.op(p.op).outputs)


def _activation_peak(schedule, saved: dict[int, float], m: int) -> float:
    """The most saved-activation bytes alive at once under ``schedule`` (None: every micro-batch's
    forwards first, as materialize orders a plan without one)."""
    if schedule is None:
        return m * sum(saved.values())
    cur = peak = 0.0
    for a in schedule:
        if a.phase == "F":
            cur += saved.get(a.stage, 0.0)
            peak = max(peak, cur)
        elif a.phase in ("B", "I"):  # zero-bubble's W keeps less than I frees: count it freed at I
            cur -= saved.get(a.stage, 0.0)
    return peak


class _ShardAxes:
    """Along which axes of its placement ZeRO shards a weight, from the plan alone, as
    :func:`planlab.plan.passes.gradients.zero_groups` finds them from the layouts: the axes that
    split a dimension the weight lacks or along which its operator's gradients stay partial sums
    (:mod:`planlab.plan.partial_grads`), less the tensor-parallel ones (splitting a dimension other
    than the batch, along devices that split some weight), unless that leaves none."""

    def __init__(self, plan: Plan, graph: Graph) -> None:
        self.graph = graph
        self._groups: dict[tuple, tuple] = {}  # per (devices' id, sizes, axis): the groups along it
        # the axes along which an operator's gradients stay partial over data-parallel replicas: its
        # weights' too (co-located pieces taken as any other, as materialize takes them)
        meshes: dict[tuple, Mesh] = {}
        mesh = {
            p.op: meshes.setdefault((p.sizes, p.devices), Mesh(tuple(p.sizes) or (1,), tuple(p.devices)))
            for p in plan.ops
        }
        self.deferred = deferred_axes(graph, mesh, {p.op: tuple(p.dims) or (None,) for p in plan.ops})
        self.sharding: set[tuple[int, ...]] = set()
        for p in plan.ops:
            op = graph.op(p.op)
            for t in op.inputs:
                if graph.tensors[t].role == "param":
                    held = {ax[0] for ax in op.axes_of(t) if ax}
                    for i, (d, n) in enumerate(zip(p.dims, p.sizes)):
                        if d is not None and d in held and n > 1:
                            self.sharding.update(self.groups(p, i))

    def groups(self, p: OpPlan, axis: int) -> tuple[tuple[int, ...], ...]:
        """The device groups (sorted) of ``p``'s placement along its mesh axis ``axis``."""
        key = (id(p.devices), p.sizes, axis)
        got = self._groups.get(key)
        if got is None or got[0] is not p.devices:
            mesh = Mesh(tuple(p.sizes), tuple(p.devices))
            got = self._groups[key] = (p.devices, tuple(tuple(sorted(g)) for g in mesh.group_map((axis,)).values()))
        return got[1]

    def axes(self, p: OpPlan, op: Operator, held: set[str]) -> tuple[int, ...]:
        """The axes of ``p`` over which ZeRO shards ``op``'s weight that has the dimensions ``held``."""
        deferred = self.deferred.get(p.op, ())
        summed = tuple(
            i
            for i, (d, n) in enumerate(zip(p.dims, p.sizes))
            if n > 1 and (i in deferred or (d is not None and d not in held))
        )
        batch = self.graph.dim_with_label(op, self.graph.batch_label)
        dp = tuple(i for i in summed if p.dims[i] == batch or not any(g in self.sharding for g in self.groups(p, i)))
        return dp or summed
