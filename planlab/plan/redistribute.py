"""Planning layout conversions: the collectives (or copies) that turn one layout into another.

A pure planner, after DTensor's ``_redistribute``: :func:`plan_conversion`
returns per-device tasks and never runs anything. Conversions over the same
mesh become one collective per changed mesh axis (all-reduce, reduce-scatter, all-to-all,
all-gather, or a local slice), all-to-alls on several axes one over their joint group; anything
else falls back to point-to-point copies of overlapping slices, which is always correct.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from planlab.plan.buffer import Buffer, BufferKind
from planlab.plan.layout import (
    Box,
    Layout,
    Partial,
    Replicate,
    Shard,
    box_numel,
    box_shape,
    intersect,
    positions,
    relative,
)
from planlab.plan.program import ExchangeAxis, Task, TaskKind
from planlab.errors import InternalError


@dataclass
class Conversion:
    """Tasks of one conversion: ``src`` tasks run where the data is produced
    (sends), ``dst`` tasks where it is consumed (collectives, receives, copies); the kinds of its
    steps, and how many message tags and collective identities it took."""

    src: dict[int, list[Task]] = field(default_factory=dict)
    dst: dict[int, list[Task]] = field(default_factory=dict)
    kinds: list[str] = field(default_factory=list)
    tags: int = 0
    idents: int = 0

    def add(self, side: str, device: int, task: Task) -> None:
        getattr(self, side).setdefault(device, []).append(task)


def _same_mesh(a: Layout, b: Layout) -> bool:
    return a.mesh == b.mesh


def _nested(layout: Layout) -> bool:
    dims = [p.dim for p in layout.placements if isinstance(p, Shard)]
    return len(dims) != len(set(dims))


def _normalize(layout: Layout) -> tuple:
    """Placements with size-1 mesh axes ignored."""
    return layout.normalized()


def same_layout(a: Layout, b: Layout) -> bool:
    """Whether ``a`` and ``b`` place a tensor alike (size-1 mesh axes ignored)."""
    return a is b or (a.mesh == b.mesh and _normalize(a) == _normalize(b))


def plan_conversion(
    src: Layout,
    dst: Layout,
    shape: tuple[int, ...],
    elem_bytes: int,
    *,
    src_buf: Buffer,
    dst_buf: Buffer,
    accumulate: bool = False,
    first_tag: int = 0,
    name: str = "",
    dtype: str = "float32",
    only: frozenset[int] | None = None,
    channel: int = -1,
    ident: int = 0,
    memo: dict | None = None,
) -> Conversion:
    """Tasks that make ``dst_buf`` hold the tensor in layout ``dst`` from ``src_buf`` in ``src``.

    ``dst`` must hold full values (no Partial) but along mesh axes where ``src`` is Partial too,
    on the same mesh (a partial sum kept, converted axis by axis). With ``accumulate`` the result
    is added into ``dst_buf`` (gradient accumulation). Point-to-point messages take tags
    ``first_tag, first_tag + 1, ...`` (``Conversion.tags`` of them); the collectives of step ``k``
    take identity ``ident + k`` on every device (``Conversion.idents`` of them). With ``only``, tasks are
    planned for those devices alone (the representatives of device classes);
    point-to-point messages then get tags computed from their positions, the
    same whichever devices are planned, and carry ``channel`` for the simulator.

    ``memo``: a dict the caller keeps for the conversions of one graph (materialize passes the
    graph's memo). Layers repeat, so a plan asks a few conversions hundreds of times: a conversion
    planned before for the same layouts, shape, element size, accumulation and devices gives the
    same tasks, with this call's buffers, name, dtype, tags, channel and identities.
    """
    if memo is None:
        return _planned(
            src, dst, shape, elem_bytes, src_buf, dst_buf, accumulate, first_tag, name, dtype, only, channel, ident
        )
    key = (src, dst, tuple(shape), elem_bytes, accumulate, only)
    template = memo.get(key)
    if template is None:
        if len(memo) >= MEMO_ENTRIES:
            memo.clear()
        template = memo[key] = _planned(
            src, dst, shape, elem_bytes, _SRC, _DST, accumulate, 0, "", dtype, only, _CHANNEL, 0
        )
    return _instance(template, src_buf, dst_buf, first_tag if only is None else 0, name, dtype, channel, ident)


# the conversions a memo keeps at most (it starts again when full): a plan of GPT-3 175B on 1,024
# devices asks about 1,200 conversions of 15 to 115 kinds
MEMO_ENTRIES = 4096
# what a memo's conversion is planned with, replaced by each call's own (see _instance)
_SRC = Buffer(BufferKind.INTERNAL, "<conversion source>")
_DST = Buffer(BufferKind.INTERNAL, "<conversion result>")
_CHANNEL = -2


def _instance(
    template: Conversion, src_buf: Buffer, dst_buf: Buffer, tag_shift: int, name: str, dtype: str, channel, ident
) -> Conversion:
    """``template`` (planned with ``_SRC``, ``_DST``, no name, tags from 0, channel ``_CHANNEL`` and
    identities from 0) with these buffers, name, dtype, tags shifted by ``tag_shift``, channel and
    identities from ``ident``."""
    bufs = {_SRC: src_buf, _DST: dst_buf}

    def buf(b: Buffer) -> Buffer:
        got = bufs.get(b)
        if got is None:
            got = bufs[b] = dst_buf.at_step(b.step)
        return got

    def task(t: Task) -> Task:
        changes = dict(
            name=name + t.name,
            reads=tuple(map(buf, t.reads)),
            writes=tuple(map(buf, t.writes)),
            dtype=dtype,
        )
        if t.channel == _CHANNEL:
            changes["channel"] = channel
        if t.ident >= 0:
            changes["ident"] = t.ident + ident
        if t.tag >= 0 and tag_shift:
            changes["tag"] = t.tag + tag_shift
            changes["name"] = message_name(name, t.kind, t.tag + tag_shift)
        return t.but(**changes)

    return Conversion(
        src={dev: [task(t) for t in tasks] for dev, tasks in template.src.items()},
        dst={dev: [task(t) for t in tasks] for dev, tasks in template.dst.items()},
        kinds=list(template.kinds),
        tags=template.tags,
        idents=template.idents,
    )


def message_name(name: str, kind: TaskKind, tag: int) -> str:
    """The name of a conversion's send or receive of tag ``tag``."""
    return f"{name}{'send' if kind is TaskKind.SEND else 'recv'}{tag}"


def _planned(
    src, dst, shape, elem_bytes, src_buf, dst_buf, accumulate, first_tag, name, dtype, only, channel, ident
) -> Conversion:
    """:func:`plan_conversion`'s tasks, planned."""
    # a partial sum is kept, not made: only along mesh axes where the source is one too (a gradient
    # left partial over data-parallel replicas, planlab.plan.partial_grads), on the same mesh
    partial = [a for a, (p, s) in enumerate(zip(dst.placements, dst.mesh.shape)) if s > 1 and isinstance(p, Partial)]
    if partial and not (_same_mesh(src, dst) and all(isinstance(src.placements[a], Partial) for a in partial)):
        raise InternalError(f"cannot convert into a partial layout {dst}: a conversion's target holds full values")
    if _same_mesh(src, dst):
        conv = _per_axis(src, dst, shape, elem_bytes, src_buf, dst_buf, accumulate, name, dtype, only, ident)
        if conv is not None:
            return conv
        if partial:
            raise InternalError(f"cannot convert {src} into {dst}, which keeps a partial sum, but axis by axis")
    if only is not None:
        return _point_to_point_only(
            src, dst, shape, elem_bytes, src_buf, dst_buf, accumulate, name, dtype, only, channel
        )
    return _point_to_point(src, dst, shape, elem_bytes, src_buf, dst_buf, accumulate, first_tag, name, dtype)


_Step = tuple[tuple[int, ...], str, Layout, Layout]  # (mesh axes, kind, layout before, layout after)


def _axis_steps(src: Layout, dst: Layout) -> list[_Step] | None:
    """The steps of a conversion on one mesh, one per changed mesh axis: ``(axes, kind, layout
    before, layout after)``. Reductions first (they shrink nothing but must precede slicing of the
    same data), then gathers, then all-to-alls (one shard for another: expert parallelism's
    dispatch and combine), then local slices (``chunk``). All-to-alls on several axes are one
    all-to-all over the group of those axes where that moves whole blocks (see :func:`_merged`):
    each member then sends its own share once, where one all-to-all per axis would send it twice.
    None where a step would not move whole blocks in the group's order (see :func:`_innermost`),
    and for a layout that splits one tensor axis over several mesh axes unless the conversion has
    an all-to-all or no step at all (the others keep the point-to-point path they had)."""
    mesh = src.mesh
    cur, want = list(_normalize(src)), _normalize(dst)

    def rank(i: int) -> int:
        s, d = cur[i], want[i]
        return 0 if isinstance(s, Partial) else (2 if isinstance(d, Shard) else 1) if isinstance(s, Shard) else 3

    changed = sorted((i for i in range(len(cur)) if cur[i] != want[i]), key=lambda i: (rank(i), i))
    swaps = tuple(i for i in changed if rank(i) == 2)
    steps: list[_Step] = []
    for ax in changed:
        if len(swaps) > 1 and ax in swaps:
            if ax != swaps[0]:
                continue
            before = Layout(mesh, tuple(cur))
            after = Layout(mesh, tuple(want[i] if i in swaps else p for i, p in enumerate(cur)))
            if _merged(before, after, swaps):
                cur = list(after.placements)
                steps.append((swaps, "all_to_all", before, after))
                continue
            swaps = ()  # one all-to-all per axis, as any other step
        s, d = cur[ax], want[ax]
        kind = _STEP_KINDS.get((type(s), type(d)))
        if kind is None:
            return None
        before = Layout(mesh, tuple(cur))
        cur[ax] = d
        after = Layout(mesh, tuple(cur))
        if isinstance(s, Shard) and not _innermost(before, ax, s.dim):
            return None
        if isinstance(d, Shard) and not _innermost(after, ax, d.dim):
            return None
        steps.append(((ax,), kind, before, after))
    if steps and (_nested(src) or _nested(dst)) and not any(k == "all_to_all" for _, k, _, _ in steps):
        return None
    return steps


def _merged(before: Layout, after: Layout, axes: tuple[int, ...]) -> bool:
    """Whether one all-to-all over the group of mesh ``axes`` (each a shard for another shard) moves
    whole blocks: the tensor axes the source is split on there and those the result is split on
    there are apart, and along each no mesh axis after it but those of the group splits them (the
    group's members then hold, and want, neighbouring blocks, nested in the group's order)."""
    gathered = {before.placements[a].dim for a in axes}
    split = {after.placements[a].dim for a in axes}
    if gathered & split:
        return False
    return all(
        _innermost(before, a, before.placements[a].dim, axes) and _innermost(after, a, after.placements[a].dim, axes)
        for a in axes
    )


_STEP_KINDS = {
    (Partial, Replicate): "all_reduce",
    (Partial, Shard): "reduce_scatter",
    (Shard, Replicate): "all_gather",
    (Replicate, Shard): "chunk",
    (Shard, Shard): "all_to_all",
}


def _innermost(layout: Layout, ax: int, dim: int, group: tuple[int, ...] = ()) -> bool:
    """Whether mesh axis ``ax`` is the last of ``layout``'s axes to split tensor axis ``dim`` (but
    for the axes of ``group``): the group along it then holds neighbouring blocks of that axis, so
    gathering over it (or cutting along it) moves whole blocks in the group's order."""
    return all(
        not (isinstance(p, Shard) and p.dim == dim and n > 1) or a in group
        for a, p, n in zip(
            range(ax + 1, len(layout.placements)), layout.placements[ax + 1 :], layout.mesh.shape[ax + 1 :]
        )
    )


def _per_axis(src, dst, shape, eb, src_buf, dst_buf, accumulate, name, dtype, only, ident) -> Conversion | None:
    """The conversion as one collective (or local slice) per changed mesh axis (see
    :func:`_axis_steps`); intermediate results are steps of ``dst_buf``. Without a change, a
    local copy that accumulates (or nothing: the caller aliases ``src_buf``)."""
    mesh = src.mesh
    steps = _axis_steps(src, dst)
    if steps is None:
        return None
    conv = Conversion(idents=len(steps))
    if not steps:
        if accumulate:
            for flat, dev in positions(mesh, only):
                copy = Task(
                    f"{name}copy",
                    TaskKind.LOCAL,
                    (src_buf,),
                    (dst_buf,),
                    shape=box_shape(dst.box(flat, shape)),
                    accumulate=True,
                    dtype=dtype,
                )
                conv.add("dst", dev, copy)
        return conv
    for k, (axes, kind, before, after) in enumerate(steps):
        last = k == len(steps) - 1
        rbuf = src_buf if k == 0 else dst_buf.at_step(k)
        wbuf = dst_buf if last else dst_buf.at_step(k + 1)
        conv.kinds.append(kind)
        for flat, dev in positions(mesh, only):
            bin_, bout = before.box(flat, shape), after.box(flat, shape)
            common = dict(shape=box_shape(bout), accumulate=accumulate and last, dtype=dtype)
            if kind == "chunk":
                task = Task(
                    f"{name}chunk{k}", TaskKind.LOCAL, (rbuf,), (wbuf,), src_region=relative(bout, bin_), **common
                )
            else:
                axis = {"reduce_scatter": after, "all_gather": before, "all_to_all": before}.get(kind)
                task = Task(
                    f"{name}{kind}{k}",
                    TaskKind.COLLECTIVE,
                    (rbuf,),
                    (wbuf,),
                    collective=kind,
                    group=mesh.group_of(flat, axes),
                    axis=axis.placements[axes[0]].dim if axis is not None else -1,
                    exchange=_exchange(before, after, axes) if kind == "all_to_all" else (),
                    nbytes=max(box_numel(bin_), box_numel(bout)) * eb,
                    ident=ident + k,
                    **common,
                )
            conv.add("dst", dev, task)
    return conv


def _exchange(before: Layout, after: Layout, axes: tuple[int, ...]) -> tuple[ExchangeAxis, ...]:
    """How an all-to-all over mesh ``axes`` cuts and joins pieces, per axis in mesh order."""
    return tuple(ExchangeAxis(before.mesh.shape[a], after.placements[a].dim, before.placements[a].dim) for a in axes)


@dataclass(frozen=True)
class _Messages:
    """The tasks of one point-to-point conversion from ``src_buf`` into ``dst_buf``: local copies,
    sends and receives of regions, named after the conversion, adding into the destination with
    ``accumulate``, carrying ``channel`` (a reduced Program's) on messages."""

    src_buf: Buffer
    dst_buf: Buffer
    name: str
    dtype: str
    elem_bytes: int
    accumulate: bool
    channel: int = -1

    def copy(self, region: Box, sbox: Box, dbox: Box) -> Task:
        """The local copy of ``region`` (held in ``sbox`` here, wanted in ``dbox`` here)."""
        return Task(
            f"{self.name}copy",
            TaskKind.LOCAL,
            (self.src_buf,),
            (self.dst_buf,),
            src_region=relative(region, sbox),
            region=relative(region, dbox),
            shape=box_shape(dbox),
            accumulate=self.accumulate,
            dtype=self.dtype,
        )

    def send(self, tag: int, peer: int, region: Box, sbox: Box) -> Task:
        """The send of ``region`` (held in ``sbox``) to ``peer``."""
        return Task(
            message_name(self.name, TaskKind.SEND, tag),
            TaskKind.SEND,
            (self.src_buf,),
            (),
            peer=peer,
            nbytes=box_numel(region) * self.elem_bytes,
            region=relative(region, sbox),
            tag=tag,
            dtype=self.dtype,
            channel=self.channel,
        )

    def recv(self, tag: int, peer: int, region: Box, dbox: Box) -> Task:
        """The receive of ``region`` (wanted in ``dbox``) from ``peer``."""
        return Task(
            message_name(self.name, TaskKind.RECV, tag),
            TaskKind.RECV,
            (),
            (self.dst_buf,),
            peer=peer,
            nbytes=box_numel(region) * self.elem_bytes,
            region=relative(region, dbox),
            shape=box_shape(dbox),
            accumulate=self.accumulate,
            tag=tag,
            dtype=self.dtype,
            channel=self.channel,
        )


def _point_to_point(src, dst, shape, eb, src_buf, dst_buf, accumulate, first_tag, name, dtype) -> Conversion:
    """Every piece of the destination copied from (or sent by) a holder of each overlapping piece
    of the source: itself where it holds one, else the replica at its position modulo theirs."""
    conv = Conversion(kinds=["p2p"])
    pieces = []  # (device, box, partial key)
    for flat, dev in enumerate(src.mesh.devices):
        pieces.append((dev, src.box(flat, shape), src.partial_key(flat)))
    keys = sorted({p[2] for p in pieces})
    make = _Messages(src_buf, dst_buf, name, dtype, eb, accumulate or len(keys) > 1)
    for flat, dd in enumerate(dst.mesh.devices):
        dbox = dst.box(flat, shape)
        for key in keys:
            by_box: dict = {}
            for dev, sbox, k in pieces:
                if k == key and intersect(sbox, dbox) is not None:
                    by_box.setdefault(sbox, []).append(dev)
            for sbox, replicas in by_box.items():
                chosen = _chosen(src, dst, flat, dd, replicas)
                region = intersect(sbox, dbox)
                if chosen == dd:
                    conv.add("dst", dd, make.copy(region, sbox, dbox))
                    continue
                tag = first_tag + conv.tags
                conv.tags += 1
                conv.add("src", chosen, make.send(tag, dd, region, sbox))
                conv.add("dst", dd, make.recv(tag, chosen, region, dbox))
    return _own_pieces_last(conv)


def _chosen(src: Layout, dst: Layout, flat: int, dd: int, replicas: list[int]) -> int:
    """The holder of a source piece that sends it to ``dd`` (at position ``flat`` of the destination's
    mesh): ``dd`` itself; else, between meshes of one shape, the holder at the same position (a
    pipeline's stages with a mesh in another order than row-major: context parallelism's); else the
    replica at its position modulo theirs."""
    if dd in replicas:
        return dd
    if src.mesh.shape == dst.mesh.shape and src.mesh.devices[flat] in replicas:
        return src.mesh.devices[flat]
    return replicas[flat % len(replicas)]


def _point_to_point_only(src, dst, shape, eb, src_buf, dst_buf, accumulate, name, dtype, only, channel) -> Conversion:
    """:func:`_point_to_point` for the devices in ``only``: the same messages, chosen the same way,
    found without visiting every pair of pieces. A message's tag is computed from the positions of
    its receiver and sender, so both ends agree without planning anyone else."""
    conv = Conversion(kinds=["p2p"])
    n_src = len(src.mesh.devices)
    sboxes, dboxes = src.boxes(shape), dst.boxes(shape)  # every position's, as box() gives them
    pieces = [(dev, sboxes[flat], src.partial_key(flat)) for flat, dev in enumerate(src.mesh.devices)]
    keys = sorted({p[2] for p in pieces})
    key_index = {k: i for i, k in enumerate(keys)}
    make = _Messages(src_buf, dst_buf, name, dtype, eb, accumulate or len(keys) > 1, channel)
    by_key: dict[tuple, dict] = {k: {} for k in keys}  # key -> box -> devices holding it, in mesh order
    for dev, sbox, k in pieces:
        by_key[k].setdefault(sbox, []).append(dev)
    src_pos = src.mesh.position
    every = [(k, sbox, reps) for k in keys for sbox, reps in by_key[k].items()]
    planned = [(k, sbox, reps) for k, sbox, reps in every if not only.isdisjoint(reps)]
    for flat, dd in _receivers(src, dst, sboxes, dboxes, only):
        dbox = dboxes[flat]
        # a receiver not planned needs only the messages of planned senders: pieces a planned device holds
        for k, sbox, reps in every if dd in only else planned:
            region = intersect(sbox, dbox)
            if region is None:
                continue
            chosen = _chosen(src, dst, flat, dd, reps)
            if chosen == dd:
                if dd in only:
                    conv.add("dst", dd, make.copy(region, sbox, dbox))
                continue
            tag = (flat * len(keys) + key_index[k]) * n_src + src_pos[chosen]
            if chosen in only:
                conv.add("src", chosen, make.send(tag, dd, region, sbox))
            if dd in only:
                conv.add("dst", dd, make.recv(tag, chosen, region, dbox))
    return _own_pieces_last(conv)


def _own_pieces_last(conv: Conversion) -> Conversion:
    """Every receiver copies the pieces it holds itself after the messages of the others: its own
    piece sits at the same place in the receive list of every device (which piece a device holds
    depends on its position), so devices at alike positions have alike programs."""
    for dev, tasks in conv.dst.items():
        conv.dst[dev] = sorted(tasks, key=lambda t: t.kind is TaskKind.LOCAL)
    return conv


def _receivers(src: Layout, dst: Layout, sboxes: list, dboxes: list, only: frozenset[int]) -> list[tuple[int, int]]:
    """``(position, device)`` of the destinations planned or fed by a planned sender, in mesh order
    (``sboxes``, ``dboxes``: every source's and destination's box, by position)."""
    src_pos, dst_pos = src.mesh.position, dst.mesh.position
    wanted = {dst_pos[d]: d for d in only if d in dst_pos}
    senders = [d for d in only if d in src_pos]
    if senders:
        mine = {sboxes[src_pos[d]] for d in senders}
        fed: dict = {}  # per destination box (positions share few): whether a planned sender's piece meets it
        for flat, dd in enumerate(dst.mesh.devices):
            if flat not in wanted:
                dbox = dboxes[flat]
                hit = fed.get(dbox)
                if hit is None:
                    hit = fed[dbox] = any(intersect(b, dbox) is not None for b in mine)
                if hit:
                    wanted[flat] = dd
    return [(flat, wanted[flat]) for flat in sorted(wanted)]
