"""Megatron-LM's vocabulary-parallel embedding, output layer and loss, run by the executor.

``planlab.validation``'s GPT (the model of vTrain's measured runs) splits its embedding table, its
output layer and its loss along the vocabulary over the tensor-parallel group; each piece of the
loss agrees with the others on each token's log-sum-exp through its group
(``planlab.executor.vocab_parallel``). On 2 gloo ranks the plan's loss and gradients match one
process, and the loss's pieces carry their group in the Program and pay for it in the simulator."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from planlab.executor import launch_local
from planlab.plan import materialize
from planlab.plan.program import TaskKind
from planlab.validation import MeasuredRun, megatron_plan

LOSS_TOL, GRAD_TOL = 1e-4, 1e-4


def _plan(tp: int, dp: int = 1, micro_batch: int = 4, global_batch: int = 4):
    from planlab.graph.trace import trace
    from planlab.models.registry import ModelSpec, build_model

    run = MeasuredRun(
        gpus=tp * dp,
        global_batch=global_batch,
        micro_batch=micro_batch,
        hidden=32,
        heads=4,
        layers=2,
        seq=16,
        tp=tp,
        dp=dp,
        pp=1,
        measured_s=0.0,
    )
    spec = ModelSpec(
        "planlab.validation:megatron_gpt",
        (("dropout", 0.0), ("heads", 4), ("hidden", 32), ("layers", 2), ("seq", 16), ("vocab", 256)),
    )
    graph = trace(*build_model(spec, batch=global_batch))
    return megatron_plan(run, graph, spec, "cpu", tp * dp, 1), graph


@pytest.mark.parametrize("tp, dp, micro_batch", [(2, 1, 4), (1, 2, 1)])  # the vocabulary split; the batch split
def test_a_vocabulary_parallel_loss_matches_one_process_on_two_ranks(tp, dp, micro_batch):
    plan, _ = _plan(tp=tp, dp=dp, micro_batch=micro_batch)
    res = launch_local(plan, 2, steps=2, lr=1e-2)
    assert res.max_loss_error <= LOSS_TOL, (res.losses, res.ref_losses)
    assert res.max_grad_error <= GRAD_TOL
    assert res.losses[1] < res.losses[0]


def test_the_loss_pieces_carry_their_group_and_pay_for_it():
    from planlab.costmodel import CostModel

    plan, graph = _plan(tp=2)
    program = materialize(plan, graph)
    pieces = [
        t
        for dp in program.devices
        for b in dp.blocks.values()
        for t in b.tasks
        if t.kind is TaskKind.FORWARD and t.op_kind == "vocab_cross_entropy"
    ]
    assert pieces and all(t.group == (0, 1) for t in pieces)
    assert (0, 1) in program.groups
    assert all(t.shapes[0] == (4 * 16, 128) for t in pieces)  # this piece's half of the vocabulary
    cost = CostModel.load("cpu", 2)
    t = pieces[0]
    alone = cost.task_time_s(type(t)(**{**t.__dict__, "group": ()}), "float32")
    assert cost.task_time_s(t, "float32") == pytest.approx(
        alone
        + cost.collective_time_s("all_reduce", 4 * 64, (0, 1))
        + cost.collective_time_s("all_reduce", 8 * 64, (0, 1))
    )
    # a loss kept whole has no group
    whole, g1 = _plan(tp=1)
    one = materialize(whole, g1)
    assert all(
        not t.group
        for dp in one.devices
        for b in dp.blocks.values()
        for t in b.tasks
        if t.op_kind == "vocab_cross_entropy"
    )


def test_the_shares_add_up_to_the_loss_and_its_gradient():
    """Without a group (one slice): the share is the mean cross entropy and its gradient the
    softmax minus the one-hot target over the token count."""
    from planlab.executor.vocab_parallel import vocab_parallel_cross_entropy

    torch.manual_seed(0)
    logits = torch.randn(6, 10, requires_grad=True)
    target = torch.randint(0, 10, (6,))
    ours = vocab_parallel_cross_entropy(logits, target, offset=0, count=6, group=None)
    ref_logits = logits.detach().clone().requires_grad_(True)
    ref = F.cross_entropy(ref_logits, target)
    assert torch.allclose(ours, ref, atol=1e-6)
    ours.backward()
    ref.backward()
    assert torch.allclose(logits.grad, ref_logits.grad, atol=1e-6)


@pytest.mark.parametrize(
    "family, sizes, head",
    [
        ("gpt", (("heads", 4),), "lm_head"),
        ("llama", (("heads", 4), ("kv_heads", 2), ("ffn_hidden", 64)), "output"),  # torchtitan's loss_parallel
    ],
)
def test_megatron_tensor_parallelism_splits_the_vocabulary_of_a_vocabulary_parallel_model(family, sizes, head):
    """gpt or llama with vocab_parallel=1: the megatron space's tensor parallelism splits the
    embedding, the output layer and the loss along the vocabulary, as Megatron-LM (and torchtitan's
    loss_parallel) does, and matches one process."""
    from planlab.graph.trace import trace
    from planlab.models.registry import ModelSpec, build_model
    from planlab.search_spaces import Context, get_space

    spec = ModelSpec(
        family, (("layers", 2), ("hidden", 32), *sizes, ("seq", 16), ("vocab", 256), ("vocab_parallel", 1))
    )
    graph = trace(*build_model(spec, batch=8))
    plan = get_space("megatron").build(Context(graph, spec, 8, "cpu", 2, 2, 1), dict(dp=1, tp=2, pp=1, microbatch=4))
    ops = {p.op: p for p in plan.ops}
    assert ops[head].dims == (None, "n") and ops[head].sizes == (1, 2)
    assert ops["vocab_cross_entropy"].dims == (None, "v") and ops["vocab_embedding"].dims == (None, "v")
    res = launch_local(plan, 2, steps=2, lr=1e-2)
    assert res.max_loss_error <= LOSS_TOL, (res.losses, res.ref_losses)
    assert res.max_grad_error <= GRAD_TOL
