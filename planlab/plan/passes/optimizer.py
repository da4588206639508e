"""The optimizer step on the weights each device holds whole (ZeRO's shards step in
:mod:`planlab.plan.zero`)."""

from __future__ import annotations

from planlab.plan.layout import box_numel
from planlab.plan.passes.draft import Draft, Part, add, update_blocks
from planlab.plan.program import ADAM_FLOPS_PER_PARAM, Task, TaskKind


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
            ),
        )
    return d.replace(parts=parts)
