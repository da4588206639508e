"""Context parallelism (``cp``): the sequence split over ``cp`` devices, as Megatron-Core lays it out.

Megatron-Core's rank order is ``tp-cp-ep-dp-pp``: the context-parallel ranks sit just outside the
tensor-parallel ones. Here the ``cp`` knob adds the innermost mesh axis, whose devices are placed
outside the tensor-parallel ones (``Draft.stage_order``: the tensor-parallel peers stay
neighbours), on which every operator that carries the sequence of the model's first
input splits along it (the embedding, the norms, the projections, the MLP, the loss), and the
attention, which needs the whole sequence, is handled by ``cp_kind``:

- ``a2a`` (DeepSpeed-Ulysses, Jacobs et al. 2023): the attention splits along its heads on the
  context-parallel axis. Where the queries, keys and values (split along the sequence) meet it,
  materialize converts one shard for another on one mesh axis: an all-to-all
  (``redistribute.plan_conversion``, the same conversion as expert parallelism's dispatch), and
  another after it back to the sequence; their gradients are all-to-alls too. The heads left on
  a tensor-parallel rank must divide by ``cp``.
- ``ring`` (ring attention, as Megatron-Core and Transformer Engine run it): the attention splits
  along its queries' sequence too, and its keys and values along theirs (``PlanBuilder.ring``), so
  no conversion meets it; its pieces pass their key/value blocks around the context-parallel
  devices, ``cp`` steps each merged by the online-softmax rule, and the backward passes the
  blocks' gradients around the ring (:mod:`planlab.executor.ring_attention`).
- ``allgather`` (as Llama 3 ran its 131,072-token stage, "The Llama 3 Herd of Models", 2024, section
  3.3.2; Transformer Engine's ``cp_comm_type="all_gather"``): split as ``ring``, but each piece
  all-gathers the keys and values of the context-parallel devices before computing its queries'
  attention (small with grouped-query attention's few key/value heads), and reduce-scatters their
  gradients in the backward; neither collective overlaps the computation (``PlanBuilder.kv_gather``).

``cp_layout`` (ring and allgather) says which tokens each ring rank holds; its default ``auto`` is ``zigzag``
where the model computes the same in that order and ``2 cp`` divides the sequence, ``contiguous``
otherwise (a mixture of experts whose capacity-limited routing counts tokens in sequence order):

- ``zigzag`` (as Megatron-Core and Llama 3 run a causal ring; Llama 3's 2 x CP chunks): the sequence is cut
  into ``2 cp`` chunks and rank ``i`` holds chunks ``i`` and ``2 cp - 1 - i`` (``PlanBuilder.zigzag``).
  The tokens are permuted so as they are loaded (the inputs, the labels, and every source along the
  sequence, such as the rotary tables, so the positions travel with their tokens:
  :mod:`planlab.plan.zigzag`), every operator but the attention treats the positions alike, and
  the attention masks each pair of a query chunk and a key chunk; under a causal mask every rank
  then computes half a block per step (``cp / 2`` blocks in all). ``2 cp`` must divide the sequence,
  and no operator but the attention may keep the sequence whole (:func:`planlab.plan.zigzag.order_dependent`):
  asked for by name where either fails, it is refused in one line naming why.
- ``contiguous``: rank ``i`` holds chunk ``i``; under a causal mask rank ``i`` computes ``i`` full
  blocks and one diagonal and skips the rest, so the ring runs at the pace of the last rank
  (``cp - 1/2`` blocks), and the cost model prices it so. Kept as a what-if.
"""

from __future__ import annotations

from planlab.graph.ir import Graph
from planlab.plan.plan import RING_DIM
from planlab.plan.zigzag import order_dependent
from planlab.search_spaces.space import Constraint, Context, Draft, Knob, Space, divisors

CP_KINDS = ("a2a", "ring", "allgather")
RING_KINDS = ("ring", "allgather")  # the kinds that split the attention's queries' sequence (PlanBuilder.ring)
# auto, the default: zigzag (Megatron-Core's for a causal ring) where the model computes the same in that order
CP_LAYOUTS = ("auto", "zigzag", "contiguous")


def sequence_length(g: Graph) -> int:
    """The sequence length of the model's first input ``(batch, seq, ...)`` (1 without one)."""
    shape = g.tensors[g.inputs[0]].shape
    return shape[1] if len(shape) > 1 else 1


def _cp_values(c: Context) -> tuple[int, ...]:
    return tuple(d for d in divisors(c.num_devices) if sequence_length(c.graph) % d == 0)


def context_parallel_dims(g: Graph, ring: bool = False) -> dict[str, str | None]:
    """Per operator, the dimension the context-parallel axis splits: the sequence of the first
    input where the operator carries it and may split it, None (replicated) elsewhere; the
    attention's heads with ``cp_kind=a2a`` (its sequence whole), its queries' sequence with
    ``ring`` (its keys and values split alike, :meth:`PlanBuilder.ring`)."""
    seq = g.labels.get((g.inputs[0], 1))
    out: dict[str, str | None] = {}
    for op in g.operators:
        if op.kind == "attention" and ring:
            out[op.name] = RING_DIM if RING_DIM in op.signature.dims() else None
            continue
        if op.kind == "attention":
            heads = op.axes_of(op.inputs[0])
            out[op.name] = heads[-3][0] if len(heads) >= 3 and heads[-3] else None
            continue
        d = g.dim_with_label(op, seq) if seq else None
        out[op.name] = d if d is not None and op.signature.splittable(d) else None
    return out


def _heads_per_tp(a: dict, c: Context) -> int:
    """The attention heads a tensor-parallel rank holds that a2a can split: its key/value heads
    (grouped-query attention reads them unrepeated, each with its group of query heads)."""
    return (getattr(c.config, "kv_heads", None) or c.heads) // (a.get("tp") or 1)


def _known(a: dict, *names: str) -> bool:
    return all(a.get(n) is not None for n in names)


def _seq_fits(a: dict, c: Context) -> bool:
    cp, n = a["cp"], sequence_length(c.graph)
    if cp is None:
        return True
    return n % cp == 0


def _seq_message(a: dict, c: Context) -> str:
    n, cp = sequence_length(c.graph), a["cp"]
    return f"cp={cp} does not divide the sequence of {n} tokens; choose cp in {', '.join(map(str, _cp_values(c)))}"


def _zigzag(a: dict) -> bool:
    """Whether the plan asks for the zigzag layout by name."""
    return (a.get("cp") or 1) > 1 and a.get("cp_kind") in RING_KINDS and a.get("cp_layout") == "zigzag"


def zigzag_layout(values: dict, c: Context) -> bool:
    """Whether a ring plan with these knob values lays its tokens out in zigzag order: asked for by
    name, or by ``auto`` where the model computes the same in that order and ``2 cp`` divides the
    sequence."""
    layout, cp = values.get("cp_layout") or "auto", values.get("cp") or 1
    if layout != "auto":
        return layout == "zigzag"
    return sequence_length(c.graph) % (2 * cp) == 0 and _ring_order_dependent(c) is None


def _zigzag_fits(a: dict, c: Context) -> bool:
    return not _known(a, "cp", "cp_kind") or not _zigzag(a) or sequence_length(c.graph) % (2 * a["cp"]) == 0


def _ring_order_dependent(c: Context) -> str | None:
    """Why the zigzag order would change what the model computes (None: it would not)."""
    g = c.graph
    rings = frozenset(op.name for op in g.operators if op.kind == "attention" and RING_DIM in op.signature.dims())
    seq = g.labels.get((g.inputs[0], 1))
    return order_dependent(g, seq, rings) if seq else "the model's first input has no sequence axis"


def _zigzag_message(a: dict, c: Context) -> str:
    n, cp = sequence_length(c.graph), a["cp"]
    fits = [str(d) for d in _cp_values(c) if n % (2 * d) == 0]
    return (
        f"cp={cp} with cp_layout=zigzag cuts the sequence of {n} tokens into {2 * cp} chunks, which do not divide "
        f"it; choose cp in {', '.join(fits) or '(none)'} or cp_layout=contiguous"
    )


class ContextParallel(Space):
    """The sequence split over ``cp`` devices (context parallelism); the attention over its heads
    with all-to-alls (``cp_kind=a2a``, DeepSpeed-Ulysses), as ring attention (``ring``) or with its keys
    and values all-gathered (``allgather``, Llama 3)."""

    name = "cp"
    order = 2  # after tp: the innermost mesh axis, its devices placed outside tp's (Megatron-Core's tp-cp-ep-dp-pp)
    knobs = (
        Knob.int(
            "cp",
            _cp_values,
            "context-parallel degree (the sequence split over cp devices; explored with --set cp=N only)",
            default=1,
            explore=(1,),  # the grid explores cp when asked: it multiplies every plan by the sequence's divisors
            range="divisors of the device count that divide the sequence",
        ),
        Knob.choice(
            "cp_kind",
            CP_KINDS,
            "context parallelism's attention: a2a (all-to-all over heads, DeepSpeed-Ulysses), ring (key/value "
            "blocks passed around, overlapped) or allgather (keys and values all-gathered first, as Llama 3)",
            default="a2a",
            explore=("a2a",),
            range=", ".join(CP_KINDS),
        ),
        Knob.choice(
            "cp_layout",
            CP_LAYOUTS,
            "ring attention's chunks: zigzag (rank i holds chunks i and 2cp-1-i, load-balanced as "
            "Megatron-Core and Llama 3), contiguous (rank i holds chunk i), or auto (zigzag where the model "
            "computes the same in that order and 2cp divides the sequence); cp_kind=ring or allgather only",
            default="auto",
            explore=("auto",),
            range=", ".join(CP_LAYOUTS),
        ),
    )
    constraints = (
        Constraint.divides("cp", "the {n} devices", lambda c: c.num_devices),
        Constraint(_zigzag_fits, _zigzag_message),
        Constraint(
            lambda a, c: not _known(a, "cp", "cp_kind") or not _zigzag(a) or _ring_order_dependent(c) is None,
            lambda a, c: (
                f"cp_layout=zigzag with cp_kind={a['cp_kind']}: {_ring_order_dependent(c)}; choose cp_layout=contiguous"
            ),
        ),
        Constraint(_seq_fits, _seq_message),
        Constraint(
            lambda a, c: not a.get("sequence_parallel") or (a.get("cp") or 1) == 1 or (a.get("tp") or 1) == 1,
            lambda a, c: (
                f"sequence_parallel=True with cp={a['cp']} and tp={a['tp']}: the sequence would be split by cp "
                "outside and by tp inside, which planlab converts only by point-to-point copies; choose "
                "sequence_parallel=False"
            ),
        ),
        Constraint(
            lambda a, c: a.get("schedule") != "dualpipe" or (a.get("cp") or 1) == 1 or (a.get("tp") or 1) == 1,
            lambda a, c: (
                f"cp={a['cp']} and tp={a['tp']} with schedule=dualpipe: the mirrored halves of a stage and the "
                "context-parallel placement inside the tensor-parallel one do not compose yet; choose cp=1, tp=1 "
                "or another schedule"
            ),
        ),
        Constraint(
            lambda a, c: (
                not _known(a, "cp", "tp", "cp_kind") or a["cp_kind"] != "a2a" or _heads_per_tp(a, c) % a["cp"] == 0
            ),
            lambda a, c: (
                f"cp={a['cp']} with cp_kind=a2a splits the {_heads_per_tp(a, c)} key/value heads of a "
                f"tensor-parallel rank (tp={a.get('tp') or 1}), which it does not divide; choose cp in "
                + ", ".join(str(d) for d in divisors(_heads_per_tp(a, c)))
                + " or cp_kind=ring or allgather"
            ),
        ),
    )

    def apply(self, draft: Draft, values: dict) -> None:
        cp = values.get("cp") or 1
        if cp == 1:  # no mesh axis of one device: plans without cp stay as they were written before it
            return
        ring = values.get("cp_kind") in RING_KINDS
        dims = context_parallel_dims(draft.ctx.graph, ring)
        draft.add_axis("cp", cp, dims)
        if ring:
            draft.ring = frozenset(
                op.name for op in draft.ctx.graph.operators if op.kind == "attention" and dims[op.name]
            )
            draft.zigzag = bool(draft.ring) and zigzag_layout(values, draft.ctx)
            draft.kv_gather = bool(draft.ring) and values.get("cp_kind") == "allgather"
        tp = draft.axes[-2][1] if len(draft.axes) > 1 and draft.axes[-2][0] == "tp" else 1
        if cp > 1 and tp > 1:
            draft.stage_order = outside_order(draft.per_stage // (cp * tp), tp, cp)


def outside_order(outer: int, tp: int, cp: int) -> tuple[int, ...]:
    """The device of each mesh position ``(o, t, c)`` of a stage whose last two mesh axes are the
    tensor-parallel (``tp``) and the context-parallel (``cp``) ones: ``o cp tp + c tp + t``, so
    that the tensor-parallel peers stay neighbours (inside a node) while the attention's heads,
    split over both axes, are split by tp first and by cp inside (the all-to-all then moves whole
    blocks: ``redistribute``'s innermost rule)."""
    per = cp * tp
    return tuple(o * per + c * tp + t for o in range(outer) for t in range(tp) for c in range(cp))
