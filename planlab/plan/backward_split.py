"""Zero-bubble's split backward (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): a
stage's backward block becomes an input-gradient block ``I`` and a weight-gradient block ``W``,
the phases of torch.distributed.pipelining's ``_ComputationType``; the ``materialize`` pass
:func:`split_zero_bubble`, after co-located pieces are chunked.

``I`` holds everything the backward does for the inputs' gradients: the receives of the output
gradients, each operator's backward for its inputs, the sums and the sends upstream, and the
recomputation of recomputed layers. ``W`` holds the weight-gradient products (linear layers,
matmuls, einsums, convolutions: :data:`PRODUCT_KINDS`), the backward of operators with no input
gradient (an embedding), and the reductions of the weight gradients (gradient buckets, ZeRO-3's
reduce-scatters), which so fire after the last micro-batch's ``W`` that completes them. A product
with both kinds of gradient has a task in each: the executor's ``I`` task keeps the piece's
autograd graph, which its ``W`` task uses and frees, so the product's saved input and its output
gradient live until ``W``. Other operators (layer norms) compute their weight gradients in ``I``
(:func:`weight_share`).

Under FP8 training with Transformer Engine (the precision's ``linear_input_bytes``) the weight-gradient
GEMM of a linear layer (or of a product with a weight) reads the FP8 cast of its output gradient
that the input-gradient GEMM made, and a deferred ``W`` keeps that cast, not the 16-bit gradient:
TE's ``_Linear.backward`` puts ``[inputmat_total, grad_output]`` in its ``wgrad_store`` when
``delay_wgrad_compute()``, ``grad_output`` being the quantized tensor of ``grad_output_preprocess``
(Megatron-Core's ``--delay-wgrad-compute``); DeepSeek-V3's report (section 3.3, Figure 6) runs
Wgrad on the FP8 output gradient. The ``I`` task makes the cast (:func:`planlab.plan.saved.fp8_cast`
of each output gradient it reads, kept in its ``saved`` and allocated there) and the ``W`` task
keeps it instead of reading the gradient, which is freed after ``I``.

With recomputation the inputs ``W`` keeps are the recomputed ones: a micro-batch between its
``I`` and its ``W`` holds, for every layer of the stage, each product's input and output gradient,
about as much as a layer keeps without recomputation (Qi et al.'s ``M_W = 32 b s h`` against
``M_B = 34 b s h + 5 a s^2 b``), where 1F1B keeps only the layer inputs. So ZB-H1 with full
recomputation peaks above 1F1B, higher on later stages, which owe more ``W`` passes (see
docs/spaces.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from planlab.graph.ir import Graph
from planlab.plan.buffer import WEIGHT_GRAD_KINDS
from planlab.plan.passes.draft import Draft
from planlab.plan.plan import Action
from planlab.plan.program import Role, Task, TaskKind
from planlab.plan.saved import cast_inputs, fp8_cast

if TYPE_CHECKING:
    from planlab.costmodel.precision import Precision

# operators whose weight gradient is one product as large as the forward (dW = dY^T X)
PRODUCT_KINDS = ("linear", "matmul", "einsum", "conv")


def split_stages(schedule: Iterable[Action]) -> set[int]:
    """The stages whose backward ``schedule`` runs as ``I`` and ``W`` actions."""
    return {a.stage for a in schedule if a.phase in ("I", "W")}


def weight_share(kind: str, weights: int, inputs: int) -> float:
    """The part of a backward's work that ``W`` does: one half for products (the input gradient
    is a product of the same size), all of it for an operator without input gradients (an
    embedding), else none. Only products defer their weight gradients: a layer norm's are a
    reduction beside its input gradient, and the implementations compute them in ``I`` (the
    paper's Megatron-LM fork queues only linear layers' weight GEMMs, with their saved input and
    output gradient, in its ``WeightGradStore``), so ``W`` keeps no more than each product's input
    and output gradient alive."""
    if not weights:
        return 0.0
    if not inputs:
        return 1.0
    return 0.5 if kind in PRODUCT_KINDS else 0.0


def split_task(task: Task, kind: str, cast: bool = False) -> tuple[Task | None, Task | None]:
    """A backward task as its ``I`` and ``W`` parts (None where there is nothing to compute). An
    ``I`` part whose ``W`` part follows keeps the piece's autograd graph for it (``Role.KEEP_GRAPH``);
    with ``cast`` (an FP8 weight-gradient GEMM) its ``W`` part keeps the FP8 casts of the output
    gradients the ``I`` part made instead of reading the gradients (module docstring)."""
    is_w = [w is not None and w.kind in WEIGHT_GRAD_KINDS for w in task.writes]
    is_i = [bool(w) and not x for w, x in zip(task.writes, is_w)]
    share = weight_share(kind, sum(is_w), sum(is_i))
    if share == 0.0:
        return task, None
    if share == 1.0:
        return None, task
    casts = tuple(fp8_cast(g) for g in task.reads if g) if cast else ()
    inp = task.but(
        writes=tuple(w if i else None for w, i in zip(task.writes, is_i)),
        flops=task.flops * (1 - share),
        bytes_moved=task.bytes_moved * (1 - share),
        role=Role.KEEP_GRAPH,
        saved=task.saved + casts,
    )
    wgt = task.but(
        writes=tuple(w if x else None for w, x in zip(task.writes, is_w)),
        flops=task.flops * share,
        bytes_moved=task.bytes_moved * share,
        reads=tuple(None for _ in task.reads) if casts else task.reads,
        saved=task.saved + casts,
    )
    return inp, wgt


def split_zero_bubble(d: Draft) -> Draft:
    """On every device whose schedule has ``I`` and ``W`` actions, the backward blocks of those
    stages split (:func:`split_backward`)."""
    blocks, sizes = d.copy_blocks(), d.copy_sizes()
    cast = fp8_weight_grads(d.graph, d.precision)
    for dev, mine in blocks.items():
        given = d.plan.schedule[dev] if d.plan.schedule and dev < len(d.plan.schedule) else ()
        if any(a.phase in ("I", "W") for a in given):
            split_backward(mine, split_stages(given), d.graph, cast)
            _size_casts(mine, cast, sizes.setdefault(dev, {}), d.precision)
    return d.replace(blocks=blocks, sizes=sizes)


def _size_casts(blocks: dict, cast: frozenset[str], own: dict, precision: Precision) -> None:
    """Give ``own`` (a device's buffer bytes) the FP8 casts of the output gradients that the ``I``
    tasks of ``cast`` operators make for their ``W`` (module docstring), in place."""
    keep = [t for k, ts in blocks.items() if k[1] == "I" for t in ts if t.role is Role.KEEP_GRAPH and t.op in cast]
    for g in (g for t in keep for g in t.reads if g and g in own):
        own[fp8_cast(g)] = own[g] * precision.linear_input_bytes // precision.activation_bytes


def fp8_weight_grads(graph: Graph, precision: Precision) -> frozenset[str]:
    """The operators whose weight-gradient GEMM reads the FP8 cast of their output gradient (module
    docstring): under a precision with ``linear_input_bytes``, those that keep their inputs' casts."""
    if not precision.linear_input_bytes:
        return frozenset()
    return frozenset(op.name for op in graph.operators if cast_inputs(op, graph, precision))


def split_backward(
    blocks: dict[tuple[int, str], list[Task]], stages: set[int], graph: Graph, cast: frozenset[str] = frozenset()
) -> None:
    """Replace the ``(stage, "B")`` blocks (task lists) of ``stages`` by ``I`` and ``W`` blocks (in
    place); each task keeps its place in the backward order. ``W`` gets each backward task's
    weight-gradient part and the overlapped reductions of weight gradients, ``I`` the rest."""
    for st in sorted(stages):
        items = blocks.pop((st, "B"), None)
        if items is None:
            continue
        inp, wgt = blocks.setdefault((st, "I"), []), blocks.setdefault((st, "W"), [])
        for t in items:
            if t.kind is TaskKind.BACKWARD:
                i, w = split_task(t, graph.op(t.op).kind, t.op in cast)
                if i is not None:
                    inp.append(i)
                if w is not None:
                    wgt.append(w)
            elif t.kind is TaskKind.COLLECTIVE and t.overlap and any(r.kind in WEIGHT_GRAD_KINDS for r in t.reads if r):
                wgt.append(t)
            else:
                inp.append(t)
