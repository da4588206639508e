"""ZeRO: optimizer states (stage 1), gradients (2) and weights (3) sharded over a weight's
data-parallel replicas (:func:`~planlab.plan.passes.gradients.zero_groups`): the ``materialize``
pass :func:`shard_zero`, after recomputation, in place of the gradient buckets of
:mod:`planlab.plan.passes.gradients`. A gradient that tensor-parallel ranks also sum (a norm's
weight under sequence parallelism, a row-parallel bias:
:func:`~planlab.plan.passes.gradients.zero_groups`) is all-reduced over them before it
is reduce-scattered, as the software does: FSDP2 per parameter in its post-backward hook (ZeRO-3),
Megatron-Core coalesced after the backward (ZeRO-1/2, and ZeRO-3's weights kept whole). DeepSpeed's
ZeRO-3 gets FSDP2's: no source was found for how Megatron-DeepSpeed sums such gradients under it
(the DeepSpeed sets here run without tensor parallelism).

ZeRO-1 and 2 (DeepSpeed's stages 1 and 2), per device and reduction group: the group's gradients
are reduce-scattered in the update block into this device's shard of the flattened bucket
(``SHARD_GRAD``), the optimizer steps the shard (``SHARD_WEIGHT``), and the updated shards are
all-gathered back into the weights. Stage 1 keeps the whole gradients, stage 2 only the shard.

ZeRO-3 (DeepSpeed stage 3, PyTorch FSDP's FULL_SHARD): the weights
of one device and reduction group are cut into *units*, one per layer as FSDP wraps modules
(the parameters whose names share the prefix up to their first index, ``blocks.3``, or their
first name, ``wte``; consecutive in the forward), or one per module where the software's
``zero3_unit`` is ``module`` (DeepSpeed fetches parameters module by module). Each unit keeps one flat shard of
``ceil(numel / n)`` elements per device (weights ``zp:``, gradients ``zg:`` and optimizer states)
and, per micro-batch:

- forward: an all-gather of the unit's full weights (``GATHERED_FORWARD``) on the communication stream,
  issued when the previous unit starts (FSDP's forward prefetch; as the unit itself starts where
  the previous one holds the software's ``zero3_max_live_elements`` or more), read by the unit's forward
  tasks and freed, the unit at once, after the last of them (reshard after forward);
- backward: the same again (``GATHERED_BACKWARD``), issued when the unit after it in the forward starts its
  backward (backward prefetch) and freed after the unit's last backward; with the software's
  ``zero3_regather_for_recompute`` (DeepSpeed's pre-forward hooks), a recomputed forward in the
  backward block gathers its unit's weights once more (``GATHERED_RECOMPUTE``), in the order the
  recomputation first uses them, instead of reading the backward's gather;
- the backward tasks write each weight's full gradient (``FULL_GRAD``), reduce-scattered on the
  communication stream into the unit's shard gradient right after the unit's last backward;
- the update steps the optimizer on the shard; no all-gather follows.

A unit belongs to the stage of the operators whose backward makes its gradients; a stage that only
reads its weights (a recycling pass before the last, :mod:`planlab.search_spaces.recycling`: each
pass runs the same weights, only the last has a backward) gathers the unit for its own forward, into
buffers of its own (:func:`gathered`), freed after that stage's last reader, as FSDP gathers a
module again at each call.

The gathers issued as one operator starts run in the order of their place in their group's
sequence of units (the first unit's gather and the next one's both start with the first unit),
then by group.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import defaultdict

from planlab.costmodel.software import Fusion
from planlab.graph.ir import Graph
from planlab.plan import buffer as buf_
from planlab.plan.buffer import Buffer, BufferKind
from planlab.plan.passes.draft import (
    BlockKey,
    Draft,
    Idents,
    Part,
    Parts,
    SlotKey,
    add,
    by_block,
    run_order,
    update_blocks,
)
from planlab.plan.passes.gradients import Reduction, all_reduce, params_of, zero_groups
from planlab.plan.fused_gemms import fused_fields, fused_groups
from planlab.plan.program import ADAM_FLOPS_PER_PARAM, Precision, Recompute, Role, Task, TaskKind
from planlab.plan.saved import FP8_BYTES, fp8_gathered_weights


def unit_key(param: str, per_module: bool = False) -> str:
    """The unit a parameter belongs to: its name up to its first index (``blocks.3.attn.q.weight``:
    ``blocks.3``), else its first name (``wte.weight``: ``wte``); ``per_module``: its module
    (``blocks.3.attn.q``), as DeepSpeed's ZeRO-3 fetches parameters module by module."""
    parts = param.split(".")
    if per_module and len(parts) > 1:
        return ".".join(parts[:-1])
    for k, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: k + 1])
    return parts[0] if len(parts) > 1 else param


def in_backward(buf: Buffer) -> Buffer:
    """What a forward task's read ``buf`` is when the task runs again in the backward block (a
    co-located chunk remade before its backward): a weight gathered for the forward is read from
    the backward's gather, since the forward's is freed after the forward (reshard after forward)."""
    if buf.kind is BufferKind.GATHERED_FORWARD:
        return buf.with_kind(BufferKind.GATHERED_BACKWARD)
    return buf


@dataclasses.dataclass(frozen=True)
class Unit:
    """A unit on one device: its name, the reduction group, its stage and ``(owner index, parameter,
    elements)`` per weight, in forward order."""

    name: str
    group: tuple[int, ...]
    stage: int
    weights: tuple[tuple[int, str, int], ...]

    @property
    def numel(self) -> int:
        return sum(n for _, _, n in self.weights)

    @property
    def shard_numel(self) -> int:
        """Elements of the flat shard each device keeps (the last shards are padded)."""
        return -(-self.numel // len(self.group))

    def __str__(self) -> str:
        return f"{self.name}{list(self.group)}"


def units_of(
    items: list[tuple[int, str, int]],
    group: tuple[int, ...],
    graph: Graph,
    stage: dict[str, int],
    grad_bytes: int,
    *,
    per_module: bool = False,
    fused: frozenset[str] = frozenset(),
) -> list[Unit]:
    """Cut one group's weight gradients ``(owner index, parameter, bytes)`` into units, in forward order:
    runs of consecutive weights of one stage with one :func:`unit_key` (per layer, or ``per_module``).
    Per module, the weights of the operators ``fused`` (an attention's query, key and value
    projections that the software runs as one fused layer, :func:`fused_projections`) share one
    unit, named after their modules' parent (``blocks.3.attn.qkv``)."""
    names = [op.name for op in graph.operators]
    ordered = sorted(items, key=lambda x: (x[0], x[1]))
    runs: list[tuple[tuple[int, str], list]] = []
    for idx, p, nbytes in ordered:
        name = unit_key(p, per_module)
        if per_module and names[idx] in fused:
            name = name.rpartition(".")[0] + ".qkv"
        key = (stage[names[idx]], name)
        if not runs or runs[-1][0] != key:
            runs.append((key, []))
        runs[-1][1].append((idx, p, nbytes // grad_bytes))
    out, used = [], defaultdict(int)
    for (st, key), ws in runs:
        used[key] += 1
        name = key if used[key] == 1 else f"{key}~{used[key]}"
        out.append(Unit(name, group, st, tuple(ws)))
    return out


def shard_zero(d: Draft) -> Draft:
    """ZeRO stages 1 to 3 (``plan.zero``; see the module docstring) on every device and reduction
    group: the tasks, the bytes no longer held whole (``zero_saved``), the parameters kept in
    shards (``sharded``) and, for stage 3, the gathered weights freed together (``together``)."""
    if d.plan.zero == 0:
        return d
    parts, sizes = dict(d.parts), d.copy_sizes()
    idents = Idents(d.next_ident)
    zero_saved, sharded, together = {}, {}, {}
    pb, gb, ob = d.precision.param_bytes, d.precision.grad_bytes, d.precision.optimizer_bytes
    groups, tensor_parallel = zero_groups(d)
    blocks = by_block(d.parts)
    for dev, update in sorted(update_blocks(d).items()):
        mine = groups[dev]
        sharded[dev] = frozenset(p for items in mine.values() for _, p, _ in items)
        tp_of = {p: g for g, items in tensor_parallel[dev].items() for _, p, _ in items}
        if d.plan.zero == 3:
            per_module = d.software is not None and d.software.zero3_unit == "module"
            fused = fused_projections(d) if per_module else frozenset()
            gathered_items, persistent = _persistent_apart(mine, d)
            units = [
                units_of(gathered_items[g], g, d.graph, d.stage, gb, per_module=per_module, fused=fused)
                for g in sorted(mine)
            ]
            keys = [k for (dv, _), ks in blocks.items() if dv == dev for k in ks]
            numel, together[dev] = shard_fully(
                parts, dev, keys, update, units, d=d, sizes=sizes.setdefault(dev, {}), idents=idents, tp_of=tp_of
            )
            _reduce_tensor_parallel(parts, dev, update, persistent, tp_of, d, idents)
            kept_grads = kept_states = 0
            for group in sorted(persistent):  # whole weights, sharded gradients and states (as ZeRO-2)
                n = len(group)
                kept = _shard_bucket(parts, dev, update, group, persistent[group], d, idents)
                kept_grads += kept * gb * (n - 1) // n
                kept_states += kept * ob * (n - 1) // n
            zero_saved[dev] = (numel * gb + kept_grads, numel * ob + kept_states, numel * pb)
            continue
        saved_grads = saved_states = 0
        _reduce_tensor_parallel(parts, dev, update, mine, tp_of, d, idents)
        for group in sorted(mine):
            numel = _shard_bucket(parts, dev, update, group, mine[group], d, idents)
            n = len(group)
            saved_states += numel * ob * (n - 1) // n
            if d.plan.zero >= 2:
                saved_grads += numel * gb * (n - 1) // n
        zero_saved[dev] = (saved_grads, saved_states, 0)
    return d.replace(
        parts=parts, sizes=sizes, zero_saved=zero_saved, sharded=sharded, together=together, next_ident=idents.next
    )


def fused_projections(d: Draft) -> frozenset[str]:
    """The query, key and value projections whose weights a software with ``fused_qkv`` holds as one
    parameter of one module (Megatron-LM's ``query_key_value`` ColumnParallelLinear, one
    ``[3h, h]`` weight), so that ZeRO-3 fetches them with one gather per use: the operators whose
    pieces run as one fused GEMM (:func:`planlab.plan.fused_gemms.fused_fields`); empty without ``fused_qkv``."""
    if d.software is None or not d.software.fused_qkv:
        return frozenset()
    groups = fused_groups(d.graph)
    return frozenset(name for name, g in groups.items() if g.fusion is Fusion.QKV and fused_fields(d, d.graph.op(name)))


def _reduce_tensor_parallel(
    parts: Parts,
    dev: int,
    update: BlockKey,
    mine: dict[tuple[int, ...], Reduction],
    tp_of: dict[str, tuple[int, ...]],
    d: Draft,
    idents: Idents,
) -> None:
    """The weight gradients of ``mine`` (per shard group) that their tensor-parallel group sums first
    (``tp_of``, :func:`~planlab.plan.passes.gradients.zero_groups`), summed in the update
    block before ZeRO's reduce-scatters: one all-reduce of them as one flat buffer per tensor-parallel
    group, as Megatron-Core's ``finalize_model_grads`` all-reduces the sequence-parallel weights'
    gradients coalesced (``_flatten_dense_tensors``; it runs after the data-parallel reduction, the
    same bytes)."""
    by_group: dict[tuple[int, ...], Reduction] = defaultdict(list)
    for items in mine.values():
        for item in items:
            if item[1] in tp_of:
                by_group[tp_of[item[1]]].append(item)
    for group in sorted(by_group):
        ordered = sorted(by_group[group])
        ident = idents(("zero-tp-reduce", params_of(ordered)))
        add(parts, dev, update, 0, Part.REDUCE, all_reduce(d, ordered, group, f"grad-tp-reduce{list(group)}", ident))


def _persistent_apart(mine: dict[tuple[int, ...], Reduction], d: Draft) -> tuple[dict, dict]:
    """A device's reduction groups' weights split into those ZeRO-3 gathers and those kept whole
    (fewer elements than the software's ``zero3_persistence_elements``: DeepSpeed's
    ``stage3_param_persistence_threshold``), each per group: every group has its gathered list (maybe
    empty), and only a group with small weights has a kept list."""
    limit = d.software.zero3_persistence_elements if d.software is not None else 0
    gb = d.precision.grad_bytes
    gathered, persistent = {}, {}
    for group, items in mine.items():
        small = [x for x in items if x[2] // gb < limit]
        if small:
            persistent[group] = small
        gathered[group] = [x for x in items if x[2] // gb >= limit]
    return gathered, persistent


def _shard_bucket(
    parts: Parts, dev: int, update: BlockKey, group: tuple[int, ...], items: Reduction, d: Draft, idents: Idents
) -> int:
    """ZeRO-1/2 on one device and group: reduce-scatter the group's gradients into this device's
    shard, step the optimizer on the shard, all-gather the updated weights (the update block's
    ``REDUCE``, ``SHARD_STEPS`` and ``GATHER`` parts). Returns the bucket's elements."""
    precision = d.precision
    params = tuple(p for _, p, _ in items)
    grad_bytes = sum(n for _, _, n in items)
    n, numel = len(group), grad_bytes // precision.grad_bytes
    zg, zp = buf_.shard_grad(group), buf_.shard_weight(group)
    reduce = Task(
        f"grad-reduce-scatter{list(group)}",
        TaskKind.COLLECTIVE,
        tuple(d.names.weight_grad(p) for p in params),
        (zg,),
        collective="reduce_scatter",
        group=group,
        nbytes=grad_bytes,
        role=Role.SHARD_GRADS,
        ident=idents(("zero-reduce-scatter", params)),
    )
    step = Task(
        f"optimizer-shard{list(group)}",
        TaskKind.OPTIMIZER,
        (zg,),
        (zp,),
        flops=ADAM_FLOPS_PER_PARAM * numel / n,
        bytes_moved=numel / n * (2 * precision.param_bytes + precision.grad_bytes + 2 * precision.optimizer_bytes),
        role=Role.SHARD_STEP,
        params=numel / n,
    )
    gather = Task(
        f"param-all-gather{list(group)}",
        TaskKind.COLLECTIVE,
        (zp,),
        tuple(d.names.weight(p) for p in params),
        collective="all_gather",
        group=group,
        nbytes=numel * precision.param_bytes,
        role=Role.GATHER_WEIGHTS,
        ident=idents(("zero-all-gather", params)),
    )
    for part, task in ((Part.REDUCE, reduce), (Part.SHARD_STEPS, step), (Part.GATHER, gather)):
        add(parts, dev, update, 0, part, task)
    return numel


def shard_fully(
    parts: Parts,
    dev: int,
    keys: list[SlotKey],
    update: BlockKey,
    groups: list[list[Unit]],
    *,
    d: Draft,
    sizes: dict[Buffer, int],
    idents: Idents,
    tp_of: dict[str, tuple[int, ...]] | None = None,
) -> tuple[int, tuple[tuple[Buffer, ...], ...]]:
    """Apply ZeRO-3 to device ``dev`` (its forward and backward slot parts ``keys``, in the order
    they run; ``parts`` is changed): rewrite its forward and backward tasks to read the gathered weights
    and write full gradients, and add the gathers, reduce-scatters and shard optimizer steps (in
    its ``update`` block) of the units of each of its reduction ``groups`` (see the module
    docstring); ``sizes`` gets the new buffers' bytes. Returns the elements no longer held whole
    (weights, gradients and optimizer states keep a shard) and the groups of buffers freed together
    (a unit's gathered weights). The weights whose gradients a tensor-parallel group sums first
    (``tp_of``: the group per parameter) are all-reduced over it one by one, on the compute stream,
    after the unit's last backward task and before its reduce-scatter, as FSDP2's post-backward hook
    redistributes each Partial gradient before ``foreach_reduce`` (:func:`_tensor_parallel_sum`)."""
    units = [u for us in groups for u in us]
    tp_of = tp_of or {}
    fp8 = fp8_gathered_weights(d.graph, d.software, d.precision)  # gathered in FP8, cast on the shard
    first, last, last_grad = _gathered_and_reduced(parts, keys, units, d, sizes, fp8)
    places = _places(parts, keys)
    prefetch: dict[SlotKey, list] = {}  # slot part -> ((place, group), gather)
    inside: dict[SlotKey, list] = {}  # a recomputation's slot part -> (task index, (place, group), gather)
    together = []
    kept: dict[Buffer, Buffer] = {}  # a backward's gathered weight -> the recomputation's, kept for it
    for gi, mine in enumerate(groups):
        ours = set(mine)
        for st in sorted({block[0] for u, _, block in first if u in ours}):  # the stages that read them
            for block, trace in _traces(mine, st, first, d):
                kept_units = _kept(trace, d)
                present = [(u, ph) for u, ph in trace if (u, ph) not in kept_units]
                for k, (u, ph) in enumerate(present):
                    # issued when the use before it (in the block's trace) starts: FSDP's and DeepSpeed's
                    # prefetch; when that unit is too large to prefetch beside (DeepSpeed's max live), at
                    # the first task after its last use (DeepSpeed's next module hook once it is
                    # released), or as u starts
                    before = present[max(k - 1, 0)]
                    if prefetches(before[0], d):
                        (_, index), start = first[before + (block,)]
                    else:
                        held = (before[0], "B") if (before[0], "B") in kept_units else before
                        (_, index), start = _hook_after(places[block], last[held + (block,)], first[(u, ph, block)])
                    task = _gather(u, ph, _GATHERED[ph], st, d.precision, idents, fp8)
                    sizes.update(
                        (b, n * _gathered_bytes(p, d.precision, fp8)) for b, (_, p, n) in zip(task.writes, u.weights)
                    )
                    if start[3] is Part.RECOMPUTE:  # inside the recomputation, before the task it is issued at
                        inside.setdefault(start, []).append((index, (k, gi), task))
                    else:
                        prefetch.setdefault((start[0], block, start[2], Part.PREFETCH), []).append(((k, gi), task))
                    together.append(task.writes)
                for u, _ in kept_units:
                    for _, p, _ in u.weights:
                        kept[gathered(BufferKind.GATHERED_BACKWARD, p, u, st)] = gathered(
                            BufferKind.GATHERED_RECOMPUTE, p, u, st
                        )
    if kept:
        _read_kept(parts, keys, kept)
    for key, gathers in prefetch.items():
        add(parts, *key, *(t for _, t in sorted(gathers, key=lambda x: x[0])))
    for key, gathers in inside.items():
        tasks = list(parts[key])
        for index, _, task in sorted(gathers, key=lambda x: (x[0], x[1]), reverse=True):
            tasks.insert(index, task)
        parts[key] = tuple(tasks)
    saved_numel = 0
    later = d.software is not None and d.software.zero3_reduce_at_next_gradient
    hooks = _gradient_hooks(parts, keys) if later else {}
    for u in units:
        if u in last_grad:
            at, key = last_grad[u]
            for _, p, n in u.weights:
                if p in tp_of:
                    task = _tensor_parallel_sum(p, n, tp_of[p], d.precision, idents)
                    add(parts, dev, (u.stage, "B"), key[2], Part.AFTER, task)
            hook = next((h for h in hooks.get(key[1], ()) if h[0] > at), None)
            if hook is None:  # right after the unit's last backward task
                add(parts, dev, (u.stage, "B"), key[2], Part.AFTER, _reduce_scatter(u, d.precision, idents))
            else:  # as the next backward task writing a weight's gradient starts
                add(parts, dev, hook[1][1], hook[1][2], Part.INPUTS, _reduce_scatter(u, d.precision, idents))
        add(parts, dev, update, 0, Part.SHARD_STEPS, _shard_step(u, d.precision))
        saved_numel += u.numel - u.shard_numel
    return saved_numel, tuple(together)


def _places(parts: Parts, keys: list[SlotKey]) -> dict[BlockKey, list[tuple]]:
    """Per block, every task's place ``((run order, index), slot part)`` in the order the block runs them."""
    out: dict[BlockKey, list[tuple]] = defaultdict(list)
    for key in keys:
        out[key[1]].extend(((run_order(key), k), key) for k in range(len(parts[key])))
    for places in out.values():
        places.sort(key=lambda p: p[0])
    return out


def _hook_after(places: list[tuple], released: tuple, use: tuple) -> tuple:
    """Where DeepSpeed issues a unit's gather when the unit before it was too large to prefetch
    beside: at the first task after that unit's last use ``released`` (the next module's hook, by
    which the unit is released and the live parameters are below ``stage3_max_live_parameters``
    again), unless that is the unit's own first ``use``. Every traced operator stands for a module
    here; DeepSpeed checks at each module's pre-forward and pre-backward hook."""
    k = bisect.bisect_right([p[0] for p in places], released[0])
    # a gather outside a recomputation goes to its slot's PREFETCH part, which runs before the slot's
    # other parts: not in the slot of the released unit's last use
    while k < len(places) and places[k][1][3] is not Part.RECOMPUTE and places[k][1][2] == released[1][2]:
        k += 1
    return places[k] if k < len(places) and places[k][0] < use[0] else use


def _gradient_hooks(parts: Parts, keys: list[SlotKey]) -> dict[BlockKey, list[tuple]]:
    """Per backward block, where its backward tasks that write a weight's gradient (a unit's full
    gradient or a persistent weight's) are, in the order the block runs them: ``(place, slot part)``
    as :func:`_gathered_and_reduced` gives places. DeepSpeed's gradient hooks fire there: the one
    after a unit's last backward task issues the unit's reduce-scatter (the software's
    ``zero3_reduce_at_next_gradient``)."""
    out: dict[BlockKey, list[tuple]] = defaultdict(list)
    for key in keys:
        if key[1][1] != "B":
            continue
        for k, t in enumerate(parts[key]):
            if t.kind is TaskKind.BACKWARD and any(
                w is not None and w.kind in buf_.WEIGHT_GRAD_KINDS for w in t.writes
            ):
                out[key[1]].append(((run_order(key), k), key))
    for hooks in out.values():
        hooks.sort(key=lambda h: h[0])
    return out


def prefetches(u: Unit, d: Draft) -> bool:
    """Whether the next unit's gather is issued as ``u`` starts: always, but under the software's
    ``zero3_max_live_elements``, only while ``u``'s gathered weights hold fewer elements (DeepSpeed's
    ``prefetch_next_sub_modules`` prefetches only while the available parameters are fewer than
    ``stage3_max_live_parameters``)."""
    limit = d.software.zero3_max_live_elements if d.software is not None else 0
    return not limit or u.numel < limit


_GATHERED = {
    "F": BufferKind.GATHERED_FORWARD,
    "B": BufferKind.GATHERED_BACKWARD,
    "R": BufferKind.GATHERED_RECOMPUTE,  # the recomputation's, in the backward block
}


def _traces(mine: list[Unit], st: int, first: dict, d: Draft) -> list[tuple[BlockKey, list[tuple[Unit, str]]]]:
    """Per block of stage ``st``, the uses ``(unit, phase)`` of one group's units in the order
    their gathers are issued: the forward's in the units' order; the backward's in reverse, or, where
    the software gathers again for a recomputed forward (DeepSpeed), the recomputation's and the
    backward's as the block runs them, one trace (DeepSpeed's ``PrefetchCoordinator`` prefetches
    along the sub-modules it recorded, recomputed forwards and backwards interleaved)."""
    forward, backward = (st, "F"), (st, "B")
    out = [(forward, [(u, "F") for u in mine if (u, "F", forward) in first])]
    uses = [(u, "B") for u in mine[::-1] if (u, "B", backward) in first]
    redone = [(u, "R") for u in mine if (u, "R", backward) in first]
    if redone:
        uses = sorted(uses + redone, key=lambda x: first[x + (backward,)][0])
    out.append((backward, uses))
    return [(block, trace) for block, trace in out if trace]


def _kept(trace: list[tuple[Unit, str]], d: Draft) -> set[tuple[Unit, str]]:
    """The backward uses ``(unit, "B")`` that read the recomputation's gather of their unit instead of
    gathering it again: under the software's ``zero3_max_reuse_elements``, those whose unit's next
    use after its recomputed forward comes before that many elements of other uses (DeepSpeed's
    ``_keep_for_later``: a sub-module is not released when the parameters of the steps of its trace
    up to its next use are fewer than ``stage3_max_reuse_distance``)."""
    limit = d.software.zero3_max_reuse_elements if d.software is not None else 0
    if not limit:
        return set()
    out = set()
    for k, (u, ph) in enumerate(trace):
        if ph != "R":
            continue
        between = 0
        for v, vph in trace[k + 1 :]:
            if v == u:
                if vph == "B" and between < limit:
                    out.add((u, "B"))
                break
            between += v.numel
            if between >= limit:
                break
    return out


def _read_kept(parts: Parts, keys: list[SlotKey], kept: dict[Buffer, Buffer]) -> None:
    """Make the backward tasks read (and keep) the recomputation's gathered weights ``kept`` gives
    for their backward's."""
    for key in keys:
        if key[1][1] != "B":
            continue
        tasks = parts[key]
        if any(b in kept for t in tasks for b in t.reads + t.saved):
            parts[key] = tuple(
                t.but(reads=tuple(kept.get(b, b) for b in t.reads), saved=tuple(kept.get(b, b) for b in t.saved))
                for t in tasks
            )


def gathered(kind: BufferKind, param: str, unit: Unit, stage: int) -> Buffer:
    """The gathered copy (``kind``) of ``param``, of ``unit``, that stage ``stage``'s tasks read: the
    unit's own stage reads ``Buffer(kind, param)``; another stage (a recycling pass before the last,
    which reads the last pass's weights) its own gather, ``version`` ``stage``."""
    return Buffer(kind, param) if stage == unit.stage else Buffer(kind, param, version=stage)


def _gathered_and_reduced(
    parts: Parts, keys: list[SlotKey], units: list[Unit], d: Draft, sizes: dict[Buffer, int], fp8: frozenset[str]
) -> tuple[dict, dict]:
    """Rewrite the forward and backward tasks that use the units' weights (in ``parts``): forward
    tasks read the forward's gathered weights, backward blocks the backward's (their backward tasks
    keep them, as autograd saves them) and write full gradients; with the software's
    ``zero3_regather_for_recompute`` a recomputed forward reads the recomputation's gather (phase
    ``R``). Each stage reads its own gather (:func:`gathered`); a task reading a weight gathered in FP8
    (``fp8``, :func:`~planlab.plan.saved.fp8_gathered_weights`) is marked ``fp8_gathered``. Returns, per (unit, phase, block), where
    its first and its last task in the block are and, per unit, where its last backward task is:
    ``(place in the order the block runs, slot part)``."""
    names = [op.name for op in d.graph.operators]
    regather = d.software is not None and d.software.zero3_regather_for_recompute
    weights: dict[Buffer, tuple[str, Unit]] = {}  # a weight's buffer -> (parameter, unit)
    grad: dict[Buffer, Buffer] = {}
    owned: dict[str, list[Buffer]] = defaultdict(list)  # operator -> its weights' buffers
    unit_of: dict[Buffer, Unit] = {}
    for u in units:
        for idx, p, n in u.weights:
            w, g = d.names.weight(p), d.names.weight_grad(p)
            weights[w] = (p, u)
            grad[g] = Buffer(BufferKind.FULL_GRAD, p)
            owned[names[idx]].append(w)
            sizes[grad[g]] = n * d.precision.grad_bytes  # a gather sets its weights' sizes
            unit_of[w] = unit_of[g] = u
    first: dict[tuple[Unit, str, BlockKey], tuple] = {}
    last: dict[tuple[Unit, str, BlockKey], tuple] = {}
    last_grad: dict[Unit, tuple] = {}
    for key in keys:
        st, ph = key[1]
        tasks = list(parts[key])
        for k, t in enumerate(tasks):
            redo = regather and ph == "B" and t.recompute is Recompute.REDO
            used = [b for b in t.reads if b in weights] + [b for b in t.writes if b in grad]
            if not used:
                continue
            kind = (
                BufferKind.GATHERED_FORWARD
                if ph == "F"
                else BufferKind.GATHERED_RECOMPUTE
                if redo
                else BufferKind.GATHERED_BACKWARD
            )
            ren = {w: gathered(kind, *weights[w][:2], st) for w in t.reads if w in weights}
            saved = t.saved
            if t.kind is TaskKind.BACKWARD and t.op in owned:  # autograd keeps its weights for its backward
                saved += tuple(gathered(BufferKind.GATHERED_BACKWARD, *weights[w][:2], st) for w in owned[t.op])
            tasks[k] = t.but(
                reads=tuple(ren.get(r, r) for r in t.reads),
                writes=tuple(grad.get(w, w) for w in t.writes),
                saved=saved,
                fp8_gathered=t.fp8_gathered or any(weights[w][0] in fp8 for w in t.reads if w in weights),
            )
            at = ((run_order(key), k), key)
            for b in used:
                u, uph = unit_of[b], "R" if redo else ph
                if (u, uph, key[1]) not in first or at[0] < first[(u, uph, key[1])][0]:
                    first[(u, uph, key[1])] = at
                if (u, uph, key[1]) not in last or at[0] > last[(u, uph, key[1])][0]:
                    last[(u, uph, key[1])] = at
                if b in grad and (u not in last_grad or at[0] > last_grad[u][0]):
                    last_grad[u] = at
        parts[key] = tuple(tasks)
    return first, last, last_grad


def _gathered_bytes(param: str, precision: Precision, fp8: frozenset[str]) -> int:
    """Bytes per element of ``param`` as gathered: one for a weight gathered in FP8 (``fp8``), else the
    precision's weight bytes."""
    return FP8_BYTES if param in fp8 else precision.param_bytes


def _gather(
    u: Unit, ph: str, kind: BufferKind, stage: int, precision: Precision, idents: Idents, fp8: frozenset[str]
) -> Task:
    """The all-gather of unit ``u``'s weights for phase ``ph`` of stage ``stage`` into ``kind`` buffers
    (the weights ``fp8`` in FP8, one byte an element)."""
    own = stage == u.stage
    light = sum(n for _, p, n in u.weights if p in fp8) * (precision.param_bytes - FP8_BYTES)
    return Task(
        f"zero3-gather-{ph.lower()}{list(u.group)}#{u.name}" + ("" if own else f"@{stage}"),
        TaskKind.COLLECTIVE,
        (buf_.shard_weight(u.group, u.name),),
        tuple(gathered(kind, p, u, stage) for _, p, _ in u.weights),
        collective="all_gather",
        group=u.group,
        nbytes=u.shard_numel * len(u.group) * precision.param_bytes - light,
        overlap=True,
        role=Role.UNIT_GATHER,
        ident=idents(("zero3-gather", ph, tuple(p for _, p, _ in u.weights)) + (() if own else (stage,))),
    )


def _reduce_scatter(u: Unit, precision: Precision, idents: Idents) -> Task:
    """The reduce-scatter of unit ``u``'s full gradients into its shard gradient."""
    return Task(
        f"zero3-reduce-scatter{list(u.group)}#{u.name}",
        TaskKind.COLLECTIVE,
        tuple(Buffer(BufferKind.FULL_GRAD, p) for _, p, _ in u.weights),
        (buf_.shard_grad(u.group, u.name),),
        collective="reduce_scatter",
        group=u.group,
        nbytes=u.shard_numel * len(u.group) * precision.grad_bytes,
        accumulate=True,
        overlap=True,
        role=Role.UNIT_GRADS,
        ident=idents(("zero3-reduce-scatter", tuple(p for _, p, _ in u.weights))),
    )


def _tensor_parallel_sum(param: str, numel: int, group: tuple[int, ...], precision: Precision, idents: Idents) -> Task:
    """The all-reduce of ``param``'s full gradient (``numel`` elements) over its tensor-parallel
    ``group``, in place, on the compute stream: FSDP2's ``FSDPParam._get_grad_inner_tensor``
    (``grad.redistribute`` from Partial to the parameter's Replicate placement on the tensor-parallel
    mesh), called per parameter by ``FSDPParamGroup.post_backward`` before ``foreach_reduce``."""
    full = Buffer(BufferKind.FULL_GRAD, param)
    return Task(
        f"zero3-tp-reduce{list(group)}#{param}",
        TaskKind.COLLECTIVE,
        (full,),
        (full,),
        collective="all_reduce",
        group=group,
        nbytes=numel * precision.grad_bytes,
        ident=idents(("zero3-tp-reduce", param)),
    )


def _shard_step(u: Unit, precision: Precision) -> Task:
    """The optimizer step on unit ``u``'s shard."""
    pb, gb = precision.param_bytes, precision.grad_bytes
    return Task(
        f"optimizer-shard{list(u.group)}#{u.name}",
        TaskKind.OPTIMIZER,
        (buf_.shard_grad(u.group, u.name),),
        (buf_.shard_weight(u.group, u.name),),
        flops=ADAM_FLOPS_PER_PARAM * u.shard_numel,
        bytes_moved=u.shard_numel * (2 * pb + gb + 2 * precision.optimizer_bytes),
        role=Role.SHARD_STEP,
        params=float(u.shard_numel),
    )
