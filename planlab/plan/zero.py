"""ZeRO-3 (DeepSpeed stage 3, PyTorch FSDP's FULL_SHARD): weights, gradients and optimizer
states all sharded over the devices that sum a weight's gradient.

A pass of ``materialize`` (after recomputation, in place of the gradient buckets): the weights
of one device and reduction group are cut into *units*, one per layer as FSDP wraps modules
(the parameters whose names share the prefix up to their first index, ``blocks.3``, or their
first name, ``wte``; consecutive in the forward). Each unit keeps one flat shard of
``ceil(numel / n)`` elements per device (weights ``zp:``, gradients ``zg:`` and optimizer states)
and, per micro-batch:

- forward: an all-gather of the unit's full weights (``zf:``) on the communication stream,
  issued when the previous unit starts (FSDP's forward prefetch), read by the unit's forward
  tasks and freed, the unit at once, after the last of them (reshard after forward);
- backward: the same again (``zb:``), issued when the unit after it in the forward starts its
  backward (backward prefetch) and freed after the unit's last backward;
- the backward tasks write each weight's full gradient (``zd:``), reduce-scattered on the
  communication stream into the unit's shard gradient right after the unit's last backward;
- the update steps the optimizer on the shard; no all-gather follows.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Callable

from planlab.graph.ir import Graph
from planlab.plan.program import Precision, Task, TaskKind

FORWARD_WEIGHTS, BACKWARD_WEIGHTS, FULL_GRADIENT = "zf:", "zb:", "zd:"
RECOMPUTE_WEIGHTS = "zr:"  # gathered again for a recomputed forward (regather=True, DeepSpeed)


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


def in_backward(buf: str) -> str:
    """What a forward task's read ``buf`` is when the task runs again in the backward block (a
    co-located chunk remade before its backward): a weight gathered for the forward is read from
    the backward's gather, since the forward's is freed after the forward (reshard after forward)."""
    return BACKWARD_WEIGHTS + buf[len(FORWARD_WEIGHTS) :] if buf.startswith(FORWARD_WEIGHTS) else buf


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
) -> list[Unit]:
    """Cut one group's weight gradients ``(owner index, "wg:" name, bytes)`` into units, in forward order:
    runs of consecutive weights of one stage with one :func:`unit_key` (per layer, or ``per_module``)."""
    names = [op.name for op in graph.operators]
    ordered = sorted(items, key=lambda x: (x[0], x[1]))
    runs: list[tuple[tuple[int, str], list]] = []
    for idx, buf, nbytes in ordered:
        p = buf[3:]
        key = (stage[names[idx]], unit_key(p, per_module))
        if not runs or runs[-1][0] != key:
            runs.append((key, []))
        runs[-1][1].append((idx, p, nbytes // grad_bytes))
    out, used = [], defaultdict(int)
    for (st, key), ws in runs:
        used[key] += 1
        name = key if used[key] == 1 else f"{key}~{used[key]}"
        out.append(Unit(name, group, st, tuple(ws)))
    return out


def shard_fully(
    blocks: dict[tuple[int, str], list],
    units: list[Unit],
    *,
    graph: Graph,
    precision: Precision,
    emit: Callable,
    update_block: tuple[int, str],
    sizes: dict[str, int],
    regather: bool = False,
) -> tuple[int, list]:
    """Apply ZeRO-3 to one device: rewrite its forward and backward tasks to read the gathered
    weights and write full gradients, and emit the gathers, reduce-scatters and shard optimizer
    steps of ``units`` (see the module docstring). ``blocks`` are the device's block entries
    ``{(stage, phase): [(key, task)]}``, ``emit(block, key, task)`` adds one, ``sizes`` maps buffers
    to bytes. Returns the elements no longer held whole (weights, gradients and optimizer states
    keep a shard) and the groups of buffers freed together (a unit's gathered weights). With
    ``regather`` a recomputed forward in the backward block gathers its unit's weights once more
    (``zr:``, as DeepSpeed's pre-forward hooks do) instead of reading the backward's gather."""
    fwd = {f"w:{p}": FORWARD_WEIGHTS + p for u in units for _, p, _ in u.weights}
    bwd = {f"w:{p}": BACKWARD_WEIGHTS + p for u in units for _, p, _ in u.weights}
    rec = {f"w:{p}": RECOMPUTE_WEIGHTS + p for u in units for _, p, _ in u.weights}
    grad = {f"wg:{p}": FULL_GRADIENT + p for u in units for _, p, _ in u.weights}
    owned: dict[str, list[str]] = defaultdict(list)  # operator -> its weights' backward copies
    names = [op.name for op in graph.operators]
    for u in units:
        for idx, p, n in u.weights:
            owned[names[idx]].append(BACKWARD_WEIGHTS + p)
            sizes[FORWARD_WEIGHTS + p] = sizes[BACKWARD_WEIGHTS + p] = sizes[RECOMPUTE_WEIGHTS + p] = (
                n * precision.param_bytes
            )
            sizes[FULL_GRADIENT + p] = n * precision.grad_bytes
    first: dict[tuple[str, str], tuple] = {}  # (unit, phase) -> key of its first task using its weights
    last_grad: dict[str, tuple] = {}  # unit -> key of its last backward task
    unit_of = {m: u.name for u in units for _, p, _ in u.weights for m in (f"w:{p}", f"wg:{p}")}
    for (st, ph), items in blocks.items():
        if ph not in ("F", "B"):
            continue
        for k, (key, t) in enumerate(items):
            redo = regather and ph == "B" and t.recompute == "redo"
            ren = fwd if ph == "F" else rec if redo else bwd
            used = [b for b in t.reads if b in ren] + [b for b in t.writes if b in grad]
            if not used:
                continue
            saved = t.saved + tuple(owned[t.op]) if t.kind is TaskKind.BACKWARD and t.op in owned else t.saved
            items[k] = (
                key,
                dataclasses.replace(
                    t,
                    reads=tuple(ren.get(r, r) for r in t.reads),
                    writes=tuple(grad.get(w, w) for w in t.writes),
                    saved=saved,
                ),
            )
            for b in used:
                u, uph = unit_of[b], "R" if redo else ph
                if (u, uph) not in first or key < first[(u, uph)]:
                    first[(u, uph)] = key
                if b in grad and (u not in last_grad or key > last_grad[u]):
                    last_grad[u] = key
    together = []
    pb, gb = precision.param_bytes, precision.grad_bytes
    for st in sorted({u.stage for u in units}):
        mine = [u for u in units if u.stage == st]
        redone = sorted((u for u in mine if (u.name, "R") in first), key=lambda u: first[(u.name, "R")])
        for ph, prefix, order in (
            ("F", FORWARD_WEIGHTS, mine),
            ("B", BACKWARD_WEIGHTS, mine[::-1]),
            ("R", RECOMPUTE_WEIGHTS, redone),
        ):
            present = [u for u in order if (u.name, ph) in first]
            for k, u in enumerate(present):
                # issued when the unit before it (in this pass's order) starts: FSDP's prefetch
                start = first[(present[max(k - 1, 0)].name, ph)]
                bufs = tuple(prefix + p for _, p, _ in u.weights)
                emit(
                    (st, "B" if ph == "R" else ph),
                    (start[0], -2, k),
                    Task(
                        f"zero3-gather-{ph.lower()}{list(u.group)}#{u.name}",
                        TaskKind.COLLECTIVE,
                        (f"zp:{u}",),
                        bufs,
                        collective="all_gather",
                        group=u.group,
                        nbytes=u.shard_numel * len(u.group) * pb,
                        overlap=True,
                    ),
                )
                together.append(bufs)
    saved_numel = 0
    for u in units:
        if u.name in last_grad:  # right after the unit's last backward task
            end = last_grad[u.name]
            emit(
                (u.stage, "B"),
                end[:-1] + (end[-1] + 0.5,),
                Task(
                    f"zero3-reduce-scatter{list(u.group)}#{u.name}",
                    TaskKind.COLLECTIVE,
                    tuple(FULL_GRADIENT + p for _, p, _ in u.weights),
                    (f"zg:{u}",),
                    collective="reduce_scatter",
                    group=u.group,
                    nbytes=u.shard_numel * len(u.group) * gb,
                    accumulate=True,
                    overlap=True,
                ),
            )
        emit(
            update_block,
            (1, 0),
            Task(
                f"optimizer-shard{list(u.group)}#{u.name}",
                TaskKind.OPTIMIZER,
                (f"zg:{u}",),
                (f"zp:{u}",),
                flops=12.0 * u.shard_numel,
                bytes_moved=u.shard_numel * (2 * pb + gb + 2 * precision.optimizer_bytes),
            ),
        )
        saved_numel += u.numel - u.shard_numel
    return saved_numel, together
