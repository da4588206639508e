"""Sizes fixed when the model was traced: a forward piece whose output has another shape (or count)
than its task's fails there, naming the operator (``planlab.executor.piece_check``), and a plan of
several micro-batches is refused where an operator reads the batch axis as a dimension it cannot
split (``planlab.plan.passes.layouts.whole_batch_read``)."""

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import traced

from planlab.errors import InfeasiblePlan, PieceShapeError
from planlab.executor import run_piece
from planlab.graph import trace
from planlab.models import ModelSpec, build_model
from planlab.plan import PlanBuilder, materialize
from planlab.plan.program import Task, TaskKind

HERE = __name__


class BatchSizes(nn.Module):
    """Sizes along the batch axis taken at the traced batch: ``split`` or ``narrow`` on axis 0."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.a, self.head = how, nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.how == "split":
            first, second = h.split(x.shape[0] // 2, dim=0)
            h = torch.cat([second, first], 0)
        else:
            h = h + h.narrow(0, 0, x.shape[0])
        return F.cross_entropy(self.head(h), y)


def batch_split():
    return BatchSizes("split"), (torch.randn(4, 8), torch.randint(0, 3, (4,)))


def batch_narrow():
    return BatchSizes("narrow"), (torch.randn(4, 8), torch.randint(0, 3, (4,)))


def _plan(name: str, microbatches: int):
    spec = ModelSpec(f"{HERE}:{name}")
    g = trace(*build_model(spec, batch=8))
    b = PlanBuilder(g, model=spec, global_batch=8, cluster="cpu", nodes=1, num_devices=1)
    b.microbatch(microbatches)
    for op in g.operators:
        b.op_assign(op.name, [0])
    return b.build(), g


@pytest.mark.parametrize("name, op, kind", [("batch_split", "split", "split"), ("batch_narrow", "narrow", "opaque")])
def test_a_batch_axis_an_operator_cannot_split_refuses_micro_batches(name, op, kind):
    plan, g = _plan(name, 1)
    materialize(plan, g)  # one micro-batch: the sizes are the traced ones
    plan, g = _plan(name, 2)
    with pytest.raises(
        InfeasiblePlan, match=rf"operator '{op}' \({kind}\) reads the batch axis 0 of .* 2 micro-batches"
    ):
        materialize(plan, g)


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


def test_a_piece_with_fewer_outputs_than_its_task_names_the_operator():
    _, g = _plan("batch_split", 1)
    op = next(o for o in g.operators if o.kind == "split")  # x.split(4, dim=0), traced on 8 rows: 2 outputs
    x = torch.randn(4, 16)  # a micro-batch's 4 rows: 1 output
    shapes = ((4, 16), (2, 16), (2, 16))
    with pytest.raises(
        PieceShapeError, match=re.escape("operator 'split' (split), task split: 1 outputs, the plan expects 2")
    ):
        run_piece(op, Task(op.name, TaskKind.FORWARD, shapes=shapes), [x], g, 1)
