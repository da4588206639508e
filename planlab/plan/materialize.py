"""``materialize``: from a Plan to a Program of per-device tasks.

Passes, in this order:
1. layouts: each operator's mesh, the layout each input needs and each output has;
2. forward: per operator, the conversions of its inputs, then one compute task per piece;
3. backward: per operator in reverse, the conversions that sum its outputs' gradient
   contributions into the layout its output had, then one backward task per piece;
4. weight gradients: bucketed all-reduces of partial weight gradients (ZeRO: reduce-scatters, and for
   stage 3 per-layer weight all-gathers, :mod:`planlab.plan.zero`), then the optimizer step;
4b. co-located pieces: a device's k pieces of an operator run as k chunks (:mod:`planlab.plan.coshard`);
4c. where the schedule asks for it, each backward block split into input- and weight-gradient
   blocks ``I`` and ``W`` (zero-bubble, :mod:`planlab.plan.backward_split`), chunk by chunk;
5. order and memory: block tasks sorted, liveness gives each task's allocations and frees.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import defaultdict
from itertools import count, product
from typing import Callable

from planlab.costmodel.software import SoftwareSpec
from planlab.errors import InfeasiblePlan
from planlab.gcpause import paused_gc
from planlab.graph.ir import DETACH, DTYPE_BYTES, Graph, Operator, no_grad_tensors
from planlab.graph.random_ops import draws_random
from planlab.plan.backward_split import split_backward, split_stages
from planlab.plan.colocation import CoLocation, colocation
from planlab.plan.layout import Layout, Mesh, Partial, Replicate, Shard, box_numel, box_shape
from planlab.plan.plan import Action, Plan
from planlab.plan.program import FP32, MIXED_BF16, Block, DeviceProgram, Precision, Program, Task, TaskKind, is_static
from planlab.plan.redistribute import Conversion, plan_conversion, same_layout
from planlab.plan.saved import INTERNAL, internals, saved_buffers
from planlab.plan.shared_params import check_shared_params, forward_only_ops, use_shared_param
from planlab.plan.zero import shard_fully, units_of


def precision_for(cluster: str) -> Precision:
    """fp32 on the CPU cluster, bf16 mixed precision on GPUs."""
    return FP32 if cluster == "cpu" else MIXED_BF16


def trace_plan_model(plan: Plan) -> Graph:
    """Trace the plan's model at the plan's global batch on meta tensors."""
    from planlab.graph.trace import trace
    from planlab.models.registry import build_model

    model, inputs = build_model(plan.model, batch=plan.global_batch)
    return trace(model, inputs)


class _Layouts:
    """Mesh and layouts of every operator, at micro-batch shapes."""

    def __init__(self, plan: Plan, graph: Graph) -> None:
        self.graph, self.plan = graph, plan
        m = plan.microbatches
        names = {op.name for op in graph.operators}
        extra = [p.op for p in plan.ops if p.op not in names]
        if extra:
            raise InfeasiblePlan(
                f"the plan names operator {extra[0]!r}, which the model {plan.model} does not have "
                f"({len(extra)} of the plan's {len(plan.ops)} operators are not the model's): "
                "was the plan made for another model or size?"
            )
        self.op_plan = {p.op: p for p in plan.ops}
        missing = [n for n in names if n not in self.op_plan]
        if missing:
            raise InfeasiblePlan(
                f"the plan does not place operator {sorted(missing)[0]!r} of the model {plan.model} "
                f"({len(missing)} of its {len(names)} operators are not in the plan): "
                "was the plan made for another model or size?"
            )
        self.shapes: dict[str, tuple[int, ...]] = {}
        for t, spec in graph.tensors.items():
            shape = list(spec.shape)
            for a in range(len(shape)):
                if graph.labels.get((t, a)) == graph.batch_label:
                    if shape[a] % m:
                        raise InfeasiblePlan(
                            f"batch axis {a} of {t!r} (size {shape[a]}) does not split into {m} micro-batches"
                        )
                    shape[a] //= m
            self.shapes[t] = tuple(shape)
        self.mesh: dict[str, Mesh] = {}
        self.dims: dict[str, tuple[str | None, ...]] = {}
        self._memo: dict[tuple, Layout] = {}
        self._placed: dict[tuple, Layout] = {}
        self.chunks: dict[str, CoLocation] = {}  # co-located operators (coshard)
        interned: dict[Mesh, Mesh] = {}
        for op in graph.operators:
            p = self.op_plan[op.name]
            sizes, dims = (p.sizes, p.dims) if p.sizes else ((1,), (None,))
            if len(p.devices) != math.prod(sizes):
                raise InfeasiblePlan(f"operator {op.name!r} has {math.prod(sizes)} pieces but {len(p.devices)} devices")
            bad = [d for d in p.devices if not 0 <= d < plan.num_devices]
            if bad:
                raise InfeasiblePlan(
                    f"operator {op.name!r} is placed on device {bad[0]}; the plan has devices 0..{plan.num_devices - 1}"
                )
            co = colocation(op.name, tuple(dims), tuple(sizes), tuple(p.devices))
            mdims, msizes, mdevices = (dims, sizes, p.devices) if co is None else co.reduce(dims, sizes, p.devices)
            if co is not None:  # each device holds the n-way share its k pieces make, run as k chunks
                self.chunks[op.name] = co
                mdims, msizes = (mdims, msizes) if msizes else ((None,), (1,))
            mesh = Mesh(tuple(msizes), tuple(mdevices))
            self.mesh[op.name] = interned.setdefault(mesh, mesh)  # one object per mesh: its caches are shared
            self.dims[op.name] = tuple(mdims)
            for d in set(x for x in dims if x is not None):
                if not op.signature.splittable(d):
                    raise InfeasiblePlan(f"dimension {d!r} of operator {op.name!r} ({op.signature}) cannot be split")
                n = math.prod(s for x, s in zip(dims, sizes) if x == d)
                size = self._dim_size(op, d)
                if size % n:
                    raise InfeasiblePlan(
                        f"dimension {d!r} of operator {op.name!r} has size {size} per "
                        f"micro-batch, which does not split into {n} pieces"
                    )

    def _dim_size(self, op: Operator, dim: str) -> int:
        for t in op.inputs + op.outputs:
            for a, ax in enumerate(op.axes_of(t)):
                if ax and ax[0] == dim:
                    full = self.shapes[t][a]
                    inner = math.prod(op.dim_sizes[n] for n in ax[1:])
                    return full // inner
        return op.dim_sizes[dim]

    def _place(self, op: Operator, tensor_axes, partial_dims=frozenset(), contrib=False) -> Layout:
        dims, mesh = self.dims[op.name], self.mesh[op.name]
        key = (
            mesh,
            dims,
            tuple(tensor_axes),
            contrib,
            frozenset(d for d in dims if d in partial_dims) if partial_dims else frozenset(),
        )
        got = self._placed.get(key)  # layers repeat: most operators share a few layouts
        if got is None:
            got = self._placed[key] = self._make_layout(dims, mesh, tensor_axes, partial_dims, contrib)
        return got

    @staticmethod
    def _make_layout(dims, mesh: Mesh, tensor_axes, partial_dims, contrib: bool) -> Layout:
        out = []
        for d in dims:
            axis = next((a for a, ax in enumerate(tensor_axes) if ax and ax[0] == d), None) if d else None
            if d is None:
                out.append(Replicate())
            elif axis is not None:
                out.append(Shard(axis))
            elif contrib or d in partial_dims:
                out.append(Partial())
            else:
                out.append(Replicate())
        return Layout(mesh, tuple(out))

    def needs(self, op: Operator, i: int) -> Layout:
        """Layout in which ``op`` reads its ``i``-th input (full values of its piece)."""
        return self._cached(("in", op.name, i), lambda: self._place(op, op.signature.inputs[i]))

    def has(self, op: Operator, j: int) -> Layout:
        """Layout in which ``op`` produces its ``j``-th output."""
        return self._cached(("out", op.name, j), lambda: self._place(op, op.signature.outputs[j], op.signature.reduce))

    def contributes(self, op: Operator, i: int) -> Layout:
        """Layout of the gradient contribution ``op``'s backward gives its ``i``-th input."""
        return self._cached(("grad", op.name, i), lambda: self._place(op, op.signature.inputs[i], contrib=True))

    def _cached(self, key, make) -> Layout:
        got = self._memo.get(key)
        if got is None:
            got = self._memo[key] = make()
        return got


def _piece_shapes(L: _Layouts, op: Operator) -> tuple[tuple[int, ...], ...]:
    """The local shapes of one piece of ``op`` per micro-batch: its inputs as it reads them, then
    its outputs (every piece has the same, since splits divide evenly)."""
    ins = tuple(box_shape(L.needs(op, k).box(0, L.shapes[t])) for k, t in enumerate(op.inputs))
    return ins + tuple(box_shape(L.has(op, j).box(0, L.shapes[t])) for j, t in enumerate(op.outputs))


def _full(layout: Layout) -> Layout:
    return Layout(layout.mesh, tuple(Replicate() if isinstance(p, Partial) else p for p in layout.placements))


def materialize(
    plan: Plan,
    graph: Graph | None = None,
    *,
    precision: Precision | None = None,
    symmetric: bool = False,
    node_of: Callable[[int], int] | None = None,
    overlap_grad_reduce: bool = True,
    software: SoftwareSpec | None = None,
) -> Program:
    """Turn ``plan`` into a Program (see the module docstring for the passes).

    With ``symmetric``, devices are first grouped into classes from the plan alone
    (:mod:`planlab.plan.symmetry`) and tasks are built for one representative of
    each class (and one more member, to check the classes): the reduced Program
    the simulator runs at cluster scale. ``node_of`` maps a device to its node
    (default: the plan's cluster). Raises InfeasiblePlan naming the operator or
    value when the plan cannot be realised (an operator left unplaced, a split
    that does not divide, a bad schedule). ``overlap_grad_reduce=False`` reduces the
    weight gradients without buckets: one all-reduce per group after the backward, in the
    update block (DeepSpeed without gradient bucketing), instead of buckets overlapped with it.
    A ``software`` (:class:`~planlab.costmodel.software.SoftwareSpec`) decides that instead (its
    ``grad_reduce``), the bucket size and how ZeRO-3 gathers (its ``zero3_*`` fields).
    """
    graph = graph if graph is not None else trace_plan_model(plan)
    with paused_gc():
        return _materialize(
            plan,
            graph,
            precision or precision_for(plan.cluster),
            symmetric,
            node_of,
            overlap_grad_reduce if software is None else software.grad_reduce == "overlapped",
            software,
        )


def _materialize(
    plan: Plan,
    graph: Graph,
    precision: Precision,
    symmetric: bool,
    node_of: Callable[[int], int] | None,
    overlap: bool = True,
    software: SoftwareSpec | None = None,
) -> Program:
    L = _Layouts(plan, graph)
    if symmetric and plan.num_devices > 1:
        from planlab.plan.symmetry import plan_classes, reduce_program

        if node_of is None:
            from planlab.costmodel import load_cluster

            node_of = load_cluster(plan.cluster, plan.nodes).node_of
        classes = plan_classes(plan, L.mesh.values(), node_of)
        reps = sorted(set(classes))
        if len(reps) < plan.num_devices:
            witnesses = {}
            for d, c in enumerate(classes):
                if d != c:
                    witnesses[c] = d  # the last member of each class
            program = _build(
                plan, graph, L, precision, frozenset(reps) | frozenset(witnesses.values()), overlap, software
            )
            reduced = reduce_program(program, classes, witnesses, node_of)
            if reduced is not None:
                return reduced
    return _build(plan, graph, L, precision, None, overlap, software)


# Operators whose pieces, split along the named dimension, agree with each other inside their
# forward (Megatron's vocabulary-parallel loss: all-reduces of each token's largest logit and sum of
# exponentials, planlab.executor.vocab_parallel): each piece's forward task carries the group of the
# devices holding the other slices (``Task.group``, in the order of the slices).
IN_OP_GROUPS = {"vocab_cross_entropy": "v"}


def _line(mesh: Mesh, flat: int, axes: list[int]) -> tuple[int, ...]:
    """The devices of ``mesh`` whose coordinates differ from ``flat``'s along ``axes`` only, in
    row-major order of those axes; () without such axes (or when they are of size one)."""
    if not axes or math.prod(mesh.shape[a] for a in axes) == 1:
        return ()
    base = list(mesh.coord(flat))
    out = []
    for idx in product(*(range(mesh.shape[a]) for a in axes)):
        for a, j in zip(axes, idx):
            base[a] = j
        out.append(mesh.devices[mesh.flat(tuple(base))])
    return tuple(out)


def _positions(mesh: Mesh, keep: frozenset[int] | None):
    """``(flat, device)`` of a mesh's devices, or of those in ``keep``."""
    if keep is None:
        return enumerate(mesh.devices)
    cache = mesh.__dict__.setdefault("_kept", {})
    got = cache.get(keep)
    if got is None:
        pos = mesh.position
        got = cache[keep] = sorted((pos[d], d) for d in keep if d in pos)
    return got


def _build(
    plan: Plan,
    graph: Graph,
    L: _Layouts,
    precision: Precision,
    keep: frozenset[int] | None,
    overlap: bool = True,
    software: SoftwareSpec | None = None,
) -> Program:
    """The passes, for every device or only for those in ``keep``."""
    topo = {op.name: i for i, op in enumerate(graph.operators)}
    m = plan.microbatches
    stage = {p.op: p.stage for p in plan.ops}
    entries: dict[int, dict[tuple[int, str], list]] = defaultdict(lambda: defaultdict(list))
    buf_bytes: dict[int, dict[str, int]] = defaultdict(dict)
    params_on: dict[int, list[tuple[str, tuple]]] = defaultdict(list)
    seq = count()
    tags = count()
    channels = count()

    def ebytes(t: str) -> int:
        spec = graph.tensors[t]
        return precision.activation_bytes if spec.is_float else DTYPE_BYTES.get(spec.dtype, 4)

    def emit(dev: int, block: tuple[int, str], key: tuple, task: Task, t: str | None = None) -> None:
        entries[dev][block].append((key + (next(seq),), task))
        if t is not None:
            for w in task.writes:
                if w and not is_static(w) and task.shape is not None:
                    buf_bytes[dev].setdefault(w, math.prod(task.shape) * ebytes(t))

    def place(conv: Conversion, t: str, src_block, src_key, dst_block, dst_key) -> None:
        for dev, tasks in conv.src.items():
            for task in tasks:
                emit(dev, src_block, src_key, task, t)
        for dev, tasks in conv.dst.items():
            for task in tasks:
                emit(dev, dst_block, dst_key, task, t)

    # -- pass 2: forward --------------------------------------------------------
    converted: dict[tuple[str, Layout], str] = {}
    saved_of: dict[str, tuple[str, ...]] = {}
    shapes_of: dict[str, tuple[tuple[int, ...], ...]] = {}  # per operator, its pieces' local shapes
    versions: dict[str, int] = defaultdict(int)  # layouts of each tensor converted so far
    in_bufs: dict[str, list[str]] = {}
    owner: dict[str, tuple[Operator, int]] = {}
    nograd = no_grad_tensors(graph)  # recycling: what a detach cuts off from the loss (empty without one)
    fwd_only = forward_only_ops(graph, nograd) if nograd else frozenset()
    held: dict[int, set] = defaultdict(set)  # recycling: a parameter each pass uses is held once
    for i, op in enumerate(graph.operators):
        mesh, blk = L.mesh[op.name], (stage[op.name], "F")
        bufs = []
        for ti, t in enumerate(op.inputs):
            spec, need = graph.tensors[t], L.needs(op, ti)
            if spec.role == "param" and nograd:  # planlab/search_spaces/recycling.py
                use_shared_param(
                    op,
                    ti,
                    t,
                    [(dev, need.box(flat, L.shapes[t])) for flat, dev in _positions(mesh, keep)],
                    owner,
                    fwd_only,
                    params_on,
                    held,
                )
                bufs.append(f"w:{t}")
                continue
            if spec.role == "param":
                if t in owner and owner[t][0] is not op:
                    raise InfeasiblePlan(
                        f"parameter {t!r} is used by operators {owner[t][0].name!r} and "
                        f"{op.name!r}; tied weights are not supported yet"
                    )
                owner[t] = (op, ti)
                for flat, dev in _positions(mesh, keep):
                    params_on[dev].append((t, need.box(flat, L.shapes[t])))
                bufs.append(f"w:{t}")
                continue
            if (t, need) in converted:
                bufs.append(converted[(t, need)])
                continue
            if spec.role in ("input", "buffer"):
                buf = f"a:{t}#{versions[t]}"
                batch_axis = next(
                    (a for a in range(len(spec.shape)) if graph.labels.get((t, a)) == graph.batch_label), -1
                )
                for flat, dev in _positions(mesh, keep):
                    box = need.box(flat, L.shapes[t])
                    emit(
                        dev,
                        blk,
                        (i, 0),
                        Task(
                            f"load:{t}",
                            TaskKind.LOCAL,
                            (f"src:{t}",),
                            (buf,),
                            src_region=box,
                            shape=box_shape(box),
                            axis=batch_axis,
                            dtype=spec.dtype,
                        ),
                        t,
                    )
                converted[(t, need)] = buf
                versions[t] += 1
                bufs.append(buf)
                continue
            prod = graph.producer[t]
            have = L.has(prod, prod.outputs.index(t))
            if same_layout(have, need):
                bufs.append(f"a:{t}")
                continue
            buf = f"a:{t}#{versions[t] + 1}"
            conv = plan_conversion(
                have,
                need,
                L.shapes[t],
                ebytes(t),
                src_buf=f"a:{t}",
                dst_buf=buf,
                tags=tags,
                name=f"{t}:",
                dtype=graph.tensors[t].dtype,
                only=keep,
                channel=next(channels),
            )
            # sends sit where the consumer is in topological order, as the receives do, so
            # every channel carries its messages in the order they are received (NCCL matches in order)
            place(conv, t, (stage[prod.name], "F"), (i, 0), blk, (i, 0))
            converted[(t, need)] = buf
            versions[t] += 1
            bufs.append(buf)
        in_bufs[op.name] = bufs
        outs = tuple(f"a:{o}" for o in op.outputs)
        pieces = math.prod(s for d, s in zip(L.dims[op.name], mesh.shape) if d is not None)
        saved = saved_buffers(op, bufs, outs, graph, L.has, L.needs, software, precision.activation_bytes)
        red_axes = [a for a, d in enumerate(L.dims[op.name]) if d in op.signature.reduce]
        saved_of[op.name] = saved
        shapes_of[op.name] = _piece_shapes(L, op)
        agree = [a for a, d in enumerate(L.dims[op.name]) if d is not None and d == IN_OP_GROUPS.get(op.kind)]
        random = draws_random(op)  # its pieces key their draws by their box (planlab.executor.randomness)
        for flat, dev in _positions(mesh, keep):
            out_shape = box_shape(L.has(op, 0).box(flat, L.shapes[op.outputs[0]]))
            lead = all(mesh.coord(flat)[a] == 0 for a in red_axes)
            task = Task(
                op.name,
                TaskKind.FORWARD,
                tuple(bufs),
                outs,
                op=op.name,
                coord=flat,
                flops=op.flops / pieces / m,
                bytes_moved=op.bytes_moved / pieces / m,
                shape=out_shape,
                saved=saved,
                lead=lead,
                op_kind=op.kind,
                shapes=shapes_of[op.name],
                group=_line(mesh, flat, agree),
                box=L.has(op, 0).box(flat, L.shapes[op.outputs[0]]) if random else None,
            )
            emit(dev, blk, (i, 1), task)
            for j, o in enumerate(op.outputs):
                buf_bytes[dev][outs[j]] = box_numel(L.has(op, j).box(flat, L.shapes[o])) * ebytes(o)
            for tag, base, per, nbytes in internals(op, graph, software, precision.activation_bytes):
                j = op.inputs.index(base) if base in op.inputs else None
                lay = L.needs(op, j) if j is not None else L.has(op, op.outputs.index(base))
                buf_bytes[dev][f"{INTERNAL}{op.name}:{tag}"] = int(
                    box_numel(lay.box(flat, L.shapes[base])) * per * nbytes
                )

    if nograd:
        check_shared_params(
            params_on,
            {
                p: [(dev, L.needs(op, k).box(flat, L.shapes[p])) for flat, dev in _positions(L.mesh[op.name], keep)]
                for p, (op, k) in owner.items()
            },
        )

    # -- pass 3: backward -------------------------------------------------------
    dead: set[str] = set()  # operators without a backward: nothing they produce reaches the loss
    for i in range(len(graph.operators) - 1, -1, -1):
        op = graph.operators[i]
        mesh, blk = L.mesh[op.name], (stage[op.name], "B")
        gbufs = []
        for j, t in enumerate(op.outputs):
            spec = graph.tensors[t]
            uses = [
                (c, k)
                for c in graph.consumers.get(t, [])
                for k, x in enumerate(c.inputs)
                if x == t and c.name not in dead
            ]  # a consumer whose outputs reach no loss gives no gradient
            if t == graph.loss:
                gbufs.append("")  # seeded with ones by the executor
                continue
            if not spec.is_float or not uses or t in nograd:
                gbufs.append("")
                continue
            target = _full(L.has(op, j))
            if len(uses) == 1 and same_layout(L.contributes(*uses[0]), target):
                c, k = uses[0]
                gbufs.append(f"gc:{t}<{c.name}.{k}")
                continue
            # Contributions in one layout on the producer's own devices are summed locally first,
            # so that one conversion (one all-reduce, say) carries them all.
            pending: list[tuple[Layout, str, str]] = []  # (layout, buffer, stage of its source)
            local: dict[Layout, list[tuple[str, Operator]]] = {}
            for c, k in sorted(uses, key=lambda u: -topo[u[0].name]):
                lay, buf = L.contributes(c, k), f"gc:{t}<{c.name}.{k}"
                if lay.mesh == target.mesh:
                    local.setdefault(lay, []).append((buf, c))
                else:
                    pending.append((lay, buf, c.name))
            for lay, items in local.items():
                if len(items) == 1 or same_layout(lay, target):
                    pending += [(lay, buf, c.name) for buf, c in items]
                    continue
                summed = f"gs:{t}#{len(pending)}"
                for flat, dev in _positions(lay.mesh, keep):
                    for buf, _ in items:
                        emit(
                            dev,
                            blk,
                            (-i, 0),
                            Task(
                                f"d{t}:sum",
                                TaskKind.LOCAL,
                                (buf,),
                                (summed,),
                                shape=box_shape(lay.box(flat, L.shapes[t])),
                                accumulate=True,
                                dtype=graph.tensors[t].dtype,
                            ),
                            t,
                        )
                pending.append((lay, summed, op.name))
            for lay, buf, src in pending:
                conv = plan_conversion(
                    lay,
                    target,
                    L.shapes[t],
                    ebytes(t),
                    src_buf=buf,
                    dst_buf=f"g:{t}",
                    accumulate=True,
                    tags=tags,
                    name=f"d{t}:",
                    dtype=graph.tensors[t].dtype,
                    only=keep,
                    channel=next(channels),
                )
                place(conv, t, (stage[src], "B"), (-i, 0), blk, (-i, 0))
            gbufs.append(f"g:{t}")
        needs_grad = [
            graph.tensors[t].is_float
            and graph.tensors[t].role in ("activation", "param")
            and t not in nograd
            and op.kind != DETACH
            for t in op.inputs
        ]
        if op.outputs[0] != graph.loss and all(g == "" for g in gbufs):
            dead.add(op.name)
            continue
        if not any(needs_grad):
            continue
        writes = tuple(
            ("wg:" if graph.tensors[t].role == "param" else "gc:")
            + t
            + ("" if graph.tensors[t].role == "param" else f"<{op.name}.{k}")
            if ng
            else ""
            for k, (t, ng) in enumerate(zip(op.inputs, needs_grad))
        )
        pieces = math.prod(s for d, s in zip(L.dims[op.name], mesh.shape) if d is not None)
        fwd_saved = saved_of[op.name]
        for flat, dev in _positions(mesh, keep):
            task = Task(
                op.name,
                TaskKind.BACKWARD,
                tuple(gbufs),
                writes,
                op=op.name,
                coord=flat,
                flops=op.flops * op.bwd_flops_ratio / pieces / m,
                bytes_moved=op.bytes_moved / pieces / m,
                saved=fwd_saved,
                op_kind=op.kind,
                shapes=shapes_of.get(op.name, ()),
            )
            emit(dev, blk, (-i, 1), task)
            for k, (t, w) in enumerate(zip(op.inputs, writes)):
                if w.startswith("gc:"):
                    buf_bytes[dev][w] = box_numel(L.contributes(op, k).box(flat, L.shapes[t])) * ebytes(t)
        for j, t in enumerate(op.outputs):
            if gbufs[j].startswith("g:"):
                for flat, dev in _positions(mesh, keep):
                    buf_bytes[dev][gbufs[j]] = box_numel(_full(L.has(op, j)).box(flat, L.shapes[t])) * ebytes(t)

    # -- pass 3b: recomputation ------------------------------------------------
    groups_of = {
        p.op: p.recompute
        for p in plan.ops
        if p.recompute
        and p.op not in L.chunks  # coshard: per piece
        and not (nograd and p.op in dead)
    }  # a recycling pass without backward keeps nothing to recompute
    if groups_of:
        _recompute(entries, graph, groups_of, seq, buf_bytes)

    # -- pass 4: weight gradients and optimizer ---------------------------------
    # per device and reduction group: (topological index of the owner, gradient buffer, bytes)
    buckets: dict[int, dict[tuple[int, ...], list[tuple[int, str, int]]]] = defaultdict(lambda: defaultdict(list))
    for p, (op, k) in owner.items():
        contrib, target = L.contributes(op, k), L.needs(op, k)
        axes = [
            a
            for a, (c, t) in enumerate(zip(contrib.placements, target.placements))
            if isinstance(c, Partial) and not isinstance(t, Partial) and contrib.mesh.shape[a] > 1
        ]
        mesh = contrib.mesh
        if not axes:
            continue
        for flat, dev in _positions(mesh, keep):
            group = tuple(sorted(mesh.group_of(flat, tuple(axes))))
            nb = box_numel(target.box(flat, L.shapes[p])) * precision.grad_bytes
            buckets[dev][group].append((topo[op.name], f"wg:{p}", nb))
    devices = sorted(set(entries) | set(params_on))
    zero_saved: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0])  # bytes of grads, optimizer states, weights
    together: dict[int, list] = defaultdict(list)  # ZeRO-3: buffers freed at once (a unit's gathered weights)
    for dev in devices:
        w_block = (min((s for s, _ in entries[dev]), default=0), "U")
        sharded: set[str] = set()
        for gid, group in enumerate(sorted(buckets[dev])):
            items = buckets[dev][group]
            if plan.zero == 0 and overlap:
                bucket = software.grad_bucket_elements if software is not None else BUCKET_ELEMENTS
                _overlapped_buckets(emit, dev, group, items, stage, graph, precision, bucket)
                continue
            if plan.zero == 0:  # one all-reduce of every gradient, after the backward
                bufs = tuple(b for _, b, _ in sorted(items))
                emit(
                    dev,
                    w_block,
                    (0, 0),
                    Task(
                        f"grad-reduce{list(group)}",
                        TaskKind.COLLECTIVE,
                        bufs,
                        bufs,
                        collective="all_reduce",
                        group=group,
                        nbytes=sum(n for _, _, n in items),
                    ),
                )
                continue
            if plan.zero == 3:  # planlab/plan/zero.py
                per_module = software is not None and software.zero3_unit == "module"
                units = units_of(items, group, graph, stage, precision.grad_bytes, per_module=per_module)
                numel, freed = shard_fully(
                    entries[dev],
                    units,
                    graph=graph,
                    precision=precision,
                    emit=functools.partial(emit, dev),
                    update_block=w_block,
                    sizes=buf_bytes[dev],
                    regather=software is not None and software.zero3_regather_for_recompute,
                )
                together[dev] += freed
                for k, b in enumerate((precision.grad_bytes, precision.optimizer_bytes, precision.param_bytes)):
                    zero_saved[dev][k] += numel * b
                sharded.update(b[3:] for _, b, _ in items)
                continue
            bufs = tuple(b for _, b, _ in items)
            grad_bytes = sum(n for _, _, n in items)
            # ZeRO: reduce-scatter the bucket, step the optimizer on this device's shard, all-gather weights
            n = len(group)
            numel = grad_bytes // precision.grad_bytes
            zg, zp = f"zg:{list(group)}", f"zp:{list(group)}"
            wbufs = tuple("w:" + b[3:] for b in bufs)
            emit(
                dev,
                w_block,
                (0, 0),
                Task(
                    f"grad-reduce-scatter{list(group)}",
                    TaskKind.COLLECTIVE,
                    bufs,
                    (zg,),
                    collective="reduce_scatter",
                    group=group,
                    nbytes=grad_bytes,
                ),
            )
            emit(
                dev,
                w_block,
                (1, 0),
                Task(
                    f"optimizer-shard{list(group)}",
                    TaskKind.OPTIMIZER,
                    (zg,),
                    (zp,),
                    flops=12.0 * numel / n,
                    bytes_moved=numel
                    / n
                    * (2 * precision.param_bytes + precision.grad_bytes + 2 * precision.optimizer_bytes),
                ),
            )
            emit(
                dev,
                w_block,
                (2, 0),
                Task(
                    f"param-all-gather{list(group)}",
                    TaskKind.COLLECTIVE,
                    (zp,),
                    wbufs,
                    collective="all_gather",
                    group=group,
                    nbytes=numel * precision.param_bytes,
                ),
            )
            sharded.update(b[3:] for b in bufs)
            zero_saved[dev][1] += numel * precision.optimizer_bytes * (n - 1) // n
            if plan.zero >= 2:
                zero_saved[dev][0] += numel * precision.grad_bytes * (n - 1) // n
        rest = [(p, b) for p, b in params_on[dev] if p not in sharded]
        nparams = sum(box_numel(b) for _, b in rest)
        if nparams:
            w = tuple(f"w:{p}" for p, _ in rest)
            g = tuple(f"wg:{p}" for p, _ in rest)
            emit(
                dev,
                w_block,
                (1, 1),
                Task(
                    "optimizer",
                    TaskKind.OPTIMIZER,
                    w + g,
                    w,
                    flops=12.0 * nparams,
                    bytes_moved=nparams
                    * (2 * precision.param_bytes + precision.grad_bytes + 2 * precision.optimizer_bytes),
                ),
            )

    # -- pass 4b: co-located pieces run one after another (coshard) ---------------
    if L.chunks:
        from planlab.plan.coshard import run_in_chunks

        run_in_chunks(entries, graph, L, plan, buf_bytes)

    # -- pass 4c: zero-bubble's split backward, where the schedule has I and W actions --------
    for dev in devices:
        given = plan.schedule[dev] if plan.schedule and dev < len(plan.schedule) else ()
        if any(a.phase in ("I", "W") for a in given):  # planlab/plan/backward_split.py
            split_backward(entries[dev], split_stages(given), graph)

    # -- pass 5: order, schedule, memory ----------------------------------------
    programs = []
    groups: set[tuple[int, ...]] = set()
    for dev in range(plan.num_devices) if keep is None else sorted(keep):
        blocks = {}
        for key, items in entries.get(dev, {}).items():
            items.sort(key=lambda x: x[0])
            blocks[key] = Block(key[0], key[1], tuple(t for _, t in items))
            groups.update(tuple(sorted(t.group)) for t in blocks[key].tasks if t.group)
        schedule = _schedule(plan, dev, blocks)
        blocks = _liveness(blocks, buf_bytes[dev], together.get(dev, ()))
        nparams = sum(box_numel(b) for _, b in params_on.get(dev, []))
        programs.append(
            DeviceProgram(
                device=dev,
                blocks=blocks,
                schedule=schedule,
                params=tuple(params_on.get(dev, [])),
                param_bytes=nparams * precision.param_bytes - zero_saved[dev][2],
                grad_bytes=nparams * precision.grad_bytes - zero_saved[dev][0],
                optimizer_bytes=nparams * precision.optimizer_bytes - zero_saved[dev][1],
            )
        )
    loss_op = graph.producer[graph.loss]
    lay = L.has(loss_op, 0)
    holders = []
    for flat, dev in enumerate(lay.mesh.devices):
        c = lay.mesh.coord(flat)
        primary = all(c[a] == 0 for a, p in enumerate(lay.placements) if isinstance(p, Replicate))
        holders.append((dev, f"a:{graph.loss}", int(primary)))
    return Program(
        devices=tuple(programs),
        microbatches=m,
        precision=precision,
        groups=tuple(sorted(g for g in groups if len(g) > 1)),
        loss_holders=tuple(holders),
    )


# Megatron-LM's default gradient bucket (--ddp-bucket-size: 40M elements).
BUCKET_ELEMENTS = 40_000_000


def _overlapped_buckets(
    emit,
    dev: int,
    group: tuple[int, ...],
    items: list[tuple[int, str, int]],
    stage: dict[str, int],
    graph: Graph,
    precision: Precision,
    bucket_elements: int = BUCKET_ELEMENTS,
) -> None:
    """Data-parallel gradient reduction overlapped with the backward, as Megatron-LM and DDP do it:
    gradients in buckets of at most ``bucket_elements`` (:data:`BUCKET_ELEMENTS`), filled in the order the backward
    completes them; each bucket's all-reduce is issued, with the last micro-batch, right after
    the backward task that completes it, and runs on the communication stream."""
    names = [op.name for op in graph.operators]
    by_stage: dict[int, list[tuple[int, str, int]]] = defaultdict(list)
    for item in items:
        by_stage[stage[names[item[0]]]].append(item)
    cap = bucket_elements * precision.grad_bytes
    for st in sorted(by_stage):
        ordered = sorted(by_stage[st], key=lambda x: (-x[0], x[1]))  # backward order
        bucket: list[tuple[int, str, int]] = []
        for k, item in enumerate(ordered):
            bucket.append(item)
            full = sum(n for _, _, n in bucket) >= cap
            if full or k == len(ordered) - 1:
                bufs = tuple(b for _, b, _ in bucket)
                last = min(i for i, _, _ in bucket)  # the bucket is complete after this operator's backward
                emit(
                    dev,
                    (st, "B"),
                    (-last, 1),
                    Task(
                        f"grad-reduce{list(group)}#{bufs[0][3:]}",
                        TaskKind.COLLECTIVE,
                        bufs,
                        bufs,
                        collective="all_reduce",
                        group=group,
                        nbytes=sum(n for _, _, n in bucket),
                        final=True,
                        overlap=True,
                    ),
                )
                bucket = []


def _recompute(entries, graph: Graph, groups_of: dict[str, int], seq, buf_bytes) -> None:
    """Per device and recompute group: mark the group's forward tasks ``drop``, copy them
    (without sends and receives) into the backward block just before the group's first
    backward task, writing renamed buffers (``r:``) that the group's backward tasks read."""
    names = [op.name for op in graph.operators]
    for dev, blocks in entries.items():
        for (st, ph), items in list(blocks.items()):
            if ph != "F":
                continue
            by_group: dict[int, list] = defaultdict(list)
            for i, (key, task) in enumerate(items):
                g = groups_of.get(names[key[0]]) if key[0] < len(names) else None
                if g and task.kind not in (TaskKind.SEND, TaskKind.RECV):
                    by_group[g].append(i)
            # a buffer a receive fills (in part: the pieces of a batch-split producer) is not made again:
            # the redo reads it as the forward left it, since receives are not redone
            received = {w for _, t in items if t.kind is TaskKind.RECV for w in t.writes if w}
            for g, idxs in by_group.items():
                idxs = [i for i in idxs if not all(w in received for w in items[i][1].writes if w)]
                written = {w for i in idxs for w in items[i][1].writes if w} - received
                for w in written:
                    if w in buf_bytes[dev]:
                        buf_bytes[dev][f"r:{w[2:]}"] = buf_bytes[dev][w]
                ren = lambda bufs: tuple(f"r:{b[2:]}" if b in written else b for b in bufs)  # noqa: E731
                last_op = max(items[i][0][0] for i in idxs)
                bkey = (st, "B")
                for i in idxs:
                    key, t = items[i]
                    if t.kind is TaskKind.FORWARD:
                        items[i] = (key, dataclasses.replace(t, recompute="drop", saved=()))
                    redo = dataclasses.replace(
                        t,
                        name=f"re:{t.name}",
                        reads=ren(t.reads),
                        writes=ren(t.writes),
                        saved=ren(t.saved),
                        recompute="redo" if t.kind is TaskKind.FORWARD else "",
                    )
                    blocks[bkey].append(((-last_op, -1, key[0], next(seq)), redo))
                members = {names[items[i][0][0]] for i in idxs}
                blocks[bkey][:] = [
                    (
                        k,
                        dataclasses.replace(t, saved=ren(t.saved))
                        if t.kind is TaskKind.BACKWARD and t.op in members
                        else t,
                    )
                    for k, t in blocks[bkey]
                ]


def _schedule(plan: Plan, dev: int, blocks: dict) -> tuple[Action, ...]:
    m = plan.microbatches
    fs = sorted(s for s, ph in blocks if ph == "F")
    bs = sorted((s for s, ph in blocks if ph == "B"), reverse=True)
    ws = sorted(s for s, ph in blocks if ph == "U")
    given = plan.schedule[dev] if plan.schedule and dev < len(plan.schedule) and plan.schedule[dev] else None
    if given is None:
        return tuple(
            [Action(s, "F", k) for k in range(m) for s in fs]
            + [Action(s, "B", k) for k in range(m) for s in bs]
            + [Action(s, "U", 0) for s in ws]
        )
    split = tuple(sorted(s for s, ph in blocks if ph == "I"))
    _check_schedule(
        dev, tuple((a.stage, a.phase, a.microbatch) for a in given), tuple(fs), tuple(bs), tuple(ws), m, split
    )
    return tuple(given)


@functools.lru_cache(maxsize=256)
def _check_schedule(dev: int, given: tuple, fs: tuple, bs: tuple, ws: tuple, m: int, split: tuple = ()) -> None:
    need = (
        {(s, "F", k) for s in fs for k in range(m)}
        | {(s, "B", k) for s in bs for k in range(m)}
        | {(s, ph, k) for s in split for ph in "IW" for k in range(m)}
        | {(s, "U", 0) for s in ws}
    )
    seen = set()
    for a in given:
        if a not in need:
            raise InfeasiblePlan(
                f"device {dev}'s schedule has action {Action(*a)}, which names no block of that "
                f"device; expected actions like {', '.join(str(Action(*x)) for x in sorted(need)[:6])}"
            )
        if a in seen:
            raise InfeasiblePlan(f"device {dev}'s schedule runs action {Action(*a)} twice")
        if a[1] == "W" and (a[0], "I", a[2]) not in seen:  # W uses the graph its I kept
            raise InfeasiblePlan(f"device {dev}'s schedule runs {Action(*a)} before {Action(a[0], 'I', a[2])}")
        seen.add(a)
    if len(seen) != len(need):
        miss = sorted(need - seen)
        raise InfeasiblePlan(f"device {dev}'s schedule misses actions {', '.join(str(Action(*x)) for x in miss[:6])}")


def _liveness(blocks: dict, sizes: dict[str, int], together: tuple | list = ()) -> dict:
    """Fill ``alloc``/``free``: a buffer is allocated by its first writer and freed
    after its last reader, in the canonical block order (forward stages ascending,
    backward stages descending, a stage's ``I`` before its ``W``), which every valid schedule
    preserves per micro-batch. Each group of buffers in ``together`` is freed at once, after
    the last reader of any of them (ZeRO-3 frees a layer's gathered weights together)."""
    order = sorted(
        blocks, key=lambda k: (0, k[0], 0) if k[1] == "F" else (1, -k[0], k[1] == "W") if k[1] in "BIW" else (2, 0, 0)
    )
    first: dict[str, tuple] = {}
    last: dict[str, tuple] = {}
    for bk in order:
        for ti, t in enumerate(blocks[bk].tasks):
            kept = tuple(b for b in t.saved if b.startswith(INTERNAL)) if t.kind is TaskKind.FORWARD else ()
            for b in t.writes + kept:  # an internal buffer is allocated by the forward that keeps it
                if b and not is_static(b):
                    first.setdefault(b, (bk, ti))
                    last.setdefault(b, (bk, ti))
            for b in t.reads + t.saved:
                if b and not is_static(b):
                    last[b] = (bk, ti)
    if together:
        rank = {bk: i for i, bk in enumerate(order)}
        for bufs in together:
            at = max((last[b] for b in bufs if b in last), key=lambda p: (rank[p[0]], p[1]), default=None)
            for b in bufs:
                if b in last:
                    last[b] = at
    allocs: dict[tuple, list] = defaultdict(list)
    frees: dict[tuple, list] = defaultdict(list)
    for b, pos in first.items():
        allocs[pos].append((b, sizes.get(b, 0)))
    for b, pos in last.items():
        frees[pos].append(b)
    out = {}
    for bk in order:
        tasks = []
        for ti, t in enumerate(blocks[bk].tasks):
            a, f = allocs.get((bk, ti)), frees.get((bk, ti))
            if a or f:
                fields = dict(t.__dict__, alloc=tuple(a or ()), free=tuple(f or ()))
                t = object.__new__(Task)  # a shallow copy: much cheaper than dataclasses.replace here
                t.__dict__.update(fields)
            tasks.append(t)
        out[bk] = Block(bk[0], bk[1], tuple(tasks))
    return out
