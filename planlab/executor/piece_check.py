"""A forward piece's outputs against the shapes its task expects (:attr:`Task.shapes`: the piece's
inputs, then its outputs, per micro-batch), so that a size fixed at trace time (a factory at the
whole batch under micro-batching, say) fails at the first wrong shape, naming the operator, instead
of as a wrong result or an error downstream."""

from __future__ import annotations

import torch

from planlab.errors import PieceShapeError
from planlab.graph.ir import Operator
from planlab.plan.program import Task


def check_piece_shapes(op: Operator, task: Task, out) -> None:
    """Raise :class:`~planlab.errors.PieceShapeError` when a tensor output of the piece ``task`` of
    ``op`` has another shape than the task's; a task without shapes (made by hand) is not checked."""
    outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    expected = task.shapes[len(op.inputs) :]
    if len(task.shapes) != len(op.inputs) + len(op.outputs):
        return
    if len(outs) != len(expected):  # ``x.split(4)`` on fewer rows than traced
        raise PieceShapeError(
            f"operator {op.name!r} ({op.kind}), task {task.name}: {len(outs)} outputs, the plan expects {len(expected)}"
        )
    for k, (o, want) in enumerate(zip(outs, expected)):
        if isinstance(o, torch.Tensor) and tuple(o.shape) != tuple(want):
            raise PieceShapeError(
                f"operator {op.name!r} ({op.kind}), task {task.name}: output {k} has shape {tuple(o.shape)}, "
                f"the plan expects {tuple(want)}"
            )
