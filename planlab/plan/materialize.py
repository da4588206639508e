"""``materialize``: from a Plan to a Program of per-device tasks, by a fixed sequence of passes.

The passes (:data:`PASSES`, applied by :func:`build`), in this order, each a function from the
Program under construction (a :class:`~planlab.plan.passes.draft.Draft`) to a new one:

1. ``place_weights``: each device's pieces of each parameter, and the operator whose backward makes
   each parameter's gradient (:mod:`planlab.plan.passes.forward`);
2. ``convert_inputs``: the layout conversions that bring each operator its inputs in the layout
   it needs (collectives, copies, sends and receives; loads of model inputs);
3. ``forward_pieces``: one forward task per piece of every operator;
4. ``convert_gradients``: the gradients of each operator's outputs, its consumers' contributions
   summed and converted back into the layout it made them in (:mod:`planlab.plan.passes.backward`);
5. ``backward_pieces``: one backward task per piece;
6. ``recompute``: recompute groups run their forward again before their backward
   (:mod:`planlab.plan.passes.recompute`);
6b. ``offload_activations``: the saved activations of offloaded groups copied to the host after
   their forward and back ahead of their backward (:mod:`planlab.plan.passes.act_offload`);
7. ``reduce_gradients``: without ZeRO, the weight gradients' all-reduces, in buckets overlapped
   with the backward (:mod:`planlab.plan.passes.gradients`);
8. ``shard_zero``: ZeRO stages 1 to 3 (:mod:`planlab.plan.zero`);
9. ``step_optimizer``: the optimizer step on the weights held whole
   (:mod:`planlab.plan.passes.optimizer`);
10. ``offload_optimizer``: with ZeRO-Offload, each optimizer step on the host CPU, its gradients
    copied to the host and its weights back (:mod:`planlab.plan.passes.offload`);
11. ``order_blocks``: each block's tasks in the order they run (:mod:`planlab.plan.passes.order`);
12. ``run_chunks``: a device's co-located pieces of an operator run as chunks
    (:mod:`planlab.plan.coshard`);
13. ``split_zero_bubble``: where the schedule asks for it, each backward block split into
    input- and weight-gradient blocks ``I`` and ``W`` (:mod:`planlab.plan.backward_split`);
and then ``assemble``: schedules, liveness (each task's allocations and frees) and the Program
(:mod:`planlab.plan.passes.liveness`).

The conversions come before the pieces that read them (2, 3; 4, 5): a piece names the buffers
its inputs arrive in. Passes 1 to 9 place tasks in each operator's slot of a block, in named
parts (:class:`~planlab.plan.passes.draft.Part`: ZeRO-3's prefetches, the recomputation, the
conversions, the piece, the reductions it completes), pass 10 rewrites the update's steps; pass 11 writes each block out in the order
it runs (operators in topological order forward, in reverse backward; parts in that order), and
the later passes work on the ordered lists.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from planlab.costmodel.software import SoftwareSpec
from planlab.gcpause import paused_gc
from planlab.graph.ir import Graph
from planlab.plan.backward_split import split_zero_bubble
from planlab.plan.coshard import run_chunks
from planlab.plan.passes.act_offload import offload_activations
from planlab.plan.passes.backward import backward_pieces, convert_gradients
from planlab.plan.passes.draft import Draft
from planlab.plan.passes.forward import convert_inputs, forward_pieces, place_weights
from planlab.plan.passes.gradients import reduce_gradients
from planlab.plan.passes.layouts import Layouts
from planlab.plan.passes.offload import offload_optimizer
from planlab.plan.passes.liveness import assemble, assemble_bare
from planlab.plan.passes.optimizer import step_optimizer
from planlab.plan.passes.order import order_blocks
from planlab.plan.passes.recompute import recompute
from planlab.plan.plan import Plan
from planlab.plan.program import FP32, MIXED_BF16, Precision, Program
from planlab.plan.zero import shard_zero


def precision_for(cluster: str) -> Precision:
    """fp32 on the CPU cluster, bf16 mixed precision on GPUs."""
    return FP32 if cluster == "cpu" else MIXED_BF16


def trace_plan_model(plan: Plan) -> Graph:
    """Trace the plan's model at the plan's global batch on meta tensors."""
    from planlab.graph.trace import trace
    from planlab.models.registry import build_model

    model, inputs = build_model(plan.model, batch=plan.global_batch)
    return trace(model, inputs)


def materialize(
    plan: Plan,
    graph: Graph | None = None,
    *,
    precision: Precision | None = None,
    symmetric: bool = False,
    node_of: Callable[[int], int] | None = None,
    overlap_grad_reduce: bool = True,
    software: SoftwareSpec | None = None,
) -> Program:
    """Turn ``plan`` into a Program (see the module docstring for the passes).

    With ``symmetric``, devices are first grouped into classes from the plan alone
    (:mod:`planlab.plan.symmetry`) and tasks are built for one representative of
    each class (and one more member, to check the classes): the reduced Program
    the simulator runs at cluster scale. ``node_of`` maps a device to its node
    (default: the plan's cluster). Raises InfeasiblePlan naming the operator or
    value when the plan cannot be realised (an operator left unplaced, a split
    that does not divide, a bad schedule). ``overlap_grad_reduce=False`` reduces the
    weight gradients without buckets: one all-reduce per group after the backward, in the
    update block (DeepSpeed without gradient bucketing), instead of buckets overlapped with it.
    A ``software`` (:class:`~planlab.costmodel.software.SoftwareSpec`) decides that instead (its
    ``grad_reduce``), the bucket size, what operators keep for the backward
    (:mod:`planlab.plan.saved`) and how ZeRO-3 gathers (its ``zero3_*`` fields).
    """
    graph = graph if graph is not None else trace_plan_model(plan)
    with paused_gc():
        return _materialize(
            plan,
            graph,
            precision or precision_for(plan.cluster),
            symmetric,
            node_of,
            overlap_grad_reduce if software is None else software.grad_reduce == "overlapped",
            software,
        )


def _materialize(
    plan: Plan,
    graph: Graph,
    precision: Precision,
    symmetric: bool,
    node_of: Callable[[int], int] | None,
    overlap: bool = True,
    software: SoftwareSpec | None = None,
) -> Program:
    L = Layouts(plan, graph)
    if symmetric and plan.num_devices > 1:
        from planlab.plan.symmetry import plan_classes, reduce_program

        if node_of is None:
            from planlab.costmodel import load_cluster

            node_of = load_cluster(plan.cluster, plan.nodes).node_of
        classes = plan_classes(plan, L.mesh.values(), node_of)
        reps = sorted(set(classes))
        if len(reps) < plan.num_devices:
            witnesses = {}
            for d, c in enumerate(classes):
                if d != c:
                    witnesses[c] = d  # the last member of each class
            keep = frozenset(reps) | frozenset(witnesses.values())
            start = Draft.start(plan, graph, L, precision, keep=keep, overlap=overlap, software=software)
            # the witnesses are compared and dropped: their tasks keep no allocations and frees
            program, lives = assemble_bare(run_passes(start), frozenset(witnesses.values()))
            reduced = reduce_program(program, classes, witnesses, node_of, lives)
            if reduced is not None:
                return reduced
    return build(plan, graph, L, precision, None, overlap, software)


# The passes, in the order they run (see the module docstring); each takes a Draft and returns
# a new one, and each reads what the ones before it made.
PASSES = (
    place_weights,  # 1. weight pieces and the owner of each parameter's gradient
    convert_inputs,  # 2. layout conversions of the forward's inputs
    forward_pieces,  # 3. forward tasks
    convert_gradients,  # 4. gradients summed and converted back to their producers' layouts
    backward_pieces,  # 5. backward tasks
    recompute,  # 6. recomputation before the backward
    offload_activations,  # 6b. activation offload: saved activations to the host and back
    reduce_gradients,  # 7. gradient buckets (without ZeRO)
    shard_zero,  # 8. ZeRO 1 to 3
    step_optimizer,  # 9. the optimizer on the weights held whole
    offload_optimizer,  # 10. ZeRO-Offload: the steps on the host CPU, with their copies
    order_blocks,  # 11. each block's tasks in the order they run
    run_chunks,  # 12. co-located pieces as chunks (coshard)
    split_zero_bubble,  # 13. backward split into I and W (zero-bubble schedules)
)


# The passes before ``recompute`` read neither a plan's recompute groups nor its ZeRO stage, so plans
# that differ only there (an exploration's twins: zero 1 and 2, recompute none and selective) share
# the draft they make (see shared_passes).
SHARED = PASSES.index(recompute)
SHARED_MEMO_KEY = ("materialize: the last shared draft",)


def build(
    plan: Plan,
    graph: Graph,
    layouts: Layouts,
    precision: Precision,
    keep: frozenset[int] | None,
    overlap: bool = True,
    software: SoftwareSpec | None = None,
) -> Program:
    """The passes (see the module docstring), for every device or only for those in ``keep``."""
    return assemble(
        run_passes(Draft.start(plan, graph, layouts, precision, keep=keep, overlap=overlap, software=software))
    )


def run_passes(start: Draft) -> Draft:
    """The draft after every pass of :data:`PASSES`, from the draft before any (``Draft.start``);
    ``assemble`` then makes it a Program (schedules, liveness)."""
    d = shared_passes(start)
    for apply in PASSES[SHARED:]:
        d = apply(d)
    return d


def shared_passes(start: Draft) -> Draft:
    """The draft after the first ``SHARED`` passes, from the draft before any (``Draft.start``). The
    graph's memo keeps the last one made, with what it was made from; a plan that differs from that
    one only by its recompute groups, ZeRO stage or labels (its space and knobs) takes it (with its
    own plan and layouts for the passes after), as the same passes would make it again. Passes leave
    the draft they are given as it was (``tests/test_materialize.py``), so two builds can share it."""
    key = (_shared_part(start.plan), start.precision, start.keep, start.overlap, start.software)
    last = start.graph.memo(SHARED_MEMO_KEY, lambda: [None])  # [(key, draft)]
    got = last[0]
    if got is not None and got[0] == key:
        return got[1].replace(plan=start.plan, layouts=start.layouts)
    d = start
    for apply in PASSES[:SHARED]:
        d = apply(d)
    last[0] = (key, d)
    return d


def _shared_part(plan: Plan) -> Plan:
    """``plan`` without what the first ``SHARED`` passes do not read: recompute groups, the ZeRO
    stage, its space's name and its knobs."""
    ops = tuple(replace(op, recompute=0) if op.recompute else op for op in plan.ops)
    return replace(plan, ops=ops, zero=0, space="", knobs=())
