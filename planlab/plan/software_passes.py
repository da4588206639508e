"""A plan's Program as its training software runs it: ``materialize`` with the software's
precision, gradient reduction and ZeRO-3 behaviour, then the passes the software applies to the
Program (pure functions from Program to Program):

- :func:`~planlab.plan.expert_dispatch.dedup_expert_dispatch`: the expert all-to-alls send a token
  once to each node (the software's ``expert_dispatch`` is ``"node_dedup"``: DeepEP, HybridEP);
- :func:`~planlab.plan.expert_dispatch.fuse_token_permutation`: the routing's element-wise and layout
  operators inside the fused permutation kernels (the software's ``fused_permute``);
- :func:`partition_pipeline_messages`: Megatron-LM's scatter/gather and DeepSpeed's
  ``pipe_partitioned`` (the software's ``pipeline_messages`` is ``"partitioned"``).

:func:`build_program` is what ``planlab explore``, ``simulate`` and the validation scripts call.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import TYPE_CHECKING

from planlab.graph.ir import Graph
from planlab.plan.expert_dispatch import dedup_expert_dispatch, fuse_token_permutation
from planlab.plan.materialize import materialize
from planlab.plan.plan import Plan
from planlab.plan.program import Program, Task, TaskKind

if TYPE_CHECKING:
    from planlab.costmodel import CostModel
    from planlab.costmodel.software import SoftwareSpec


def build_program(plan: Plan, graph: Graph, cost: CostModel, *, symmetric: bool = True) -> Program:
    """The Program of ``plan`` as ``cost``'s software runs it, in its precision (reduced to device
    classes with ``symmetric``)."""
    program = materialize(
        plan,
        graph,
        precision=cost.precision,
        software=cost.software,
        symmetric=symmetric,
        node_of=cost.cluster.node_of,
    )
    if cost.software.expert_dispatch == "node_dedup":  # what the expert all-to-alls send across nodes
        program = dedup_expert_dispatch(program, graph, cost.cluster.node_of)
    if cost.software.fused_permute:  # the routing's copies inside the permutation kernels
        program = fuse_token_permutation(program, graph)
    return apply_software(program, plan, cost.software)


# the knobs of a plan that its Program depends on (read by apply_software); its other knobs and its
# space's name only label it (materialize reads neither)
PRICED_KNOBS = ("tp", "sequence_parallel")


def priced_identity(plan: Plan) -> Plan:
    """``plan`` without what only labels it: its space's name and the knobs outside ``PRICED_KNOBS``.
    Two plans with the same identity build the same Program (:mod:`planlab.memo` keys rows by it)."""
    return replace(plan, space="", knobs=tuple((k, v) for k, v in plan.knobs if k in PRICED_KNOBS))


def apply_software(program: Program, plan: Plan, software: SoftwareSpec) -> Program:
    """The software's passes on a materialized Program of ``plan`` (they read its ``PRICED_KNOBS`` only)."""
    knobs = dict(priced_identity(plan).knobs)
    tp = int(knobs.get("tp") or 1)
    if software.pipeline_messages == "partitioned" and tp > 1 and not knobs.get("sequence_parallel"):
        program = partition_pipeline_messages(program, tp)
    return program


def partition_pipeline_messages(program: Program, tp: int) -> Program:
    """Each activation and gradient sent between pipeline stages travels in ``tp`` parts, one
    per tensor-parallel rank, and the receiving tensor-parallel group all-gathers it over its
    links (Megatron-LM's scatter/gather, Narayanan et al. 2021 section 4.1; DeepSpeed's
    ``pipe_partitioned``). planlab's conversions send the whole tensor from each replica: here
    every message carries a ``tp``-th and each receive is followed by an all-gather of the whole
    over the receiver's tensor-parallel group, the ``tp`` consecutive devices the ``tp`` space
    places a tensor-parallel group on. With sequence parallelism the messages are already a
    sequence shard: this pass does not apply. Nor where a receive lacks its twin on a member of
    the receiver's group (a plan whose groups are not laid out so): its all-gather could not meet.
    The k-th all-gather of a block is one collective on every member of the group: its identity."""
    if tp == 1 or not _groups_receive_alike(program, tp):
        return program
    first = 1 + max((t.ident for dp in program.devices for b in dp.blocks.values() for t in b.tasks), default=-1)
    idents: dict[tuple, int] = {}
    devices = []
    for dp in program.devices:
        group = tuple(range(dp.device - dp.device % tp, dp.device - dp.device % tp + tp))
        blocks = {
            key: replace(block, tasks=_partitioned(block.tasks, tp, group, key, first, idents))
            for key, block in dp.blocks.items()
        }
        devices.append(replace(dp, blocks=blocks))
    return replace(program, devices=tuple(devices))


def _groups_receive_alike(program: Program, tp: int) -> bool:
    """Whether every member of each device's tensor-parallel group receives the same messages, each
    from its counterpart (the sender at its tensor-parallel rank: a pipeline message, not a piece of
    an exchange between every device): the same pieces of the same buffers, whatever their tags
    (each message has its own); in a Program reduced to device classes, the members share a class
    (their programs agree up to their peers)."""

    def receives(d: int) -> Counter:
        dp = program.device(d)
        return Counter(
            (key, t.name.rstrip("0123456789"), t.nbytes, t.region)
            for key, b in dp.blocks.items()
            for t in b.tasks
            if t.kind is TaskKind.RECV
        )

    for dp in program.devices:
        base = dp.device - dp.device % tp
        if base + tp > program.num_devices:
            return False
        group = range(base, base + tp)
        if program.reduced and any(program.classes[m] != program.classes[dp.device] for m in group):
            return False
        if any(t.peer % tp != dp.device % tp for b in dp.blocks.values() for t in b.tasks if t.kind is TaskKind.RECV):
            return False
        mine = receives(dp.device)
        if any(receives(m) != mine for m in group):
            return False
    return True


def _partitioned(
    tasks: tuple[Task, ...], tp: int, group: tuple[int, ...], key: tuple, first: int, idents: dict[tuple, int]
) -> tuple[Task, ...]:
    """One block's tasks with its messages in ``tp`` parts, each receive followed by its all-gather
    (the block's k-th has identity ``idents[(key, k)]``, numbered from ``first``)."""
    out = []
    gathers = 0
    for t in tasks:
        if t.kind not in (TaskKind.SEND, TaskKind.RECV) or t.nbytes < tp:
            out.append(t)
            continue
        out.append(t.but(nbytes=t.nbytes // tp))
        if t.kind is TaskKind.RECV:
            ident = idents.setdefault((key, gathers), first + len(idents))
            gathers += 1
            buf = t.writes[0] if t.writes else None
            gather = Task(
                f"{t.name}:gather",
                TaskKind.COLLECTIVE,
                (buf,),
                (buf,),
                collective="all_gather",
                group=group,
                nbytes=t.nbytes,
                ident=ident,
            )
            out.append(gather)
    return tuple(out)
