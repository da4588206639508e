"""Coshard: a device's co-located pieces of an operator run one after another, each recomputed.

Pass 4b of ``materialize``. An operator whose plan puts ``k`` neighbouring pieces on each device
(:mod:`planlab.plan.colocation`) is first built like the ``n``-way split its shares make: one
forward and one backward task per device, the same layouts and collectives. This pass then runs
each device's share as ``k`` chunks, in this order:

1. groups: co-located operators that hand a tensor to one another in the same layout, split
   along the same axis, run their chunks together (chunk 0 of every member, then chunk 1, ...),
   so the tensors between them exist one chunk at a time (buffers ``name@c``);
2. forward: a group's forward tasks become ``k`` rounds of chunk tasks; a chunk reads its slice
   of the tensors that come from outside the group (``Task.slices``) and adds its slice (or, when
   the chunks split a reduction, its partial sum) into the tensors that leave it (``Task.places``);
3. backward: per chunk, the forward of its recomputed members runs again (``re:`` tasks writing
   ``r:name@c``) right before the chunk's backward tasks, whose gradient contributions add into
   slices of the gradients outside the group and of the weight gradients; local sums of
   gradients passed between members run per chunk too;
4. order: the tasks between a group's first and last member that need its results move after
   it, the others before it; a task the group both feeds and needs is refused (InfeasiblePlan).

A co-located operator in a recompute group is recomputed piece by piece here (and left out of
the layer's recomputation); one without keeps every chunk's activations for its backward.
"""

from __future__ import annotations

import math
from collections import defaultdict

from planlab.errors import InfeasiblePlan
from planlab.graph.ir import Graph, Operator
from planlab.plan.colocation import CoLocation
from planlab.plan.layout import Box, box_shape
from planlab.plan.plan import Plan
from planlab.plan.program import Task, TaskKind, is_static
from planlab.plan.redistribute import same_layout


def _axis(axes, dim: str) -> int | None:
    """The tensor axis whose (outer) dimension is ``dim``, or None."""
    return next((a for a, ax in enumerate(axes) if ax and ax[0] == dim), None)


def _chunk(shape: tuple[int, ...], axis: int | None, c: int, k: int) -> Box:
    """Chunk ``c`` of ``k`` along ``axis`` of a local buffer (all of it when ``axis`` is None)."""
    box = [(0, s) for s in shape]
    if axis is not None:
        step = shape[axis] // k
        box[axis] = (c * step, (c + 1) * step)
    return tuple(box)


def groups(graph: Graph, L, stage: dict[str, int]) -> list[list[str]]:
    """Co-located operators whose chunks run together, each group in topological order: those
    joined by tensors that pass, to co-located readers only, in one layout chunked along the
    same axis, and whose gradients pass back in that layout too."""
    chunks: dict[str, CoLocation] = L.chunks
    parent = {name: name for name in chunks}

    def root(x: str) -> str:
        while parent[x] != x:
            parent[x] = x = parent[parent[x]]
        return x

    def hands_on(prod: Operator, j: int, op: Operator, i: int) -> bool:
        cp, co = chunks[prod.name], chunks.get(op.name)
        if co is None or cp.k != co.k or stage[prod.name] != stage[op.name]:
            return False
        a = _axis(prod.signature.outputs[j], cp.dim)
        # the tensor and its gradient pass without a conversion (a gradient summed over the
        # replicas of a tensor that has no batch axis, say, needs a collective: made whole first)
        return a is not None and a == _axis(op.signature.inputs[i], co.dim) and \
            same_layout(L.has(prod, j), L.needs(op, i)) and same_layout(L.contributes(op, i), L.needs(op, i))

    for prod in graph.operators:
        if prod.name not in chunks:
            continue
        for j, t in enumerate(prod.outputs):
            uses = [(c, i) for c in dict.fromkeys(graph.consumers.get(t, [])) for i, x in enumerate(c.inputs) if x == t]
            # a tensor some other operator also reads is made whole first: its producer's chunks run apart
            if uses and all(hands_on(prod, j, c, i) for c, i in uses):
                for c, _ in uses:
                    parent[root(c.name)] = root(prod.name)
    out: dict[str, list[str]] = defaultdict(list)
    for op in graph.operators:
        if op.name in chunks:
            out[root(op.name)].append(op.name)
    return list(out.values())


def run_in_chunks(entries, graph: Graph, L, plan: Plan, buf_bytes: dict[int, dict[str, int]]) -> None:
    """Rewrite every device's blocks (``entries[device][(stage, phase)]``: ``(key, task)`` lists)
    so that co-located operators run as chunks; register the new buffers' sizes."""
    stage = {p.op: p.stage for p in plan.ops}
    recomputed = frozenset(p.op for p in plan.ops if p.recompute and p.op in L.chunks)
    by_stage: dict[int, list[list[str]]] = defaultdict(list)
    for members in groups(graph, L, stage):
        by_stage[stage[members[0]]].append(members)
    shapes: dict[tuple[str, int], tuple] = {}
    for dev, blocks in entries.items():
        for st, found in by_stage.items():
            fkey, bkey = (st, "F"), (st, "B")
            if fkey not in blocks:
                continue
            fw = [t for _, t in sorted(blocks[fkey], key=lambda x: x[0])]
            bw = [t for _, t in sorted(blocks[bkey], key=lambda x: x[0])] if bkey in blocks else []
            run = _Stage(graph, L, recomputed, buf_bytes[dev], shapes)
            fw, bw = run.rewrite(fw, bw, found)
            blocks[fkey] = [((j,), t) for j, t in enumerate(fw)]
            if bkey in blocks:
                blocks[bkey] = [((j,), t) for j, t in enumerate(bw)]


class _Stage:
    """The forward and backward block of one stage on one device, rewritten group by group."""

    def __init__(self, graph: Graph, L, recomputed: frozenset[str], sizes: dict[str, int],
                 shapes: dict[tuple[str, int], tuple]) -> None:
        self.graph, self.L, self.recomputed, self.sizes, self.shapes = graph, L, recomputed, sizes, shapes

    def rewrite(self, fw: list[Task], bw: list[Task], found: list[list[str]]) -> tuple[list[Task], list[Task]]:
        writers: dict[str, set] = defaultdict(set)
        readers: dict[str, set] = defaultdict(set)
        for phase, tasks in (("F", fw), ("B", bw)):
            for i, t in enumerate(tasks):
                for b in t.writes:
                    if b:
                        writers[b].add((phase, i))
                for b in t.reads + t.saved:
                    if b:
                        readers[b].add((phase, i))
        jobs = []
        for members in found:
            mem = set(members)
            fi = [i for i, t in enumerate(fw) if t.kind is TaskKind.FORWARD and t.op in mem]
            if not fi:
                continue  # the group is not on this device
            bi = [i for i, t in enumerate(bw) if t.kind is TaskKind.BACKWARD and t.op in mem]
            group = {("F", i) for i in fi} | {("B", i) for i in bi}
            internal = self._internal(fw, bw, group, bi, writers, readers)
            bi = sorted(i for p, i in group if p == "B")
            jobs.append((fi[0], members, [fw[i] for i in fi], [bw[i] for i in bi], internal))
        # splice the groups in, the last first (each finds its members again by identity)
        for _, members, ftasks, btasks, internal in sorted(jobs, key=lambda j: -j[0]):
            co = self.L.chunks[members[0]]
            made = _Chunks(self, co.k, internal, ftasks)
            fw = _splice(fw, ftasks, [made.forward(t, c) for c in range(co.k) for t in ftasks], members)
            if btasks:
                seq = []
                for c in range(co.k):
                    seq += [made.redo(t, c) for t in ftasks if t.op in self.recomputed]
                    seq += [made.backward(t, c) for t in btasks]
                bw = _splice(bw, btasks, seq, members)
        return fw, bw

    def _internal(self, fw, bw, group: set, bi: list[int], writers, readers) -> frozenset[str]:
        """Buffers only the group writes and reads; the group grows by the local sums and copies
        of gradients that pass between its members in the backward (a greatest fixpoint)."""
        lo, hi = (min(bi), max(bi)) if bi else (0, -1)
        cand = {("B", i) for i in range(lo, hi + 1) if bw[i].kind is TaskKind.LOCAL
                and bw[i].region is None and bw[i].src_region is None}

        def inside(b: str, g: set) -> bool:
            return bool(b) and not is_static(b) and writers[b] <= g and readers[b] <= g

        while True:
            g = group | cand
            drop = {p for p in cand if not all(inside(b, g) for b in bw[p[1]].reads + bw[p[1]].writes if b)}
            if not drop:
                break
            cand -= drop
        group |= cand
        tasks = {"F": fw, "B": bw}
        written = {b for p, i in group for b in tasks[p][i].writes if b}
        return frozenset(b for b in written if inside(b, group))

    def op_shapes(self, op: Operator, flat: int) -> tuple:
        """Local shapes of ``op``'s inputs, outputs and input-gradient contributions at ``flat``."""
        key = (op.name, flat)
        got = self.shapes.get(key)
        if got is None:
            L = self.L
            ins = tuple(box_shape(L.needs(op, i).box(flat, L.shapes[t])) for i, t in enumerate(op.inputs))
            outs = tuple(box_shape(L.has(op, j).box(flat, L.shapes[t])) for j, t in enumerate(op.outputs))
            grads = tuple(box_shape(L.contributes(op, i).box(flat, L.shapes[t])) for i, t in enumerate(op.inputs))
            got = self.shapes[key] = (ins, outs, grads)
        return got


def _r(b: str, c: int) -> str:
    """The recomputed chunk ``c`` of buffer ``b``."""
    return f"r:{b.split(':', 1)[1]}@{c}"


class _Chunks:
    """Builds the chunk tasks of one group on one device."""

    def __init__(self, stage: _Stage, k: int, internal: frozenset[str], ftasks: list[Task]) -> None:
        self.s, self.k, self.internal = stage, k, internal
        self.remade = frozenset(b for t in ftasks if t.op in stage.recomputed for b in t.writes if b)
        self.chunk_shape: dict[str, tuple[int, ...]] = {}

    def _name(self, b: str, c: int, local: tuple[int, ...], chunk: tuple[int, ...]) -> str:
        """``b@c``, with its size registered."""
        new = f"{b}@{c}"
        sizes = self.s.sizes
        if new not in sizes and b in sizes:
            sizes[new] = sizes[b] * math.prod(chunk) // max(1, math.prod(local))
        self.chunk_shape[new] = chunk
        return new

    def _fields(self, t: Task, c: int, op: Operator, reads, writes, read_shapes, write_shapes, rd, wr) -> dict:
        """Reads, writes, slices and places of chunk ``c`` of ``t``: ``rd``/``wr`` map a buffer to
        its chunk name (or None: the chunk uses its slice of the whole buffer)."""
        co: CoLocation = self.s.L.chunks[op.name]
        k = self.k
        out_r, slices, out_w, places = [], [], [], []
        moved = total = 0
        for b, (shape, axis) in zip(reads, read_shapes):
            chunk = _chunk(shape, axis, c, k)
            total += math.prod(shape)
            moved += math.prod(box_shape(chunk))
            new = rd(b, c, shape, box_shape(chunk)) if b else ""
            out_r.append(new or b)
            slices.append(None if new or not b or axis is None else chunk)
        for b, (shape, axis) in zip(writes, write_shapes):
            chunk = _chunk(shape, axis, c, k)
            total += math.prod(shape)
            moved += math.prod(box_shape(chunk))
            new = wr(b, c, shape, box_shape(chunk)) if b else ""
            out_w.append(new or b)
            places.append(None if new or not b else (chunk, shape))
        lead = t.lead and (c == 0 or co.dim not in op.signature.reduce)
        return dict(reads=tuple(out_r), writes=tuple(out_w), slices=tuple(slices), places=tuple(places),
                    chunk=c, flops=t.flops / k, bytes_moved=t.bytes_moved * moved / max(1, total), lead=lead)

    def _op(self, t: Task) -> tuple[Operator, CoLocation, tuple]:
        op = self.s.graph.op(t.op)
        return op, self.s.L.chunks[op.name], self.s.op_shapes(op, t.coord)

    def _inner(self, b, c, local, chunk):
        return self._name(b, c, local, chunk) if b in self.internal else None

    def forward(self, t: Task, c: int) -> Task:
        """Chunk ``c`` of forward task ``t``: without the graph when its operator is recomputed."""
        op, co, (ins, outs, _) = self._op(t)
        f = self._fields(t, c, op, t.reads, t.writes,
                         [(s, _axis(ax, co.dim)) for s, ax in zip(ins, op.signature.inputs)],
                         [(s, _axis(ax, co.dim)) for s, ax in zip(outs, op.signature.outputs)],
                         self._inner, self._inner)
        shape = box_shape(_chunk(outs[0], _axis(op.signature.outputs[0], co.dim), c, self.k))
        if op.name in self.s.recomputed:
            return _replace(t, name=f"{t.name}@{c}", shape=shape, recompute="drop", saved=(), **f)
        saved = tuple(f"{b}@{c}" if b in self.internal else b for b in t.saved)
        return _replace(t, name=f"{t.name}@{c}", shape=shape, saved=saved, **f)

    def redo(self, t: Task, c: int) -> Task:
        """Chunk ``c`` of forward task ``t`` run again before the chunk's backward, into ``r:`` buffers."""
        op, co, (ins, outs, _) = self._op(t)

        def rd(b, c, local, chunk):
            if b in self.remade:
                return _r(b, c)
            return self._inner(b, c, local, chunk)

        def wr(b, c, local, chunk):
            new = _r(b, c)
            sizes = self.s.sizes
            if new not in sizes and b in sizes:
                sizes[new] = sizes[b] * math.prod(chunk) // max(1, math.prod(local))
            return new

        f = self._fields(t, c, op, t.reads, t.writes,
                         [(s, _axis(ax, co.dim)) for s, ax in zip(ins, op.signature.inputs)],
                         [(s, _axis(ax, co.dim)) for s, ax in zip(outs, op.signature.outputs)], rd, wr)
        shape = box_shape(_chunk(outs[0], _axis(op.signature.outputs[0], co.dim), c, self.k))
        return _replace(t, name=f"re:{t.name}@{c}", shape=shape, recompute="redo",
                        saved=tuple(self._saved(b, c, True) for b in t.saved), **f)

    def _saved(self, b: str, c: int, remade: bool) -> str:
        if remade and b in self.remade:
            return _r(b, c)
        return f"{b}@{c}" if b in self.internal else b

    def backward(self, t: Task, c: int) -> Task:
        """Chunk ``c`` of a member's backward task, or of a local sum or copy between members."""
        if t.kind is not TaskKind.BACKWARD:  # a local sum or copy of a gradient inside the group
            reads = tuple(f"{b}@{c}" if b in self.internal else b for b in t.reads)
            writes = []
            for b in t.writes:
                new = f"{b}@{c}"
                if new not in self.s.sizes and b in self.s.sizes:
                    self.s.sizes[new] = self.s.sizes[b] // self.k
                writes.append(new)
            shape = self.chunk_shape.get(reads[0], t.shape) if reads else t.shape
            for w in writes:
                self.chunk_shape[w] = shape
            return _replace(t, name=f"{t.name}@{c}", reads=reads, writes=tuple(writes), shape=shape, chunk=c,
                            flops=t.flops / self.k, bytes_moved=t.bytes_moved / self.k)
        op, co, (ins, outs, grads) = self._op(t)
        f = self._fields(t, c, op, t.reads, t.writes,
                         [(s, _axis(ax, co.dim)) for s, ax in zip(outs, op.signature.outputs)],
                         [(s, _axis(ax, co.dim)) for s, ax in zip(grads, op.signature.inputs)],
                         self._inner, self._inner)
        remade = op.name in self.s.recomputed
        return _replace(t, name=f"{t.name}@{c}", saved=tuple(self._saved(b, c, remade) for b in t.saved), **f)


def _replace(t: Task, **changes) -> Task:
    """A copy of ``t`` with ``changes`` (cheaper than dataclasses.replace, which re-runs __init__)."""
    new = object.__new__(Task)
    new.__dict__.update(t.__dict__, **changes)
    return new


def _splice(tasks: list[Task], members: list[Task], seq: list[Task], ops: list[str]) -> list[Task]:
    """``tasks`` with ``members`` replaced by ``seq``, placed where the last member was: the tasks
    between the first and last member that read what the group (or a task moved after it)
    writes move after ``seq``, the others before it."""
    ids = {id(t) for t in members}
    idx = [i for i, t in enumerate(tasks) if id(t) in ids]
    first, last = idx[0], idx[-1]
    out = {w for i in idx for w in tasks[i].writes if w}
    before, after = [], []
    for i in range(first + 1, last):
        t = tasks[i]
        if id(t) in ids:
            continue
        if any(b in out for b in t.reads + t.saved if b):
            after.append(t)
            out.update(w for w in t.writes if w)
        else:
            before.append(t)
    made = {w: t for t in after for w in t.writes if w}
    for i in idx:
        need = next((b for b in tasks[i].reads if b in made), None)
        if need is not None:
            raise InfeasiblePlan(
                f"co-located operators {ops[0]!r} .. {ops[-1]!r} run their chunks together, but "
                f"{tasks[i].op or tasks[i].name!r} reads {need!r}, which task {made[need].name!r} makes from the "
                "group's own results (a tensor passed between them in another layout); co-locate them "
                "with the same split or not at all")
    return tasks[:first] + before + seq + after + tasks[last + 1:]
