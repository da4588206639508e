"""The forward passes: the pieces of weights each device holds, the conversions that bring each
operator its inputs in the layout it needs, and one forward task per piece."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from planlab.graph.ir import Operator
from planlab.graph.random_ops import draws_random
from planlab.plan import buffer as buf_
from planlab.plan.buffer import Buffer
from planlab.plan.layout import box_shape
from planlab.plan.passes.draft import (
    Counters,
    Draft,
    Part,
    add,
    convert,
    line,
    piece_base,
    piece_fields,
    record_ring_in_flight,
    record_size,
    ring_fields,
)
from planlab.plan.program import Role, Task, TaskKind
from planlab.plan.fused_gemms import fused_fields
from planlab.plan.redistribute import same_layout
from planlab.plan.saved import (
    cast_inputs,
    fp8_cast,
    internals,
    output_layer,
    saved_buffers,
    step_microbatches,
    view_of,
    weight_matmul,
)
from planlab.plan.shared_params import check_tied, check_shared_params, claim, use_shared_param
from planlab.plan.template import Places, distinct

# Operators whose pieces, split along the named dimension, agree with each other inside their
# forward (Megatron's vocabulary-parallel loss: all-reduces of each token's largest logit and sum of
# exponentials, planlab.executor.vocab_parallel): each piece's forward task carries the group of the
# devices holding the other slices (``Task.group``, in the order of the slices).
IN_OP_GROUPS = {"vocab_cross_entropy": "v"}


def place_weights(d: Draft) -> Draft:
    """Each device's pieces of each parameter (in the order operators read them) and the operator
    whose backward makes each parameter's gradient (its owner). A parameter read by several
    operators (:mod:`planlab.plan.shared_params`) is held once a piece on each device: where all
    but one read it without a backward (recycling's passes behind a detach), or where several with
    a backward read it alike (tied weights: the first in the graph's order owns the gradient, the
    others add into it; readers placed differently are refused)."""
    L, graph = d.layouts, d.graph
    params: dict[int, list] = defaultdict(list)
    owner: dict = {}
    tied: dict[str, list] = defaultdict(list)  # per tied parameter, its readers besides the owner
    held: dict[int, set] = defaultdict(set)
    for op in graph.operators:
        mesh = L.mesh[op.name]
        for ti, t in enumerate(op.inputs):
            if graph.tensors[t].role != "param":
                continue
            pieces = [(dev, L.needs(op, ti).box(flat, L.shapes[t])) for flat, dev in d.positions(mesh)]
            if d.nograd:  # planlab/search_spaces/recycling.py
                use_shared_param(op, ti, t, pieces, owner, d.forward_only, params, held)
                continue
            if t in owner and owner[t][0] is not op:  # a tied weight's later reader
                tied[t].append((op, ti))
                continue
            claim(owner, op, ti, t)
            for dev, box in pieces:
                params[dev].append((t, box))
    if tied:
        check_tied(
            owner,
            tied,
            lambda op, k: (
                [(dev, L.needs(op, k).box(flat, L.shapes[op.inputs[k]])) for flat, dev in d.positions(L.mesh[op.name])],
                L.contributes(op, k),
            ),
        )
    if d.nograd:
        check_shared_params(
            params,
            {
                p: [(dev, L.needs(op, k).box(flat, L.shapes[p])) for flat, dev in d.positions(L.mesh[op.name])]
                for p, (op, k) in owner.items()
            },
        )
    return d.replace(params={dev: tuple(v) for dev, v in params.items()}, owner=owner)


def convert_inputs(d: Draft) -> Draft:
    """The buffer each operator reads each input from: a weight piece, the producer's output where
    the layouts agree, else a conversion (collectives on one mesh, point-to-point copies between
    meshes, :mod:`planlab.plan.redistribute`) or, for a model input or module buffer, a load of
    this micro-batch's piece. A tensor converted to one layout once is read from there by every
    later consumer in that layout. The tasks sit in the consumer's slot (``INPUTS``), the sends on
    the producer's stage in the same slot: every channel carries its messages in the order they
    are received (NCCL matches in order)."""
    L, graph = d.layouts, d.graph
    parts, sizes = dict(d.parts), d.copy_sizes()
    converted: dict[tuple, Buffer] = {}
    versions: dict[str, int] = defaultdict(int)  # layouts of each tensor made so far
    reads: dict[str, tuple[Buffer, ...]] = {}
    counters = Counters.of(d)
    tensors, names = graph.tensors, d.names
    # per operator of a repeated block's first run, per input: WEIGHT or OWN where it reads a weight
    # or its producer's output as it is; the group's other runs read theirs alike (what decides,
    # the tensor's role and the layouts it has and needs, is theirs too: planlab.plan.template)
    blocks, direct = d.repeats, {}
    for i, op in enumerate(graph.operators):
        key = (d.stage[op.name], "F")
        bufs = []
        first = blocks.first(i)
        mapped = direct.get(first) if first is not None and first != i else None
        taken = [] if first == i else None
        needs = L.form(op).needs
        for ti, t in enumerate(op.inputs):
            how = mapped[ti] if mapped is not None else None
            if how is _WEIGHT:
                bufs.append(names.weight(t))
                continue
            if how is _OWN:
                bufs.append(names.activation(t))
                continue
            if taken is not None:
                taken.append(None)
            spec, need = tensors[t], needs[ti]
            if spec.role == "param":
                bufs.append(names.weight(t))
                if taken is not None:
                    taken[ti] = _WEIGHT
                continue
            source = spec.role in ("input", "buffer")
            prod = None if source else graph.producer[t]
            if prod is not None:  # an activation read in its producer's layout (never converted to it)
                have = L.form(prod).has[prod.outputs.index(t)]
                if same_layout(have, need):
                    bufs.append(names.activation(t))
                    if taken is not None:
                        taken[ti] = _OWN
                    continue
            if (t, need) in converted:
                bufs.append(converted[(t, need)])
                continue
            if source:
                buf = buf_.activation(t, versions[t])
                for flat, dev in d.positions(L.mesh[op.name]):
                    task = _load(d, t, need.box(flat, L.shapes[t]), buf)
                    add(parts, dev, key, i, Part.INPUTS, task)
                    record_size(sizes, dev, task, d.elem_bytes(t))
            else:
                buf = buf_.activation(t, versions[t] + 1)
                at = ((d.stage[prod.name], "F"), key, i)
                convert(d, parts, sizes, counters, have, need, t, (d.names.activation(t), buf), at, name=f"{t}:")
            converted[(t, need)] = buf
            versions[t] += 1
            bufs.append(buf)
        reads[op.name] = tuple(bufs)
        if taken is not None:
            direct[i] = taken
    return d.replace(parts=parts, sizes=sizes, reads=reads, **counters.fields())


# how a repeated block's operator reads an input without a conversion (convert_inputs)
_WEIGHT, _OWN = "weight", "own"


def _load(d: Draft, t: str, box: tuple, buf: Buffer) -> Task:
    """The load of this micro-batch's piece ``box`` of source tensor ``t`` into ``buf`` (of ``t`` in
    zigzag order along its sequence under ``Plan.zigzag``: :mod:`planlab.plan.zigzag`)."""
    spec, graph = d.graph.tensors[t], d.graph
    batch_axis = next((a for a in range(len(spec.shape)) if graph.labels.get((t, a)) == graph.batch_label), -1)
    return Task(
        f"load:{t}",
        TaskKind.LOCAL,
        (buf_.source(t),),
        (buf,),
        src_region=box,
        shape=box_shape(box),
        axis=batch_axis,
        dtype=spec.dtype,
        role=Role.LOAD,
        order=d.layouts.zigzag.order(t) if d.layouts.zigzag else None,
    )


def _view_read(d: Draft, mesh):
    """The buffer a broadcast view operator read, where it runs on ``mesh`` too (the storage a
    backward that keeps its view keeps, :func:`planlab.plan.saved.view_of`); else None."""
    return lambda view: d.reads[view.name][0] if d.layouts.mesh[view.name] == mesh else None


def forward_pieces(d: Draft) -> Draft:
    """One forward task per piece of every operator, reading what :func:`convert_inputs` made and
    writing the operator's outputs in its own layout; what its backward keeps (``saved``: the
    operator's saved tensors as this piece holds them and the internal buffers its implementation
    keeps, :mod:`planlab.plan.saved`) and the piece's local shapes (for the cost model) are recorded
    per operator. A random operator's task carries its box in the micro-batch's whole output
    (``box``): its draws are keyed by it (:mod:`planlab.executor.randomness`)."""
    L, graph = d.layouts, d.graph
    parts, sizes = dict(d.parts), d.copy_sizes()
    saved_of, shapes_of = {}, {}
    pieces: dict[tuple[int, int], Task] = {}  # per (form, position): what its pieces share there (piece_base)
    activation, m = d.names.activation, d.microbatches
    blocks, templates = d.repeats, {}  # a repeated block's operators mapped (planlab.plan.template)
    for i, op in enumerate(graph.operators):
        first = blocks.first(i)
        if first is not None and first != i:
            template = templates.get(first)
            if template is not None and _mapped(d, op, template, parts, sizes, saved_of, shapes_of):
                continue
        mesh, bufs = L.mesh[op.name], d.reads[op.name]
        outs = tuple(activation(o) for o in op.outputs)
        saved = saved_buffers(op, bufs, outs, graph, L.has, L.needs, d.software, d.precision, _view_read(d, mesh))
        saved_of[op.name] = saved
        form = L.form(op)
        shapes = shapes_of[op.name] = form.shapes
        share = (form.pieces, m)  # what divides its work, as draft.shares gives it
        random = draws_random(op)
        key = (d.stage[op.name], "F")
        # every piece's buffers have the same bytes (splits divide evenly)
        made = _piece_bytes(d, op, outs, shapes[len(op.inputs) :]) | _cast_bytes(d, op, saved)
        with_weight = weight_matmul(op, graph)
        own = piece_fields(
            op,
            bufs,
            outs,
            op.flops,
            share,
            saved=saved,
            box=None,
            weight_matmul=with_weight,
            output_layer=output_layer(op, graph),
            step_microbatches=step_microbatches(op.kind, with_weight, m),  # kept FP8 weight casts
            **fused_fields(d, op),
        )  # alike at every position
        for flat, dev in d.positions(mesh):
            base = pieces.get((form.index, flat))
            if base is None:
                base = pieces[(form.index, flat)] = piece_base(TaskKind.FORWARD, flat, **_piece_fields(d, op, flat))
            if random:
                own["box"] = L.has(op, 0).box(flat, L.shapes[op.outputs[0]])
            task = base.with_changes(own)
            if base.ring is not None:
                record_ring_in_flight(d, sizes, dev, op, flat, TaskKind.FORWARD)
            add(parts, dev, key, i, Part.COMPUTE, task)
            sizes.setdefault(dev, {}).update(made)
        if first == i:
            templates[i] = _template(d, op, parts, key, made, saved, shapes)
    return d.replace(parts=parts, sizes=sizes, saved=saved_of, piece_shapes=shapes_of)


@dataclass(frozen=True)
class _Made:
    """A template operator's forward pieces, as its instances take them (:func:`_mapped`): its
    devices and their tasks, where its saved buffers and the buffers it makes are among what it
    reads and writes (:class:`~planlab.plan.template.Places`), those buffers' bytes, its shapes."""

    devices: tuple[int, ...]
    tasks: tuple[Task, ...]
    saved: Places
    made: Places
    nbytes: tuple[int, ...]
    shapes: tuple


def _template(d: Draft, op: Operator, parts, key, made: dict, saved: tuple, shapes: tuple) -> _Made | None:
    """What an instance of ``op`` takes from it (:class:`_Made`); None where nothing can be taken:
    a ring attention (its buffers in flight are sized per operator), a buffer read in two places."""
    bufs = d.reads[op.name] + tuple(map(d.names.activation, op.outputs))
    if d.layouts.op_plan[op.name].ring or not distinct(bufs):
        return None
    where, made_at = Places.of(saved, bufs, op.name), Places.of(made, bufs, op.name)
    if where is None or made_at is None:
        return None
    devs = tuple(dev for _, dev in d.positions(d.layouts.mesh[op.name]))
    tasks = tuple(parts[(dev, key, d.topo[op.name], Part.COMPUTE)][0] for dev in devs)
    return _Made(devs, tasks, where, made_at, tuple(made.values()), shapes)


def _mapped(d: Draft, op: Operator, template: _Made, parts, sizes, saved_of, shapes_of) -> bool:
    """Put the forward pieces of ``op``, an instance of ``template``'s operator, in the pass's
    products (parts, sizes, saved, piece shapes): the template's tasks with ``op``'s names; False
    where its buffers are not as many distinct ones (``op`` is then built)."""
    name, reads = op.name, d.reads[op.name]
    outs = tuple(map(d.names.activation, op.outputs))
    bufs = reads + outs
    if not distinct(bufs):
        return False
    saved = template.saved.take(bufs, name)
    changes = {"name": name, "op": name, "reads": reads, "writes": outs, "saved": saved}
    made = dict(zip(template.made.take(bufs, name), template.nbytes))
    key, i = (d.stage[name], "F"), d.topo[name]
    for dev, task in zip(template.devices, template.tasks):
        add(parts, dev, key, i, Part.COMPUTE, task.with_changes(changes))
        mine = sizes.get(dev)  # (not setdefault: that makes a dict every call)
        if mine is None:
            mine = sizes[dev] = {}
        mine.update(made)
    saved_of[name], shapes_of[name] = saved, template.shapes
    return True


def _piece_fields(d: Draft, op: Operator, flat: int) -> dict:
    """The fields of the forward task of piece ``flat`` of ``op`` that every operator of its form
    (:meth:`~planlab.plan.passes.layouts.Layouts.form`) shares there: its output's and all its local
    shapes, whether it leads its partial sums (``lead``: first along the mesh axes that split a
    reduced dimension), and its ring (:func:`ring_fields`) or the group its pieces agree in
    (:data:`IN_OP_GROUPS`)."""
    L = d.layouts
    mesh, dims, shapes = L.mesh[op.name], L.dims[op.name], L.form(op).shapes
    red_axes = [a for a, dim in enumerate(dims) if dim in op.signature.reduce]
    agree = [a for a, dim in enumerate(dims) if dim is not None and dim == IN_OP_GROUPS.get(op.kind)]
    ring = ring_fields(d, op, flat)
    return dict(
        shape=shapes[len(op.inputs)],
        lead=all(mesh.coord(flat)[a] == 0 for a in red_axes),
        shapes=shapes,
        **(ring or {"group": line(mesh, flat, agree)}),
    )


def _cast_bytes(d: Draft, op: Operator, saved: tuple[Buffer, ...]) -> dict[Buffer, int]:
    """The bytes of the FP8 casts of its inputs one piece of ``op`` keeps for its backward
    (:func:`~planlab.plan.saved.cast_inputs`), each in the layout of the buffer it cast."""
    L, out = d.layouts, {}
    cast = cast_inputs(op, d.graph, d.precision, d.software)
    if not cast:
        return out
    for j, t in enumerate(op.inputs):
        prod = d.graph.producer.get(t)
        if t not in cast or prod is None:
            continue
        for b, lay in ((d.reads[op.name][j], L.needs(op, j)), (buf_.activation(t), L.has(prod, prod.outputs.index(t)))):
            if fp8_cast(b) in saved:
                out[fp8_cast(b)] = math.ceil(math.prod(L.local_shape(lay, t)) * cast[t])
    return out


def _piece_bytes(d: Draft, op: Operator, outs: tuple[Buffer, ...], out_shapes: tuple) -> dict[Buffer, int]:
    """The bytes of the buffers one forward piece of ``op`` makes: its outputs (local shapes
    ``out_shapes``) and the internal buffers its implementation keeps for the backward, each a share
    of a base tensor's piece (:func:`~planlab.plan.saved.internals`). A broadcast view
    (:func:`~planlab.plan.saved.view_of`: ``Tensor.expand``, stride 0 on the new axes) takes the bytes
    of the storage under it, its input's piece, which it holds alive, not its own size."""
    L = d.layouts
    made = {b: math.prod(shape) * d.elem_bytes(o) for b, shape, o in zip(outs, out_shapes, op.outputs)}
    if view_of(op.outputs[0], d.graph) is op:  # a broadcast view: no storage but its input's, which it holds
        made[outs[0]] = math.prod(L.local_shape(L.needs(op, 0), op.inputs[0])) * d.elem_bytes(op.inputs[0])
    for tag, base, per, nbytes in internals(op, d.graph, d.software, d.precision.activation_bytes):
        j = op.inputs.index(base) if base in op.inputs else None
        lay = L.needs(op, j) if j is not None else L.has(op, op.outputs.index(base))
        made[buf_.internal(op.name, tag)] = int(math.prod(L.local_shape(lay, base)) * per * nbytes)
    return made
