"""Where every operator's pieces live: its mesh, the layout each input needs, each output has and
each gradient contribution comes in (after DTensor's placements, :mod:`planlab.plan.layout`)."""

from __future__ import annotations

import math

from dataclasses import dataclass

from planlab.errors import InfeasiblePlan
from planlab.graph.ir import Graph, Operator
from planlab.plan.colocation import CoLocation, colocation
from planlab.plan.layout import Layout, Mesh, Partial, Replicate, Shard, box_shape
from planlab.plan.partial_grads import deferred_axes
from planlab.plan.plan import RING_DIM, RING_KV_DIM, OpPlan, Plan
from planlab.plan.zigzag import sequence_zigzag


@dataclass(frozen=True)
class OpForm:
    """What every operator of one form (:func:`op_forms`) placed alike shares: the layout each input
    needs (``needs``), each output has (``has``) and each input's gradient contribution comes in
    (``contributes``) and each output's gradient is summed into (``grads``: ``has`` with its partial
    sums completed, :func:`full`), its pieces' local shapes per micro-batch (``shapes``: inputs, then
    outputs; :func:`piece_shapes`) and how many pieces it is split into (``pieces``); ``index`` numbers the
    forms of one :class:`Layouts` (what passes key their own per-form tables by)."""

    needs: tuple[Layout, ...]
    has: tuple[Layout, ...]
    contributes: tuple[Layout, ...]
    grads: tuple[Layout, ...]
    shapes: tuple[tuple[int, ...], ...]
    pieces: int
    index: int


class Layouts:
    """Mesh and layouts of every operator, at micro-batch shapes; co-located operators (coshard) in
    ``chunks``. Operators of one form (:func:`op_forms`) on one placement share an :class:`OpForm`
    (layers repeat: a model's thousands of operators have a few hundred). Refuses (InfeasiblePlan) a plan that names an operator the graph does not have,
    leaves one unplaced, places it on devices the plan does not have, or splits a dimension that
    cannot be split or does not divide."""

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
        if m > 1 and (whole := whole_batch_read(graph)):
            # its size under a micro-batch is not the plan's
            raise InfeasiblePlan(
                f"operator {whole[0].name!r} ({whole[0].kind}) reads the batch axis {whole[2]} of {whole[1]!r} whole "
                f"(its signature cannot split it), so it cannot run on one of {m} micro-batches: use 1 micro-batch"
            )
        # shared by every plan of m micro-batches of the graph (read only)
        self.shapes: dict[str, tuple[int, ...]] = graph.memo(
            ("microbatch_shapes", m), lambda: microbatch_shapes(graph, m)
        )
        self._local: dict[tuple[Layout, tuple[int, ...]], tuple[int, ...]] = {}
        self.mesh: dict[str, Mesh] = {}
        self.dims: dict[str, tuple[str | None, ...]] = {}
        self._placed: dict[tuple, Layout] = {}
        self._forms: dict[str, OpForm] = {}  # per operator
        self._form_of: dict[tuple, OpForm] = {}  # per (form, placement, ring)
        self._op_form = graph.memo(("op_forms", m), lambda: op_forms(graph, self.shapes))
        # per operator, its placement's index: one index, one (dims, sizes, devices) of its OpPlan
        self.placement: dict[str, int] = {}
        self.chunks: dict[str, CoLocation] = {}  # co-located operators (coshard)
        placed: dict[tuple, tuple] = {}  # layers repeat: operators share a few placements, checked once each
        interned: dict[Mesh, Mesh] = {}
        checked: set[tuple] = set()
        # a placement's devices numbered by their value, each tuple object (many operators share one) hashed once
        devices: dict[tuple[int, ...], int] = {}
        by_object: dict[int, int] = {}
        for op in graph.operators:
            p = self.op_plan[op.name]
            k = by_object.get(id(p.devices))
            if k is None:
                k = by_object[id(p.devices)] = devices.setdefault(p.devices, len(devices))
            key = (p.sizes, p.dims, k)
            got = placed.get(key)
            if got is None:
                co, mesh, mdims = self._place_op(op.name, p, plan.num_devices)
                got = placed[key] = (co, interned.setdefault(mesh, mesh), mdims, len(placed))
            co, mesh, mdims, self.placement[op.name] = got
            dims, sizes = (p.dims, p.sizes) if p.sizes else ((None,), (1,))
            if co is not None:
                self.chunks[op.name] = co
            self.mesh[op.name] = mesh  # one object per mesh: its caches are shared
            self.dims[op.name] = mdims
            check = (self._op_form[op.name], self.placement[op.name], p.ring)
            if check not in checked:  # operators of one form placed alike pass or fail alike
                self._check_splits(op, p, dims, sizes)
                checked.add(check)
        rings = {p.op: math.prod(s for x, s in zip(p.dims, p.sizes) if x == RING_DIM) for p in plan.ops if p.ring}
        self.zigzag = sequence_zigzag(plan, graph, rings)  # the tokens' order (Plan.zigzag), or None
        if plan.kv_gather and not rings:
            raise InfeasiblePlan(
                "kv_gather: the plan runs no attention as a ring; the all-gather is a ring's keys and values"
            )
        self.kv_gather = plan.kv_gather  # the rings all-gather their keys and values (Ring.gather)
        # per operator with any: the data-parallel axes its gradients stay partial sums along
        self.deferred = deferred_axes(graph, self.mesh, self.dims)

    def _check_splits(self, op: Operator, p: OpPlan, dims: tuple, sizes: tuple) -> None:
        """Refuse (InfeasiblePlan) a ring attention without a mesh axis along its sequence, and a
        dimension of ``op`` split along ``dims`` (``sizes``) that cannot be split or does not divide."""
        if p.ring and RING_DIM not in dims:
            raise InfeasiblePlan(
                f"operator {op.name!r} runs as ring attention but no mesh axis splits its sequence {RING_DIM!r}"
            )
        for d in set(x for x in dims if x is not None):
            if not op.signature.splittable(d) and not (p.ring and d == RING_DIM):
                raise InfeasiblePlan(f"dimension {d!r} of operator {op.name!r} ({op.signature}) cannot be split")
            n = math.prod(s for x, s in zip(dims, sizes) if x == d)
            size = self._dim_size(op, d)
            if size % n:
                raise InfeasiblePlan(
                    f"dimension {d!r} of operator {op.name!r} has size {size} per "
                    f"micro-batch, which does not split into {n} pieces"
                )

    @staticmethod
    def _place_op(name: str, p: OpPlan, num_devices: int) -> tuple[CoLocation | None, Mesh, tuple]:
        """The co-location, mesh and mesh dimensions of a placement (``p``'s sizes, dims and devices),
        first met at operator ``name``; refuses (InfeasiblePlan) pieces that do not match their devices."""
        sizes, dims = (p.sizes, p.dims) if p.sizes else ((1,), (None,))
        if len(p.devices) != math.prod(sizes):
            raise InfeasiblePlan(f"operator {name!r} has {math.prod(sizes)} pieces but {len(p.devices)} devices")
        if p.devices and not (0 <= min(p.devices) and max(p.devices) < num_devices):
            bad = [d for d in p.devices if not 0 <= d < num_devices]
            raise InfeasiblePlan(
                f"operator {name!r} is placed on device {bad[0]}; the plan has devices 0..{num_devices - 1}"
            )
        co = colocation(name, tuple(dims), tuple(sizes), tuple(p.devices))
        mdims, msizes, mdevices = (dims, sizes, p.devices) if co is None else co.reduce(dims, sizes, p.devices)
        if co is not None:  # each device holds the n-way share its k pieces make, run as k chunks
            mdims, msizes = (mdims, msizes) if msizes else ((None,), (1,))
        return co, Mesh(tuple(msizes), tuple(mdevices)), tuple(mdims)

    def _dim_size(self, op: Operator, dim: str) -> int:
        for t in op.inputs + op.outputs:
            for a, ax in enumerate(op.axes_of(t)):
                if ax and ax[0] == dim:
                    full = self.shapes[t][a]
                    inner = math.prod(op.dim_sizes[n] for n in ax[1:])
                    return full // inner
        return op.dim_sizes[dim]

    def _place(
        self, op: Operator, tensor_axes, partial_dims=frozenset(), contrib=False, kv=False, partial_axes=frozenset()
    ) -> Layout:
        dims, mesh = self.dims[op.name], self.mesh[op.name]
        if kv:  # a ring attention's keys and values: split along their sequence where its queries are
            dims = tuple(RING_KV_DIM if d == RING_DIM else d for d in dims)
        key = (
            mesh,
            dims,
            tuple(tensor_axes),
            contrib,
            frozenset(d for d in dims if d in partial_dims) if partial_dims else frozenset(),
            partial_axes,
        )
        got = self._placed.get(key)  # layers repeat: most operators share a few layouts
        if got is None:
            got = self._placed[key] = self._make_layout(dims, mesh, tensor_axes, partial_dims, contrib, partial_axes)
        return got

    @staticmethod
    def _make_layout(dims, mesh: Mesh, tensor_axes, partial_dims, contrib: bool, partial_axes=frozenset()) -> Layout:
        """The placements ``dims`` give a tensor of ``tensor_axes`` on ``mesh``: sharded where a
        dimension is the tensor's, partial where it is a reduction (``partial_dims``) or, for a
        gradient contribution (``contrib``), any dimension the tensor lacks, and along
        ``partial_axes`` (a gradient left partial over data-parallel replicas,
        :mod:`planlab.plan.partial_grads`); replicated elsewhere."""
        out = []
        for a_mesh, d in enumerate(dims):
            axis = next((a for a, ax in enumerate(tensor_axes) if ax and ax[0] == d), None) if d else None
            if a_mesh in partial_axes:
                out.append(Partial())
            elif d is None:
                out.append(Replicate())
            elif axis is not None:
                out.append(Shard(axis))
            elif contrib or d in partial_dims:
                out.append(Partial())
            else:
                out.append(Replicate())
        return Layout(mesh, tuple(out))

    def local_shape(self, layout: Layout, tensor: str) -> tuple[int, ...]:
        """The shape of every piece of ``tensor`` in ``layout`` per micro-batch (splits divide evenly,
        so every position's box has it: ``box_shape(layout.box(flat, shapes[tensor]))``)."""
        key = (layout, self.shapes[tensor])
        got = self._local.get(key)
        if got is None:
            got = self._local[key] = box_shape(layout.box(0, key[1]))
        return got

    def form(self, op: Operator) -> OpForm:
        """What ``op`` shares with every operator of its form on its placement (:class:`OpForm`)."""
        got = self._forms.get(op.name)
        if got is None:
            key = (
                self._op_form[op.name],
                self.placement[op.name],
                self.op_plan[op.name].ring,
                self.deferred.get(op.name, frozenset()),
            )
            got = self._form_of.get(key)
            if got is None:
                got = self._form_of[key] = self._make_form(op)
            self._forms[op.name] = got
        return got

    def _make_form(self, op: Operator) -> OpForm:
        sig, ins = op.signature, range(len(op.inputs))
        deferred = self.deferred.get(op.name, frozenset())  # gradients left partial over these axes
        needs = tuple(self._place(op, sig.inputs[i], kv=self.is_ring_kv(op, i)) for i in ins)
        has = tuple(self._place(op, axes, sig.reduce) for axes in sig.outputs)
        contributes = tuple(
            self._place(op, sig.inputs[i], contrib=True, kv=self.is_ring_kv(op, i), partial_axes=deferred) for i in ins
        )
        shapes = tuple(self.local_shape(lay, t) for lay, t in zip(needs, op.inputs))
        shapes += tuple(self.local_shape(lay, t) for lay, t in zip(has, op.outputs))
        pieces = math.prod(s for dim, s in zip(self.dims[op.name], self.mesh[op.name].shape) if dim is not None)
        grads = tuple(full(lay, keep=deferred) for lay in has)
        return OpForm(needs, has, contributes, grads, shapes, pieces, len(self._form_of))

    def needs(self, op: Operator, i: int) -> Layout:
        """Layout in which ``op`` reads its ``i``-th input (full values of its piece)."""
        return self.form(op).needs[i]

    def is_ring_kv(self, op: Operator, i: int) -> bool:
        """Whether input ``i`` of ``op`` is a ring attention's keys or values (split along ``t``)."""
        return i in (1, 2) and self.op_plan[op.name].ring

    def has(self, op: Operator, j: int) -> Layout:
        """Layout in which ``op`` produces its ``j``-th output."""
        return self.form(op).has[j]

    def contributes(self, op: Operator, i: int) -> Layout:
        """Layout of the gradient contribution ``op``'s backward gives its ``i``-th input."""
        return self.form(op).contributes[i]


def op_forms(graph: Graph, shapes: dict[str, tuple[int, ...]]) -> dict[str, int]:
    """Each operator's form, numbered in order of appearance: operators of one form (one kind and
    signature, their tensors of the same ``shapes`` (per micro-batch), the same dimension sizes)
    placed alike have the same layouts and pieces (:meth:`Layouts.form`) and pass or fail the same
    checks of their splits, whatever their names. Found from the graph's traced forms
    (:func:`traced_forms`), which the micro-batch count can only merge: one key per traced form."""
    of_op, firsts = traced_forms(graph)
    index: dict[tuple, int] = {}
    number = []  # per traced form, its form here (traced forms in order of their first operator)
    for op in firsts:
        key = (
            op.kind,
            op.signature,
            tuple(shapes[t] for t in op.inputs),
            tuple(shapes[t] for t in op.outputs),
            tuple(op.dim_sizes.items()),
        )
        number.append(index.setdefault(key, len(index)))
    return {name: number[k] for name, k in of_op.items()}


def traced_forms(graph: Graph) -> tuple[dict[str, int], tuple[Operator, ...]]:
    """Each operator's form at the traced shapes, numbered in order of appearance, and each form's
    first operator: one kind and signature, its tensors of the same shapes and batch axes, the same
    dimension sizes. A tensor's shape per micro-batch is a function of its shape and batch axes
    (:func:`microbatch_shapes`), so operators of one traced form are of one form (:func:`op_forms`)
    for any micro-batch count; cached per graph (and with the trace, as a function of the graph
    alone: :func:`planlab.models.trace_cache.derived`)."""

    def compute() -> tuple[dict[str, int], tuple[Operator, ...]]:
        batch, tensors = batch_axes(graph), graph.tensors
        index: dict[tuple, int] = {}
        out: dict[str, int] = {}
        firsts: list[Operator] = []
        for op in graph.operators:
            key = (
                op.kind,
                op.signature,
                tuple((tuple(tensors[t].shape), batch.get(t)) for t in op.inputs),
                tuple((tuple(tensors[t].shape), batch.get(t)) for t in op.outputs),
                tuple(op.dim_sizes.items()),
            )
            k = out[op.name] = index.setdefault(key, len(index))
            if k == len(firsts):
                firsts.append(op)
        return out, tuple(firsts)

    return graph.memo(TRACED_FORMS_KEY, compute)


# the graph's memo key of :func:`traced_forms`
TRACED_FORMS_KEY = ("layouts: traced forms",)


# Operators sized at trace time whose whole-batch value the executor narrows to a micro-batch's rows
# (planlab.executor.pieces.SIZED_AT_TRACE)
NARROWED_TO_MICROBATCH = frozenset({"constant", "factory"})


def microbatch_shapes(graph: Graph, m: int) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape per micro-batch of ``m``: its batch axes divided by ``m``; refuses
    (InfeasiblePlan) a batch axis that does not split into ``m``."""
    batch = batch_axes(graph)
    shapes: dict[str, tuple[int, ...]] = {}
    for t, spec in graph.tensors.items():
        axes = batch.get(t)
        if not axes:
            shapes[t] = tuple(spec.shape)
            continue
        shape = list(spec.shape)
        for a in axes:
            if a < len(shape):
                if shape[a] % m:
                    raise InfeasiblePlan(
                        f"batch axis {a} of {t!r} (size {shape[a]}) does not split into {m} micro-batches"
                    )
                shape[a] //= m
        shapes[t] = tuple(shape)
    return shapes


def batch_axes(graph: Graph) -> dict[str, tuple[int, ...]]:
    """Per tensor with any, the axes of it labelled as the batch (:attr:`Graph.batch_label`), in
    order; cached per graph."""

    def compute() -> dict[str, tuple[int, ...]]:
        label, out = graph.batch_label, {}
        for (t, a), lab in graph.labels.items():
            if lab == label:
                out.setdefault(t, []).append(a)
        return {t: tuple(sorted(axes)) for t, axes in out.items()}

    return graph.memo(("batch_axes",), compute)


def whole_batch_read(graph: Graph) -> tuple[Operator, str, int] | None:
    """The first operator (with the tensor and axis) that reads a batch axis as a dimension it cannot
    split (``x.narrow(0, ...)``, ``x.split(4, dim=0)``, an operator kept whole for want of a
    signature): what it does with sizes fixed at the traced batch differs on a micro-batch; cached
    per graph."""
    return graph.memo(("whole_batch_read",), lambda: _whole_batch_read(graph))


def _whole_batch_read(graph: Graph) -> tuple[Operator, str, int] | None:
    batch = batch_axes(graph)
    for op in graph.operators:
        if op.kind in NARROWED_TO_MICROBATCH:
            continue
        for t in op.inputs:
            read = batch.get(t)
            if not read:
                continue
            axes = op.axes_of(t)
            for a in read:
                if a >= len(axes):
                    break
                ax = axes[a]  # splittable: one of op.splittable_dims()
                if not (ax and op.signature.splittable(ax[0])):
                    return op, t, a
    return None


def piece_shapes(L: Layouts, op: Operator) -> tuple[tuple[int, ...], ...]:
    """The local shapes of one piece of ``op`` per micro-batch: its inputs as it reads them, then
    its outputs (every piece has the same, since splits divide evenly)."""
    return L.form(op).shapes


def full(layout: Layout, keep: frozenset[int] = frozenset()) -> Layout:
    """``layout`` with its partial sums completed (replicated instead), but along the mesh axes
    ``keep``, where it is a partial sum (:mod:`planlab.plan.partial_grads`)."""
    return Layout(
        layout.mesh,
        tuple(
            Partial() if a in keep else Replicate() if isinstance(p, Partial) else p
            for a, p in enumerate(layout.placements)
        ),
    )
