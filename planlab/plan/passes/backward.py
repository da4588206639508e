"""The backward passes: the gradient of each operator's outputs brought back into the layout the
operator made them in (its consumers' contributions summed and converted), then one backward task
per piece. Operators are visited in reverse topological order, so an operator whose outputs reach
no loss (no consumer gives it a gradient) is known to have no backward before its producers are
visited."""

from __future__ import annotations

import math
from dataclasses import dataclass

from planlab.graph.ir import DETACH, Operator
from planlab.plan import buffer as buf_
from planlab.plan.buffer import Buffer, BufferKind
from planlab.plan.layout import Layout, box_shape
from planlab.plan.passes.draft import (
    Counters,
    Draft,
    Part,
    add,
    convert,
    piece_base,
    piece_fields,
    piece_task,
    record_ring_in_flight,
    record_size,
    ring_fields,
    shares,
)
from planlab.plan.program import Task, TaskKind
from planlab.plan.fused_gemms import fused_fields, fused_groups
from planlab.plan.saved import output_layer, weight_matmul
from planlab.plan.shared_params import constants_of
from planlab.plan.redistribute import same_layout


def convert_gradients(d: Draft) -> Draft:
    """Per operator, in reverse topological order, the buffer of each output's gradient (None:
    the loss, seeded by the executor, or an output without one): a single consumer's contribution
    where it already comes in the operator's layout, else the contributions summed into a ``GRAD``
    buffer by conversions (accumulating); contributions of one layout on the operator's own devices
    are summed locally first (``GRAD_SUM``), so that one conversion carries them all. The tasks sit
    in the operator's backward slot (``INPUTS``), a conversion's sends on the consumer's stage.
    Operators none of whose outputs get a gradient have no backward (``dead``)."""
    graph = d.graph
    parts, sizes = dict(d.parts), d.copy_sizes()
    dead: set[str] = set()
    grads: dict[str, tuple[Buffer | None, ...]] = {}
    counters = Counters.of(d)
    ops, loss, nograd, tensors, consumers = graph.operators, graph.loss, d.nograd, graph.tensors, graph.consumers
    constants = constants_of(graph)  # a *_like factory's zeros and their views: no gradient
    writer = fused_writers(d)  # a fused projection's contribution to its input is its group's
    for i in range(len(ops) - 1, -1, -1):
        op = ops[i]
        gbufs = []
        for j, t in enumerate(op.outputs):
            if t == loss or t in nograd or t in constants or not tensors[t].is_float:
                gbufs.append(None)  # the loss: seeded with ones by the executor
                continue
            uses = list(
                dict.fromkeys(
                    (graph.op(writer[c.name]) if k == 0 and c.name in writer else c, k)
                    for c in consumers.get(t, ())
                    if c.name not in dead
                    for k, x in enumerate(c.inputs)
                    if x == t
                )
            )  # a consumer whose outputs reach no loss gives no gradient; a fused GEMM gives one
            if not uses:
                gbufs.append(None)
                continue
            target = d.layouts.form(op).grads[j]
            if len(uses) == 1 and same_layout(d.layouts.contributes(*uses[0]), target):
                c, k = uses[0]
                gbufs.append(d.names.contribution(t, c.name, k))
                continue
            _sum_and_convert(d, parts, sizes, counters, i, t, uses, target)
            gbufs.append(d.names.grad(t))
        grads[op.name] = tuple(gbufs)
        if op.outputs[0] != loss and gbufs.count(None) == len(gbufs):  # no output has a gradient
            dead.add(op.name)
    return d.replace(
        parts=parts,
        sizes=sizes,
        grads=grads,
        dead=frozenset(dead),
        **counters.fields(),
    )


def _sum_and_convert(d: Draft, parts, sizes, counters: Counters, i: int, t: str, uses, target: Layout) -> None:
    """The tasks that sum the contributions ``uses`` to tensor ``t``'s gradient into its ``GRAD``
    buffer in layout ``target`` (see :func:`convert_gradients`), with the next channels, tags and
    identities of ``counters``."""
    L, op = d.layouts, d.graph.operators[i]
    key = (d.stage[op.name], "B")
    pending: list[tuple[Layout, Buffer, str]] = []  # (layout, buffer, operator on whose stage it is)
    local: dict[Layout, list[tuple[Buffer, Operator]]] = {}
    for c, k in sorted(uses, key=lambda u: -d.topo[u[0].name]):
        lay, buf = L.contributes(c, k), d.names.contribution(t, c.name, k)
        if lay.mesh == target.mesh:
            local.setdefault(lay, []).append((buf, c))
        else:
            pending.append((lay, buf, c.name))
    for lay, items in local.items():
        if len(items) == 1 or same_layout(lay, target):
            pending += [(lay, buf, c.name) for buf, c in items]
            continue
        summed = buf_.grad_sum(t, len(pending))
        _add_sum(d, parts, sizes, i, t, lay, [buf for buf, _ in items], summed, key)
        pending.append((lay, summed, op.name))
    pending = _summed_on_consumers(d, parts, sizes, i, t, pending, d.stage[op.name])
    for lay, buf, src in pending:
        at = ((d.stage[src], "B"), key, i)
        convert(d, parts, sizes, counters, lay, target, t, (buf, d.names.grad(t)), at, accumulate=True, name=f"d{t}:")


def fused_writers(d: Draft) -> dict[str, str]:
    """Per projection that one of the software's fused GEMMs computes (:mod:`planlab.plan.fused_gemms`,
    :meth:`~planlab.costmodel.software.SoftwareSpec.fuses`), its group reading the shared input as one
    buffer and taking its gradient in one layout: the group's member whose backward runs first (the
    last in topological order). Its contribution buffer to the shared input (input 0) is the one the
    whole group writes: the fused GEMM's input-gradient product multiplies the concatenated output
    gradients by the concatenated weights and writes one gradient of the input (Megatron-Core's
    ``linear_fc1`` and ``linear_qkv``, Megatron-LM's ``query_key_value``: one dgrad GEMM each), not
    one per projection summed after. Empty without such a software (the executor's programs)."""
    software = d.software
    if software is None or not (software.fused_qkv or software.fused_gate_up):
        return {}
    out: dict[str, str] = {}
    for name, group in fused_groups(d.graph).items():
        if name in out or not software.fuses(group.fusion):
            continue
        ops = [d.graph.op(n) for n in group.ops]
        if len({d.reads[o.name][0] for o in ops}) != 1:
            continue
        lays = [d.layouts.contributes(o, 0) for o in ops]
        if not all(same_layout(lay, lays[0]) for lay in lays[1:]):
            continue
        first = max(group.ops, key=lambda n: d.topo[n])
        out.update((n, first) for n in group.ops)
    return out


def backward_pieces(d: Draft) -> Draft:
    """One backward task per piece of every operator with a backward: it reads its outputs'
    gradients (:func:`convert_gradients`) and writes its inputs' contributions (``CONTRIBUTION``)
    and its weights' gradients (``WEIGHT_GRAD``), None where an input takes no gradient (an integer,
    a model input, a tensor behind a detach, a constant: :func:`~planlab.graph.ir.constant_tensors`)."""
    L, graph = d.layouts, d.graph
    constants, writer = constants_of(graph), fused_writers(d)
    parts, sizes = dict(d.parts), d.copy_sizes()
    bases: dict[int, Task] = {}  # per position, what the pieces there share (piece_base)
    blocks, templates = d.repeats, {}  # a repeated block's operators mapped (planlab.plan.template)
    for i in range(len(graph.operators) - 1, -1, -1):
        op = graph.operators[i]
        if op.name in d.dead:
            continue
        last = blocks.last(i)  # built in reverse order: the group's last run is the template
        if last is not None and last != i and (template := templates.get(last)) is not None:
            if _mapped(d, op, template, parts, sizes, writer):
                continue
        gbufs = d.grads[op.name]
        needs_grad = [
            graph.tensors[t].is_float
            and graph.tensors[t].role in ("activation", "param")
            and t not in d.nograd
            and t not in constants
            and op.kind != DETACH
            for t in op.inputs
        ]
        if not any(needs_grad):
            continue
        writes = tuple(
            (
                d.names.weight_grad(t)
                if graph.tensors[t].role == "param"
                else d.names.contribution(t, writer.get(op.name, op.name) if k == 0 else op.name, k)
            )
            if ng
            else None
            for k, (t, ng) in enumerate(zip(op.inputs, needs_grad))
        )
        mesh = L.mesh[op.name]
        share = shares(d, op)
        made = {  # every piece's contributions have the same bytes (splits divide evenly)
            w: math.prod(L.local_shape(L.contributes(op, k), t)) * d.elem_bytes(t)
            for k, (t, w) in enumerate(zip(op.inputs, writes))
            if w is not None and w.kind is BufferKind.CONTRIBUTION
        }
        ring = L.op_plan[op.name].ring
        flops = op.flops * op.bwd_flops_ratio
        kept = dict(
            saved=d.saved[op.name],
            shapes=d.piece_shapes.get(op.name, ()),
            weight_matmul=weight_matmul(op, graph),
            output_layer=output_layer(op, graph),
            **fused_fields(d, op),
        )
        own = piece_fields(op, gbufs, writes, flops, share, **kept)  # alike at every position
        for flat, dev in d.positions(mesh):
            if ring:
                task = piece_task(
                    op, TaskKind.BACKWARD, flat, gbufs, writes, flops, share, **kept, **ring_fields(d, op, flat)
                )
            else:  # a copy of what the pieces at this position share: their position alone (ring_fields: none)
                base = bases.get(flat)
                if base is None:
                    base = bases[flat] = piece_base(TaskKind.BACKWARD, flat)
                task = base.with_changes(own)
            if task.ring is not None:
                record_ring_in_flight(d, sizes, dev, op, flat, TaskKind.BACKWARD)
            add(parts, dev, (d.stage[op.name], "B"), i, Part.COMPUTE, task)
            sizes.setdefault(dev, {}).update(made)
        grad_bytes = []
        for j, t in enumerate(op.outputs):
            if gbufs[j] is not None and gbufs[j].kind is BufferKind.GRAD:
                nbytes = math.prod(L.local_shape(L.form(op).grads[j], t)) * d.elem_bytes(t)
                grad_bytes.append((j, nbytes))
                for flat, dev in d.positions(mesh):
                    sizes.setdefault(dev, {})[gbufs[j]] = nbytes
        if last == i and not ring:
            templates[i] = _template(d, op, parts, writes, made, tuple(grad_bytes))
    return d.replace(parts=parts, sizes=sizes)


@dataclass(frozen=True)
class _Made:
    """A template operator's backward pieces, as its instances take them (:func:`_mapped`): its
    devices and their tasks, the kind of each output's gradient buffer (None: none), of each input's
    (``WEIGHT_GRAD``, ``CONTRIBUTION`` or None), the bytes of its contributions and of its
    gradients summed (``GRAD``: output index and bytes)."""

    devices: tuple[int, ...]
    tasks: tuple[Task, ...]
    grads: tuple[BufferKind | None, ...]
    writes: tuple[BufferKind | None, ...]
    nbytes: tuple[int, ...]
    grad_bytes: tuple[tuple[int, int], ...]


def _template(d: Draft, op: Operator, parts, writes: tuple, made: dict, grad_bytes: tuple) -> _Made:
    """What an instance of ``op`` takes from it (:class:`_Made`)."""
    devs = tuple(dev for _, dev in d.positions(d.layouts.mesh[op.name]))
    key, i = (d.stage[op.name], "B"), d.topo[op.name]
    return _Made(
        devs,
        tuple(parts[(dev, key, i, Part.COMPUTE)][0] for dev in devs),
        tuple(g.kind if g is not None else None for g in d.grads[op.name]),
        tuple(w.kind if w is not None else None for w in writes),
        tuple(made.values()),
        grad_bytes,
    )


def _mapped(d: Draft, op: Operator, template: _Made, parts, sizes, writer: dict[str, str]) -> bool:
    """Put the backward pieces of ``op``, an instance of ``template``'s operator, in ``parts`` and
    ``sizes``: the template's tasks with ``op``'s names; False where its gradients do not come as
    the template's (``op`` is then built). ``writer``: :func:`fused_writers`."""
    gbufs, names = d.grads[op.name], d.names
    if tuple(g.kind if g is not None else None for g in gbufs) != template.grads:
        return False
    writes = tuple(
        None
        if kind is None
        else names.weight_grad(t)
        if kind is BufferKind.WEIGHT_GRAD
        else names.contribution(t, writer.get(op.name, op.name) if k == 0 else op.name, k)
        for k, (t, kind) in enumerate(zip(op.inputs, template.writes))
    )
    made = dict(zip((w for w in writes if w is not None and w.kind is BufferKind.CONTRIBUTION), template.nbytes))
    changes = dict(name=op.name, op=op.name, reads=gbufs, writes=writes, saved=d.saved[op.name])
    key, i = (d.stage[op.name], "B"), d.topo[op.name]
    for dev, task in zip(template.devices, template.tasks):
        add(parts, dev, key, i, Part.COMPUTE, task.with_changes(changes))
        sizes.setdefault(dev, {}).update(made)
    for j, nbytes in template.grad_bytes:
        for dev in template.devices:
            sizes.setdefault(dev, {})[gbufs[j]] = nbytes
    return True


def _summed_on_consumers(d: Draft, parts, sizes, i: int, t: str, pending: list, own_stage: int) -> list:
    """``pending`` with the contributions of one layout on a later pipeline stage than the
    producer's ``own_stage`` (a stage's input feeds both a layer norm and the residual add) summed
    there first, so that one message carries their sum back, as autograd accumulates a tensor's
    gradient before Megatron-LM's or DeepSpeed's pipeline sends it (one gradient per stage
    boundary); contributions on the producer's stage stay as they are."""
    groups: dict[tuple, list[tuple[Layout, Buffer, str]]] = {}
    for item in pending:
        groups.setdefault((item[0], d.stage[item[2]]), []).append(item)
    out, version = [], len(pending)  # past every local sum's version (each below len(pending))
    for (lay, stage), items in groups.items():
        if len(items) == 1 or stage == own_stage:
            out += items
            continue
        summed = buf_.grad_sum(t, version)
        version += 1
        _add_sum(d, parts, sizes, i, t, lay, [buf for _, buf, _ in items], summed, (stage, "B"))
        out.append((lay, summed, items[0][2]))
    return out


def _add_sum(d: Draft, parts, sizes, i: int, t: str, lay: Layout, bufs: list, summed: Buffer, key) -> None:
    """On every device of ``lay``'s mesh, the local tasks accumulating the contributions ``bufs``
    to ``t``'s gradient into ``summed``, in operator ``i``'s slot of block ``key`` (``INPUTS``)."""
    L, graph = d.layouts, d.graph
    for flat, dev in d.positions(lay.mesh):
        for buf in bufs:
            task = Task(
                f"d{t}:sum",
                TaskKind.LOCAL,
                (buf,),
                (summed,),
                shape=box_shape(lay.box(flat, L.shapes[t])),
                accumulate=True,
                dtype=graph.tensors[t].dtype,
            )
            add(parts, dev, key, i, Part.INPUTS, task)
            record_size(sizes, dev, task, d.elem_bytes(t))
