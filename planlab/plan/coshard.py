"""Coshard: a device's co-located pieces of an operator run one after another, each recomputed.

The ``materialize`` pass :func:`run_chunks`, after the blocks are ordered. An operator whose plan puts ``k`` neighbouring pieces on each device
(:mod:`planlab.plan.colocation`) is first built like the ``n``-way split its shares make: one
forward and one backward task per device, the same layouts and collectives. This pass then runs
each device's share as ``k`` chunks, in this order:

1. groups: co-located operators that hand a tensor to one another in the same layout, split
   along the same axis, run their chunks together (chunk 0 of every member, then chunk 1, ...),
   so the tensors between them exist one chunk at a time (their buffers' ``chunk``);
2. forward: a group's forward tasks become ``k`` rounds of chunk tasks; a chunk reads its slice
   of the tensors that come from outside the group (``Task.slices``) and adds its slice (or, when
   the chunks split a reduction, its partial sum) into the tensors that leave it (``Task.places``);
3. backward: per chunk, the forward of its recomputed members runs again (``re:`` tasks writing
   ``RECOMPUTED`` chunks) right before the chunk's backward tasks, whose gradient contributions add into
   slices of the gradients outside the group and of the weight gradients; local sums of
   gradients passed between members run per chunk too;
4. order: the tasks between a group's first and last member that need its results move after
   it, the others before it; a task the group both feeds and needs is refused (InfeasiblePlan).

A co-located operator in a recompute group is recomputed piece by piece here (and left out of
the layer's recomputation); one without keeps every chunk's activations for its backward. When its
group is also its layer's (a checkpoint nested in the layer's), the results the group hands to the
rest of the layer are not kept from the forward either: the layer's recomputation makes them again,
chunk by chunk without a graph, so that a checkpointed layer keeps only its input.
"""

from __future__ import annotations

import math
from collections import defaultdict

from planlab.errors import InfeasiblePlan
from planlab.graph.ir import Graph, Operator
from planlab.plan.buffer import Buffer, BufferKind
from planlab.plan.colocation import CoLocation
from planlab.plan.layout import Box, Layout, Partial, Replicate, box_shape
from planlab.plan.passes.draft import Draft, Idents
from planlab.plan.plan import Plan
from planlab.plan.program import Recompute, Role, Task, TaskKind
from planlab.plan.redistribute import same_layout
from planlab.plan.zero import in_backward


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


def _handed_back(contrib: Layout, grad: Layout) -> bool:
    """True when gradient contributions in ``contrib`` are summed into a gradient in ``grad`` as they
    are or by all-reduces: a partial sum the gradient keeps (over the data-parallel replicas,
    :mod:`planlab.plan.partial_grads`) is handed on as it is, chunk by chunk."""
    if contrib.mesh != grad.mesh:
        return False
    return all(
        c == g or isinstance(c, Partial) and isinstance(g, Replicate) or size == 1
        for c, g, size in zip(contrib.placements, grad.placements, grad.mesh.shape)
    )


def groups(graph: Graph, L, stage: dict[str, int]) -> list[list[str]]:
    """Co-located operators whose chunks run together, each group in topological order: those
    joined by tensors that pass, to co-located readers only, in one layout chunked along the
    same axis, and whose gradients pass back into the producer's gradient layout as they are or as
    partial sums that one all-reduce completes (that all-reduce then runs per chunk). A tensor
    without the batch axis read by data-parallel pieces passes back as it is: its gradient stays
    a partial sum over the replicas (:mod:`planlab.plan.partial_grads`)."""
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
        return (
            a is not None
            and a == _axis(op.signature.inputs[i], co.dim)
            and same_layout(L.has(prod, j), L.needs(op, i))
            and _handed_back(L.contributes(op, i), L.form(prod).grads[j])
        )

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


def run_chunks(d: Draft) -> Draft:
    """Co-located operators (``layouts.chunks``) run as chunks on every device (see the module
    docstring); a collective run per chunk is another collective, with an identity of its own."""
    if not d.layouts.chunks:
        return d
    blocks, sizes = d.copy_blocks(), d.copy_sizes()
    idents = Idents(d.next_ident)
    run_in_chunks(blocks, d.graph, d.layouts, d.plan, sizes, idents)
    return d.replace(blocks=blocks, sizes=sizes, next_ident=idents.next)


def run_in_chunks(
    blocks_of: dict, graph: Graph, L, plan: Plan, buf_bytes: dict[int, dict[Buffer, int]], idents: Idents
) -> None:
    """Rewrite every device's blocks (``blocks_of[device][(stage, phase)]``: task lists, in order)
    so that co-located operators run as chunks; register the new buffers' sizes."""
    stage = {p.op: p.stage for p in plan.ops}
    recomputed = frozenset(p.op for p in plan.ops if p.recompute and p.op in L.chunks)
    # co-located operators in the recompute group of other operators (their layer's): remade there too
    shared = {p.recompute for p in plan.ops if p.recompute and p.op not in L.chunks}
    nested = frozenset(p.op for p in plan.ops if p.op in recomputed and p.recompute in shared)
    by_stage: dict[int, list[list[str]]] = defaultdict(list)
    for members in groups(graph, L, stage):
        by_stage[stage[members[0]]].append(members)
    shapes: dict[tuple[str, int], tuple] = {}
    for dev, blocks in blocks_of.items():
        for st, found in by_stage.items():
            fkey, bkey = (st, "F"), (st, "B")
            if fkey not in blocks:
                continue
            fw, bw = list(blocks[fkey]), list(blocks.get(bkey, ()))
            run = _Stage(graph, L, recomputed, buf_bytes.setdefault(dev, {}), shapes, nested, idents)
            fw, bw = run.rewrite(fw, bw, found)
            blocks[fkey] = fw
            if bkey in blocks:
                blocks[bkey] = bw


class _Stage:
    """The forward and backward block of one stage on one device, rewritten group by group."""

    def __init__(
        self,
        graph: Graph,
        L,
        recomputed: frozenset[str],
        sizes: dict[Buffer, int],
        shapes: dict[tuple[str, int], tuple],
        nested: frozenset[str],
        idents: Idents,
    ) -> None:
        self.graph, self.L, self.recomputed, self.sizes, self.shapes = graph, L, recomputed, sizes, shapes
        self.nested, self.idents = nested, idents

    def rewrite(self, fw: list[Task], bw: list[Task], found: list[list[str]]) -> tuple[list[Task], list[Task]]:
        """The forward and backward block ``fw``, ``bw`` with the groups ``found`` run as chunks."""
        writers, readers = _users(fw, bw)
        fpos: dict[str, list[int]] = defaultdict(list)
        bpos: dict[str, list[int]] = defaultdict(list)
        for pos, kind, tasks in ((fpos, TaskKind.FORWARD, fw), (bpos, TaskKind.BACKWARD, bw)):
            for i, t in enumerate(tasks):
                if t.kind is kind and t.op in self.L.chunks:
                    pos[t.op].append(i)
        relay, first_re = _layer_recomputation(bw)
        fjobs, bjobs = [], []
        outer: dict[int, list[Task]] = defaultdict(list)  # bw position -> the layer recomputation's chunks
        remakes: list[tuple[frozenset[int], dict[Buffer, Buffer]]] = []
        for members in found:
            fi = sorted(i for m in members for i in fpos.get(m, ()))
            if not fi:
                continue  # the group is not on this device
            bi = sorted(i for m in members for i in bpos.get(m, ()))
            group = {("F", i) for i in fi} | {("B", i) for i in bi}
            internal = self._internal(fw, bw, group, bi, writers, readers)
            bi = sorted(i for p, i in group if p == "B")
            k = self.L.chunks[members[0]].k
            # inputs the group alone loads are loaded again for its recomputation, not kept
            reload = [
                fw[i]
                for i in range(fi[0], fi[-1])
                if fw[i].role is Role.LOAD and all(readers[w] <= group for w in fw[i].writes)
            ]
            again = {w: w.with_kind(BufferKind.RECOMPUTED) for t in reload for w in t.writes}
            made = _Chunks(self, k, internal, [fw[i] for i in fi], {**relay, **again})
            fjobs.append((fi, [made.forward(fw[i], c) for c in range(k) for i in fi], members))
            if bi:
                seq = []
                if any(fw[i].op in self.recomputed for i in fi):
                    for t in reload:
                        self.sizes.update({again[w]: self.sizes[w] for w in t.writes if w in self.sizes})
                        seq.append(
                            t.but(
                                name=f"re:{t.name}",
                                writes=tuple(again[w] for w in t.writes),
                                recompute=Recompute.REDO,
                            )
                        )
                for c in range(k):
                    seq += [made.redo(fw[i], c) for i in fi if fw[i].op in self.recomputed]
                    seq += [made.backward(bw[i], c) for i in bi]
                bjobs.append((bi, seq, members))
                if relay and any(fw[i].op in self.nested for i in fi):
                    self._remake(made, [fw[i] for i in fi], first_re, internal, outer, remakes, reload, again)
        for p, seq in outer.items():
            bjobs.append(([p], seq + [bw[p]], [bw[p].op or bw[p].name]))
        bw = _splice_all(bw, bjobs)
        return _splice_all(fw, fjobs), _renamed(bw, remakes) if remakes else bw

    def _remake(
        self,
        made: "_Chunks",
        ftasks: list[Task],
        first_re: dict[Buffer, int],
        internal: frozenset[Buffer],
        outer: dict[int, list[Task]],
        remakes: list,
        reload: list[Task],
        again: dict[Buffer, Buffer],
    ) -> None:
        """Inside a recomputed layer, the group's results that the layer's recomputation reads are
        made again there, chunk by chunk without keeping a graph (the group's backward remakes each
        chunk once more right before it), instead of being kept from the forward until the
        backward: nnScaler's co-shard inside a checkpointed layer, one chunk's activations alive at
        a time in both recomputations. Queues the chunks before the layer's first reader in ``outer``
        and the renaming of the results (activations to ``RECOMPUTED`` ones) for the tasks after them in ``remakes``;
        the inputs only the group loads (``reload``) are loaded again first, into ``again``'s buffers."""
        leaving = {w for t in ftasks for w in t.writes if w and w not in internal and not w.static}
        at = min((first_re[w] for w in leaving if w in first_re), default=None)
        if at is None:
            return
        remade = {w: w.with_kind(BufferKind.RECOMPUTED) for w in leaving}
        for w, r in remade.items():
            if w in self.sizes:
                self.sizes[r] = self.sizes[w]
        seq = [
            t.but(name=f"re:{t.name}:outer", writes=tuple(again[w] for w in t.writes), recompute=Recompute.REDO)
            for t in reload
        ]
        seq += [made.outer(t, c, remade) for c in range(made.k) for t in ftasks]
        outer[at].extend(seq)
        remakes.append((frozenset(id(t) for t in seq), remade))

    def _internal(self, fw, bw, group: set, bi: list[int], writers, readers) -> frozenset[Buffer]:
        """Buffers only the group writes and reads; the group grows by the local sums, copies and
        all-reduces of gradients that pass between its members in the backward (a greatest
        fixpoint): they run per chunk too."""
        lo, hi = (min(bi), max(bi)) if bi else (0, -1)
        cand = {("B", i) for i in range(lo, hi + 1) if _per_chunk(bw[i])}

        def inside(b: Buffer | None, g: set) -> bool:
            return b is not None and not b.static and writers[b] <= g and readers[b] <= g

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

    def _local(self, op: Operator, flat: int, phase: str, dim: str) -> tuple:
        """``(local shape, axis of dim)`` per read and write of ``op``'s piece at ``flat`` in
        ``phase``, and their total size: the same at every position (a layout splits a tensor
        evenly, :meth:`~planlab.plan.layout.Layout.box`), so kept per operator and phase."""
        key = (op.name, phase)
        got = self.shapes.get(key)
        if got is None:
            L = self.L
            ins = tuple(
                (box_shape(L.needs(op, i).box(flat, L.shapes[t])), _axis(op.signature.inputs[i], dim))
                for i, t in enumerate(op.inputs)
            )
            outs = tuple(
                (box_shape(L.has(op, j).box(flat, L.shapes[t])), _axis(op.signature.outputs[j], dim))
                for j, t in enumerate(op.outputs)
            )
            if phase == "B":
                ins, outs = (
                    outs,
                    tuple(
                        (box_shape(L.contributes(op, i).box(flat, L.shapes[t])), _axis(op.signature.inputs[i], dim))
                        for i, t in enumerate(op.inputs)
                    ),
                )
            got = self.shapes[key] = (ins, outs, sum(math.prod(s) for s, _ in ins + outs))
        return got

    def geometry(self, op: Operator, flat: int, phase: str, c: int) -> tuple:
        """Chunk ``c`` of ``op``'s piece at ``flat``, for its forward (``phase`` F: reads are the inputs,
        writes the outputs) or backward (B: reads are the outputs' gradients, writes the inputs'):
        per read and write ``(slice or None, chunk box, local shape, chunk shape)``, the share of the
        piece's memory traffic the chunk moves (a tensor without the split dimension is read whole
        by every chunk), the chunk's first output shape, and whether it may add terms added once.
        Pieces of the same local shapes (the same operator in every layer, or on every device) share
        one value, kept under those shapes."""
        key = (op.name, flat, phase, c)
        got = self.shapes.get(key)
        if got is None:
            co = self.L.chunks[op.name]
            reads, writes, total = self._local(op, flat, phase, co.dim)
            lead = c == 0 or co.dim not in op.signature.reduce
            same = (CHUNK_GEOMETRY, reads, writes, phase, c, co.k, lead)
            got = self.shapes.get(same)
            if got is None:
                got = self.shapes[same] = _chunk_geometry(reads, writes, total, phase, c, co.k, lead)
            self.shapes[key] = got
        return got


CHUNK_GEOMETRY = "chunk geometry"  # the first item of _Stage.geometry's keys by local shapes


def _chunk_geometry(reads: tuple, writes: tuple, total: int, phase: str, c: int, k: int, lead: bool) -> tuple:
    """:meth:`_Stage.geometry` of chunk ``c`` of ``k`` of a piece whose reads and writes have the
    local shapes and split axes ``reads`` and ``writes`` (of ``total`` elements in all)."""

    def parts(pairs) -> tuple:
        out = []
        for shape, axis in pairs:
            box = _chunk(shape, axis, c, k)
            out.append((box if axis is not None else None, box, shape, box_shape(box)))
        return tuple(out)

    rgeo, wgeo = parts(reads), parts(writes)
    moved = sum(math.prod(g[3]) for g in rgeo + wgeo)
    first = (wgeo if phase == "F" else rgeo)[0][3]
    return rgeo, wgeo, moved / max(1, total), first, lead


def _users(fw: list[Task], bw: list[Task]) -> tuple[dict, dict]:
    """Per buffer, the tasks (``("F" or "B", position)``) that write it and those that read or keep it."""
    writers: dict[Buffer, set] = defaultdict(set)
    readers: dict[Buffer, set] = defaultdict(set)
    for phase, tasks in (("F", fw), ("B", bw)):
        for i, t in enumerate(tasks):
            for b in t.writes:
                if b:
                    writers[b].add((phase, i))
            for b in t.reads + t.saved:
                if b:
                    readers[b].add((phase, i))
    return writers, readers


def _layer_recomputation(bw: list[Task]) -> tuple[dict[Buffer, Buffer], dict[Buffer, int]]:
    """What the layer's recomputation (:mod:`planlab.plan.passes.recompute`) makes again, as
    ``{forward buffer: its recomputed buffer}`` (a recomputed chunk reads that instead of keeping the
    forward's buffer until the backward), and the position of its first task reading each buffer."""
    relay = {
        w.with_kind(BufferKind.ACTIVATION): w
        for t in bw
        if t.recompute is Recompute.REDO
        for w in t.writes
        if w and w.kind is BufferKind.RECOMPUTED
    }
    first_re: dict[Buffer, int] = {}
    for p, t in enumerate(bw):
        if t.recompute is Recompute.REDO:
            for b in t.reads + t.saved:
                if b:
                    first_re.setdefault(b, p)
    return relay, first_re


def _per_chunk(t: Task) -> bool:
    """A task that may run chunk by chunk on chunks of its buffers: an elementwise local sum or
    copy, or an all-reduce issued in the backward's order (not a bucket of weight gradients)."""
    if t.kind is TaskKind.LOCAL:
        return t.region is None and t.src_region is None and t.role is not Role.LOAD
    return t.kind is TaskKind.COLLECTIVE and t.collective == "all_reduce" and not t.final and not t.overlap


def _r(b: Buffer, c: int) -> Buffer:
    """The recomputed chunk ``c`` of buffer ``b``."""
    return b.with_kind(BufferKind.RECOMPUTED).at_chunk(c)


class _Chunks:
    """Builds the chunk tasks of one group on one device."""

    def __init__(
        self, stage: _Stage, k: int, internal: frozenset[Buffer], ftasks: list[Task], relay: dict[Buffer, Buffer]
    ) -> None:
        self.s, self.k, self.internal, self.relay = stage, k, internal, relay
        self.remade = frozenset(b for t in ftasks if t.op in stage.recomputed for b in t.writes if b)
        self.chunk_shape: dict[Buffer, tuple[int, ...]] = {}
        self.named: dict[tuple[Buffer, int], Buffer] = {}  # (buffer, chunk) -> the chunk's buffer

    def _sized(self, new: Buffer, b: Buffer, local: tuple[int, ...], chunk: tuple[int, ...]) -> Buffer:
        """``new``, a chunk of ``b`` (local shape ``local``) of shape ``chunk``, with its size registered."""
        sizes = self.s.sizes
        if new not in sizes and b in sizes:
            sizes[new] = sizes[b] * math.prod(chunk) // max(1, math.prod(local))
        return new

    def _name(self, b: Buffer, c: int, local: tuple[int, ...], chunk: tuple[int, ...]) -> Buffer:
        """Chunk ``c`` of ``b``, with its size registered (the first time its writer or a reader asks)."""
        new = self.named.get((b, c))
        if new is None:
            new = self.named[b, c] = self._sized(b.at_chunk(c), b, local, chunk)
        self.chunk_shape[new] = chunk
        return new

    def _fields(self, t: Task, c: int, op: Operator, phase: str, reads, writes, rd, wr, geo: tuple) -> dict:
        """Reads, writes, slices and places of chunk ``c`` of ``t`` (``phase`` F: of a forward task,
        B: of a backward task; ``geo``: its :meth:`_Stage.geometry`): ``rd``/``wr`` map a buffer to its
        chunk's own buffer, or to None when the chunk uses its slice of the whole buffer."""
        rgeo, wgeo, frac, _, lead = geo
        out_r, slices, out_w, places = [], [], [], []
        for b, (sl, _, full, chunk) in zip(reads, rgeo):
            new = rd(b, c, full, chunk) if b else None
            out_r.append(new or b)
            slices.append(None if new or not b else sl)
        for b, (_, box, full, chunk) in zip(writes, wgeo):
            new = wr(b, c, full, chunk) if b else None
            out_w.append(new or b)
            places.append(None if new or not b else (box, full))
        fgeo = (
            (geo if phase == "F" else self.s.geometry(op, t.coord, "F", c)) if t.shapes else None
        )  # for the cost model
        box = t.box
        if box is not None and phase == "F":  # a random operator's chunk: its own box in the whole tensor
            box = tuple((lo + a, lo + b) for (lo, _), (a, b) in zip(box, wgeo[0][1]))
        return dict(
            box=box,
            reads=tuple(out_r),
            writes=tuple(out_w),
            slices=tuple(slices),
            places=tuple(places),
            chunk=c,
            flops=t.flops / self.k,
            bytes_moved=t.bytes_moved * frac,
            lead=t.lead and lead,
            shapes=tuple(g[3] for g in fgeo[0] + fgeo[1]) if fgeo else t.shapes,
        )

    def _op(self, t: Task) -> Operator:
        return self.s.graph.op(t.op)

    def _inner(self, b, c, local, chunk):
        return self._name(b, c, local, chunk) if b in self.internal else None

    def forward(self, t: Task, c: int) -> Task:
        """Chunk ``c`` of forward task ``t``: without the graph when its operator is recomputed."""
        op = self._op(t)
        geo = self.s.geometry(op, t.coord, "F", c)
        f = self._fields(t, c, op, "F", t.reads, t.writes, self._inner, self._inner, geo)
        shape = geo[3]
        if op.name in self.s.recomputed:
            return t.but(name=f"{t.name}@{c}", shape=shape, recompute=Recompute.DROP, saved=(), **f)
        saved = tuple(b.at_chunk(c) if b in self.internal else b for b in t.saved)
        return t.but(name=f"{t.name}@{c}", shape=shape, saved=saved, **f)

    def redo(self, t: Task, c: int) -> Task:
        """Chunk ``c`` of forward task ``t`` run again before the chunk's backward, into ``RECOMPUTED`` buffers."""
        op = self._op(t)

        def rd(b, c, local, chunk):
            if b in self.remade:
                return _r(b, c)
            return self._inner(b, c, local, chunk)

        def wr(b, c, local, chunk):
            return self._sized(_r(b, c), b, local, chunk)

        reads = tuple(in_backward(self.relay.get(b, b)) for b in t.reads)  # ZeRO-3: the backward's gather
        geo = self.s.geometry(op, t.coord, "F", c)
        f = self._fields(t, c, op, "F", reads, t.writes, rd, wr, geo)
        shape = geo[3]
        return t.but(
            name=f"re:{t.name}@{c}",
            shape=shape,
            recompute=Recompute.REDO,
            saved=tuple(self._saved(b, c, True) for b in t.saved),
            **f,
        )

    def outer(self, t: Task, c: int, remade: dict[Buffer, Buffer]) -> Task:
        """Chunk ``c`` of forward task ``t`` run again in the layer's recomputation, keeping no graph:
        it reads what that recomputation made (``relay``), writes the group's results into their
        ``remade`` buffers and what stays inside the group into chunk buffers of its own (``REMADE``)."""
        op = self._op(t)

        def inner(b, c, local, chunk):
            if b not in self.internal:
                return None
            return self._sized(b.with_kind(BufferKind.REMADE).at_chunk(c), b, local, chunk)

        reads = tuple(in_backward(self.relay.get(b, b)) for b in t.reads)  # ZeRO-3: the backward's gather
        writes = tuple(remade.get(b, b) for b in t.writes)
        geo = self.s.geometry(op, t.coord, "F", c)
        f = self._fields(t, c, op, "F", reads, writes, inner, inner, geo)
        shape = geo[3]
        return t.but(name=f"re:{t.name}@{c}:outer", shape=shape, recompute=Recompute.DROP, saved=(), **f)

    def _saved(self, b: Buffer, c: int, remade: bool) -> Buffer:
        if remade and b in self.remade:
            return _r(b, c)
        if b in self.internal:
            return b.at_chunk(c)
        return self.relay.get(b, b) if remade else b

    def backward(self, t: Task, c: int) -> Task:
        """Chunk ``c`` of a member's backward task, or of a local sum or copy between members."""
        if t.kind is not TaskKind.BACKWARD:  # a local sum, copy or all-reduce of a gradient inside the group
            reads = tuple(b.at_chunk(c) if b in self.internal else b for b in t.reads)
            writes = []
            for b in t.writes:
                new = b.at_chunk(c)
                if new not in self.s.sizes and b in self.s.sizes:
                    self.s.sizes[new] = self.s.sizes[b] // self.k
                writes.append(new)
            shape = self.chunk_shape.get(reads[0], t.shape) if reads else t.shape
            for w in writes:
                self.chunk_shape[w] = shape
            return t.but(
                name=f"{t.name}@{c}",
                reads=reads,
                writes=tuple(writes),
                shape=shape,
                chunk=c,
                flops=t.flops / self.k,
                bytes_moved=t.bytes_moved / self.k,
                nbytes=t.nbytes // self.k,
                ident=self.s.idents((t.ident, c)) if t.ident >= 0 else -1,
            )
        op = self._op(t)
        f = self._fields(
            t, c, op, "B", t.reads, t.writes, self._inner, self._inner, self.s.geometry(op, t.coord, "B", c)
        )
        remade = op.name in self.s.recomputed
        return t.but(name=f"{t.name}@{c}", saved=tuple(self._saved(b, c, remade) for b in t.saved), **f)


def _renamed(bw: list[Task], remakes: list[tuple[frozenset[int], dict[Buffer, Buffer]]]) -> list[Task]:
    """``bw`` with the reads and saved buffers of the tasks after each group's remade chunks
    (``remakes``: their ids and the renaming of the group's results) renamed to the remade ones."""
    group_of = {i: n for n, (ids, _) in enumerate(remakes) for i in ids}
    left = [len(ids) for ids, _ in remakes]
    active: dict[Buffer, Buffer] = {}
    out = []
    for t in bw:
        hit = group_of.get(id(t))
        if hit is not None:
            left[hit] -= 1
            if not left[hit]:
                active.update(remakes[hit][1])
        elif active and any(b in active for b in t.reads + t.saved):
            t = t.but(reads=tuple(active.get(b, b) for b in t.reads), saved=tuple(active.get(b, b) for b in t.saved))
        out.append(t)
    return out


def _splice_all(tasks: list[Task], jobs: list[tuple[list[int], list[Task], list[str]]]) -> list[Task]:
    """``tasks`` with each job's members (at positions ``idx``) replaced by its ``seq``, the last
    job first: a splice moves nothing before its first member, so earlier jobs keep their
    positions unless their members interleave (then they are found again by identity). When no two
    jobs' spans overlap (the usual case), each job's run is made from the tasks as they are and
    the list is put together once, not copied again for every job."""
    order = sorted(range(len(jobs)), key=lambda n: -jobs[n][0][0])
    spans = sorted((jobs[n][0][0], jobs[n][0][-1]) for n in order)
    if all(a[1] < b[0] for a, b in zip(spans, spans[1:])):
        runs = [(jobs[n][0][0], jobs[n][0][-1], _spliced(tasks, *jobs[n])) for n in order]  # refused in this order
        out: list[Task] = []
        at = 0
        for first, last, run in reversed(runs):
            out += tasks[at:first]
            out += run
            at = last + 1
        return out + tasks[at:]
    ids = [{id(tasks[i]) for i in idx} for idx, _, _ in jobs]
    bound = len(tasks)
    for n in order:
        idx, seq, ops = jobs[n]
        if idx[-1] >= bound:  # members inside a later job's span: find them where it put them
            idx = [i for i in idx if i < bound]
            want = len(ids[n]) - len(idx)
            for i in range(bound, len(tasks)):
                if want == 0:
                    break
                if id(tasks[i]) in ids[n]:
                    idx.append(i)
                    want -= 1
        tasks = tasks[: idx[0]] + _spliced(tasks, idx, seq, ops) + tasks[idx[-1] + 1 :]
        bound = idx[0]
    return tasks


def _spliced(tasks: list[Task], idx: list[int], seq: list[Task], ops: list[str]) -> list[Task]:
    """What replaces ``tasks[idx[0] : idx[-1] + 1]`` when the members at ``idx`` are replaced by
    ``seq``, placed where the last member was: the tasks between the first and last member that
    read what the group (or a task moved after it) writes move after ``seq``, the others before it."""
    first, last = idx[0], idx[-1]
    inside = set(idx)
    out = {w for i in idx for w in tasks[i].writes if w}
    before, after = [], []
    for i in range(first + 1, last):
        if i in inside:
            continue
        t = tasks[i]
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
                f"{tasks[i].op or tasks[i].name!r} reads '{need}', which task {made[need].name!r} makes from the "
                "group's own results (a tensor passed between them in another layout); co-locate them "
                "with the same split or not at all"
            )
    return before + seq + after
