"""A forward piece whose output has another shape than its task's fails there, naming the operator
(``planlab.executor.piece_check``), instead of as a wrong result or an error further on."""

import re

import pytest
import torch
from conftest import traced

from planlab.errors import PieceShapeError
from planlab.executor import run_piece
from planlab.plan.program import Task, TaskKind


def test_a_piece_of_another_shape_than_its_task_names_the_operator():
    _, g = traced("gpt-tiny", 8)
    op = next(o for o in g.operators if o.kind == "linear")
    ins = [torch.randn(g.tensors[t].shape) for t in op.inputs]
    shapes = tuple(tuple(g.tensors[t].shape) for t in op.inputs)
    want = tuple(g.tensors[op.outputs[0]].shape)
    assert run_piece(op, Task(op.name, TaskKind.FORWARD, shapes=shapes + (want,)), ins, g, 1).shape == want
    half = (want[0] // 2, *want[1:])  # a micro-batch's rows, as a plan with 2 micro-batches expects
    with pytest.raises(
        PieceShapeError,
        match=re.escape(
            f"operator {op.name!r} (linear), task {op.name}: output 0 has shape {want}, the plan expects {half}"
        ),
    ):
        run_piece(op, Task(op.name, TaskKind.FORWARD, shapes=shapes + (half,)), ins, g, 1)
