"""Context parallelism (``cp``, planlab/search_spaces/context.py): the knob's splits and errors,
the all-to-alls of ``cp_kind=a2a`` in the Program, and CP plans on gloo against one process."""

from __future__ import annotations

import pytest

from planlab.cli import GRAD_TOL, LOSS_TOL
from planlab.errors import ConfigError
from planlab.executor import launch_local
from planlab.plan import materialize
from planlab.plan.program import TaskKind
from planlab.search_spaces import Context, get_space
from planlab.search_spaces.context import context_parallel_dims, sequence_length

from conftest import all_to_alls, traced


def _ctx(name: str, n: int, args: tuple = ()):
    spec, g = traced(name, 8, args)
    return Context(g, spec, 8, "cpu", n, n, 1)


def test_a2a_splits_the_sequence_and_the_attention_heads():
    ctx = _ctx("llama-tiny", 2)
    g = ctx.graph
    dims = context_parallel_dims(g)
    seq = g.labels[(g.inputs[0], 1)]
    for op in g.operators:
        if op.kind == "attention":  # (B, nh, T, hs): the heads
            assert g.dim_label(op, dims[op.name]) == g.dim_label(op, op.axes_of(op.inputs[0])[1][0])
        elif op.kind == "linear":
            assert g.dim_label(op, dims[op.name]) == seq, op.name
    plan = get_space("megatron").build(ctx, dict(dp=1, cp=2, tp=1, pp=1, microbatch=4))
    attention = next(p for p in plan.ops if p.op == "scaled_dot_product_attention")
    assert sequence_length(g) == 32 and attention.sizes == (1, 1, 2) and attention.devices == (0, 1)
    assert attention.dims == (None, None, dims["scaled_dot_product_attention"])  # mesh axes dp, tp, cp


def test_a2a_moves_queries_keys_values_and_outputs_by_all_to_all():
    """Per layer and micro-batch: q, k, v to the heads and the output back to the sequence, and the
    four gradients; over the context-parallel groups, with identities, nothing point to point."""
    ctx = _ctx("llama-tiny", 4)
    plan = get_space("megatron").build(ctx, dict(dp=2, cp=2, tp=1, pp=1, microbatch=2))
    program = materialize(plan, ctx.graph)
    layers = 2
    for dev in program.devices:
        a2a = all_to_alls(dev)
        assert len(a2a) == 8 * layers * plan.microbatches
        assert {len(t.group) for t in a2a} == {2} and all(t.ident >= 0 for t in a2a)
        # the context-parallel peers are neighbours (Megatron-Core's tp-cp-ep-dp-pp order)
        assert {tuple(sorted(t.group)) for t in a2a} <= {(0, 1), (2, 3)}


def test_cp_devices_sit_outside_the_tensor_parallel_ones():
    """With tp = cp = 2 the tensor-parallel peers stay neighbours (0 1, 2 3) and the all-to-alls
    run over the context-parallel ones (0 2, 1 3): the heads split by tp first, by cp inside."""
    ctx = _ctx("gpt-tiny", 4)  # 4 heads (llama-tiny's 2 key/value heads split over tp x cp = 4 would not divide)
    plan = get_space("megatron").build(ctx, dict(dp=1, cp=2, tp=2, pp=1, microbatch=4))
    program = materialize(plan, ctx.graph)
    tasks = [t for _, t in program.devices[0].tasks_in_order()]
    assert not [t for t in tasks if t.kind in (TaskKind.SEND, TaskKind.RECV)]
    groups = {(t.collective, tuple(sorted(t.group))) for t in tasks if t.kind is TaskKind.COLLECTIVE}
    assert ("all_to_all", (0, 2)) in groups and ("all_reduce", (0, 1)) in groups
    assert not {g for k, g in groups if k == "all_to_all"} - {(0, 2)}


@pytest.mark.parametrize(
    "name, args, n, knobs, message",
    [
        ("llama-tiny", (), 2, dict(cp=3), r"knob 'cp' = 3 is outside its range: choose 1 or 2"),
        ("llama-tiny", (), 8, dict(dp=1, tp=2, cp=4, pp=1), r"cp=4 with cp_kind=a2a splits the 1 key/value heads"),
        ("llama-tiny", (), 4, dict(dp=1, tp=2, cp=2, pp=1), r"splits the 1 key/value heads .* choose cp in 1 or"),
        ("llama-tiny", (), 4, dict(dp=1, tp=1, cp=2, pp=1), r"do not multiply to the 4 devices"),
        (
            "gpt-tiny",
            (),
            4,
            dict(dp=1, tp=2, cp=2, pp=1, sequence_parallel=True),
            r"sequence_parallel=True with cp=2",
        ),
        ("gpt-tiny", (("seq", 20),), 8, dict(cp=8, cp_kind="ring"), r"knob 'cp' = 8 is outside"),
        ("gpt-tiny", (("seq", 24),), 8, dict(cp=8, cp_kind="wide"), r"wide"),
        (
            "gpt-tiny",
            (("seq", 20),),
            4,
            dict(dp=1, tp=1, pp=1, cp=4, cp_kind="ring", cp_layout="zigzag"),
            r"^space .megatron.: cp=4 with cp_layout=zigzag cuts the sequence of 20 tokens into 8 chunks, which do "
            r"not divide it; choose cp in 1, 2 or cp_layout=contiguous$",
        ),
        ("gpt-tiny", (), 2, dict(cp=2, cp_kind="ring", cp_layout="spiral"), r"'cp_layout' .*spiral.*zigzag"),
        (
            "moe-tiny",
            (),
            2,
            dict(dp=1, tp=1, pp=1, cp=2, cp_kind="ring", cp_layout="zigzag"),
            r"cp_layout=zigzag with cp_kind=ring: operator 'cumsum' \(cumsum\) keeps the sequence whole .*; choose "
            r"cp_layout=contiguous$",
        ),
        (
            "moe-tiny",
            (),
            2,
            dict(dp=1, tp=1, pp=1, cp=2, cp_kind="allgather", cp_layout="zigzag"),
            r"cp_layout=zigzag with cp_kind=allgather: operator 'cumsum' \(cumsum\) keeps the sequence whole .*; "
            r"choose cp_layout=contiguous$",
        ),
    ],
    ids=[
        "devices",
        "heads",
        "grouped-heads",
        "product",
        "sp",
        "ring-chunks",
        "kind",
        "zigzag-chunks",
        "layout",
        "zigzag-moe",
        "zigzag-moe-allgather",
    ],
)
def test_cp_values_that_do_not_fit(name, args, n, knobs, message):
    ctx = _ctx(name, n, args)
    with pytest.raises(ConfigError, match=message):
        get_space("megatron").build(ctx, dict(microbatch=1, **knobs))


@pytest.mark.parametrize(
    "name, args, zigzag",
    [
        ("llama-tiny", (), True),  # causal, rotary tables: balanced as Megatron-Core balances it
        ("gpt-tiny", (("seq", 20),), False),  # 2 cp = 8 does not divide 20 tokens
        ("moe-tiny", (), False),  # capacity-limited routing counts tokens in sequence order (cumsum)
    ],
)
def test_cp_layout_auto_is_zigzag_where_the_model_computes_the_same(name, args, zigzag):
    ctx = _ctx(name, 4, args)
    values = dict(dp=1, tp=1, pp=1, cp=4, cp_kind="ring", microbatch=1)
    plan = get_space("megatron").build(ctx, values)
    assert plan.zigzag is zigzag and get_space("megatron").draft(ctx, values).zigzag is zigzag  # the screen's too


def test_cp_error_names_what_fits():
    ctx = _ctx("gpt-tiny", 8, (("seq", 20),))
    with pytest.raises(ConfigError, match=r"^space .megatron.: knob .cp. = 8 is outside its range: choose 1, 2 or 4$"):
        get_space("megatron").build(ctx, dict(dp=1, tp=1, pp=1, cp=8, cp_kind="ring", microbatch=1))


# ---- context-parallel plans on gloo match one process -----------------------------------


def test_context_parallel_plan_on_2_ranks_matches_one_process():
    ctx = _ctx("llama-tiny", 2)
    plan = get_space("megatron").build(ctx, dict(dp=1, cp=2, tp=1, pp=1, microbatch=4))
    res = launch_local(plan, 2, steps=2, lr=1e-2)
    assert res.passed(loss_tol=LOSS_TOL, grad_tol=GRAD_TOL), (res.losses, res.ref_losses, res.max_grad_error)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, n, knobs",
    [("llama-tiny", 4, dict(dp=2, cp=2, tp=1, pp=1)), ("gpt-tiny", 4, dict(dp=1, cp=2, tp=1, pp=2))],
    ids=["llama-cp2-dp2", "gpt-cp2-pp2"],
)
def test_context_parallel_plans_on_4_ranks_match_one_process(name, n, knobs):
    ctx = _ctx(name, n)
    plan = get_space("megatron").build(ctx, dict(microbatch=2, **knobs))
    res = launch_local(plan, n, steps=2, lr=1e-2)
    assert res.passed(loss_tol=LOSS_TOL, grad_tol=GRAD_TOL), (res.losses, res.ref_losses, res.max_grad_error)
