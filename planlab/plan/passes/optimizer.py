"""The optimizer step on the weights each device holds whole (ZeRO's shards step in
:mod:`planlab.plan.zero`)."""

from __future__ import annotations

from collections import Counter

from planlab.costmodel.software import Fusion
from planlab.plan.fused_gemms import fused_groups
from planlab.plan.layout import box_numel
from planlab.plan.passes.draft import Draft, Part, add, update_blocks
from planlab.plan.program import ADAM_FLOPS_PER_PARAM, Task, TaskKind


def merged_tensors(d: Draft, held: list[tuple[str, tuple]]) -> tuple[tuple[Fusion, int], ...]:
    """Per fusion, how many of the weight pieces ``held`` (a device's, stepped whole) a software that runs
    the fusion's projections as one GEMM keeps inside another's tensor: the projections of one group
    (:func:`planlab.plan.fused_gemms.fused_groups`) that read their weights (or their biases) at the same
    input are one tensor there, as Megatron-LM's ``query_key_value`` (``ColumnParallelLinear`` of
    ``3 * projection_size``, one weight and one bias) holds what the graph keeps as the query's, key's and
    value's; a group of ``n`` pieces at one input merges ``n - 1``."""
    groups = fused_groups(d.graph)
    found: Counter = Counter()
    for p, _ in held:
        op, index = d.owner.get(p, (None, -1))
        group = groups.get(op.name) if op is not None else None
        if group is not None:
            found[(group.fusion, group.ops, index)] += 1
    merged: Counter = Counter()
    for (fusion, _, _), n in found.items():
        merged[fusion] += n - 1
    return tuple((f, n) for f, n in sorted(merged.items()) if n)


def step_optimizer(d: Draft) -> Draft:
    """Per device, one Adam step on its pieces of the weights not kept in ZeRO shards (the update
    block's ``STEP``): it reads the weights and their gradients and writes the weights; its work is
    :data:`~planlab.plan.program.ADAM_FLOPS_PER_PARAM` flops and the weights', gradients' and
    optimizer states' traffic per parameter."""
    parts = dict(d.parts)
    pr = d.precision
    for dev, update in sorted(update_blocks(d).items()):
        sharded = d.sharded.get(dev, frozenset())
        rest = [(p, b) for p, b in d.params.get(dev, ()) if p not in sharded]
        nparams = sum(box_numel(b) for _, b in rest)
        if not nparams:
            continue
        w = tuple(d.names.weight(p) for p, _ in rest)
        g = tuple(d.names.weight_grad(p) for p, _ in rest)
        add(
            parts,
            dev,
            update,
            0,
            Part.STEP,
            Task(
                "optimizer",
                TaskKind.OPTIMIZER,
                w + g,
                w,
                flops=ADAM_FLOPS_PER_PARAM * nparams,
                bytes_moved=nparams * (2 * pr.param_bytes + pr.grad_bytes + 2 * pr.optimizer_bytes),
                params=float(nparams),
                merged_tensors=merged_tensors(d, rest),  # Megatron's fused query_key_value: fewer tensors
            ),
        )
    return d.replace(parts=parts)
