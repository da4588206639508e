"""Uneven pipeline stages (Megatron-Core's first/last-stage layer counts): the layer counts, the
errors of counts that do not fit, exploration of a layer count the stage count does not divide,
and an uneven plan that matches one process on 2 gloo ranks."""

import pytest

from planlab.cli import GRAD_TOL, LOSS_TOL
from planlab.errors import ConfigError
from planlab.executor import launch_local
from planlab.search_spaces import Context, get_space
from planlab.search_spaces.stages import (
    balanced_uneven,
    chunk_layers,
    explored_ends,
    layers_per_stage,
    uneven_problem,
)

from conftest import traced


@pytest.mark.parametrize(
    "layers, pp, first, last, counts",
    [
        (126, 16, 7, 7, (7,) + (8,) * 14 + (7,)),  # Megatron-Core's 126 layers on 16 stages
        (24, 4, 0, 0, (6, 6, 6, 6)),
        (3, 2, 0, 1, (2, 1)),
        (3, 2, 2, 0, (2, 1)),
        (10, 4, 1, 0, (1, 3, 3, 3)),
        (10, 4, 2, 2, (2, 3, 3, 2)),
        (10, 4, 0, 0, None),  # 4 does not divide 10
        (4, 4, 1, 1, (1, 1, 1, 1)),
        (4, 4, 2, 2, None),  # the middle stages would hold no layer
        (3, 2, 1, 1, None),  # 2 of 3 layers
        (3, 4, 0, 0, None),
    ],
)
def test_layers_per_stage(layers, pp, first, last, counts):
    assert layers_per_stage(layers, pp, first, last) == counts
    assert (uneven_problem(layers, pp, first, last) is None) == (counts is not None)
    if counts:
        assert sum(counts) == layers


def test_balanced_uneven_split():
    assert balanced_uneven(126, 16) == (7, 7)
    assert balanced_uneven(3, 2) == (2, 1)
    assert balanced_uneven(30, 8) == (3, 3)
    assert balanced_uneven(24, 4) is None
    for layers in range(2, 60):
        for pp in range(2, layers + 1):
            pair = balanced_uneven(layers, pp)
            if pair:
                counts = layers_per_stage(layers, pp, *pair)
                assert counts and max(counts[0], counts[-1]) <= max(counts), (layers, pp, pair)
    assert explored_ends(126, (1, 2, 4, 8, 16)) == ((0, 7, 15, 31), (0, 7, 15, 31))


@pytest.fixture(scope="module")
def three():
    spec, g = traced("gpt-tiny", 8, (("layers", 3),))
    return Context(g, spec, 8, "cpu", 2, 2, 1)


def test_an_odd_layer_count_is_explored_on_two_stages(three):
    got = [a for a in get_space("megatron").assignments(three) if a["pp"] == 2]
    assert got and {(a["first_stage_layers"], a["last_stage_layers"]) for a in got} == {(0, 1)}
    plan = get_space("megatron").build(three, dict(dp=1, tp=1, pp=2, microbatch=2, last_stage_layers=1))
    stage_of = {p.op: p.stage for p in plan.ops}
    layer_stage = {int(op.split("_")[1]): s for op, s in stage_of.items() if op.startswith("blocks_")}
    assert layer_stage == {0: 0, 1: 0, 2: 1}
    # the embedding counts toward the first stage, the output layer and the loss toward the last
    assert stage_of["wte"] == stage_of["wpe"] == 0
    assert stage_of["cross_entropy"] == 1


@pytest.mark.parametrize(
    "knobs, text",
    [
        (dict(pp=2), "first_stage_layers=0, last_stage_layers=0 leave 3 of the 3 layers, which the other 2 stages"),
        (dict(pp=2, first_stage_layers=1, last_stage_layers=1), "add up to 2, not the model's 3 layers"),
        (
            dict(pp=2, first_stage_layers=2, last_stage_layers=2),
            "for example first_stage_layers=2, last_stage_layers=1",
        ),
        (dict(pp=2, first_stage_layers=5), "knob 'first_stage_layers' = 5 is outside its range: choose 0, 1 or 2"),
    ],
)
def test_counts_that_do_not_fit_name_the_knob(three, knobs, text):
    with pytest.raises(ConfigError, match=text.replace("(", r"\(")):
        get_space("megatron").build(three, dict(dp=1, tp=1, microbatch=2, **knobs))


def test_uneven_stages_match_one_process():
    spec, g = traced("llama-tiny", 8, (("layers", 3),))
    ctx = Context(g, spec, 8, "cpu", 2, 2, 1)
    plan = get_space("megatron").build(ctx, dict(dp=1, tp=1, pp=2, microbatch=2, last_stage_layers=1))
    res = launch_local(plan, 2, steps=2, lr=1e-2)
    assert res.max_loss_error <= LOSS_TOL, (res.losses, res.ref_losses)
    assert res.max_grad_error <= GRAD_TOL


@pytest.mark.parametrize(
    "counts, chunks, got",
    [
        ((7,) + (8,) * 14 + (7,), 8, (0,) + (1,) * 126 + (0,)),  # Llama 3 405B: 126 layers, 128 chunks
        ((3, 4, 4, 3), 2, (1, 2, 2, 2, 2, 2, 2, 1)),
        ((1, 1), 2, (0, 1, 1, 0)),
        ((2, 2, 2, 2), 1, (2, 2, 2, 2)),
        ((3, 4, 4, 3), 4, (0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0)),
        ((1, 4, 4, 3), 2, None),  # the first device's one layer cannot fill its second chunk of 2
        ((3, 4, 5, 3), 2, None),  # middle stages unequal
        ((3, 3, 3, 3), 2, None),  # 3 middle layers do not split into 2 chunks
    ],
)
def test_uneven_ends_split_into_model_chunks(counts, chunks, got):
    assert chunk_layers(counts, chunks) == got
    if got:
        assert sum(got) == sum(counts) and len(got) == len(counts) * chunks
        for d, n in enumerate(counts):  # stage c * pp + d is device d's chunk c
            assert sum(got[d :: len(counts)]) == n


def test_interleaved_uneven_ends_put_the_embedding_and_the_loss_on_chunks_of_their_own():
    """Llama 3's layout in small: 2 layers on 2 devices of 2 chunks, one layer fewer on each end
    device, so the first chunk holds only the embedding and the last only the output and the loss."""
    spec, g = traced("gpt-tiny", 8, (("layers", 2),))
    ctx = Context(g, spec, 8, "cpu", 2, 2, 1)
    knobs = dict(dp=1, tp=1, pp=2, microbatch=2, schedule="interleaved", virtual_stages=2)
    plan = get_space("megatron").build(ctx, dict(knobs, first_stage_layers=1, last_stage_layers=1))
    stage_of = {p.op: p.stage for p in plan.ops}
    layer_stage = {int(op.split("_")[1]): s for op, s in stage_of.items() if op.startswith("blocks_")}
    assert layer_stage == {0: 1, 1: 2}
    assert stage_of["wte"] == stage_of["wpe"] == 0
    assert stage_of["cross_entropy"] == 3


def test_uneven_ends_that_do_not_split_into_chunks_name_the_knobs(three):
    knobs = dict(dp=1, tp=1, pp=2, microbatch=2, schedule="interleaved", virtual_stages=3, last_stage_layers=1)
    with pytest.raises(ConfigError, match="virtual_stages=3: each device's layers must split"):
        get_space("megatron").build(three, knobs)


def test_uneven_interleaved_ends_are_found_with_the_knobs_fixed_as_typed():
    """``--set`` values arrive as text; interleaved chunks that divide only the layers + 2 are
    enumerated once the end stages' counts are fixed (the divisibility check waits for them)."""
    spec, g = traced("gpt-tiny", 8, (("layers", 2),))
    ctx = Context(g, spec, 8, "cpu", 2, 2, 1)
    fixed = dict(pp="2", schedule="interleaved", virtual_stages="2", first_stage_layers="1", last_stage_layers="1")
    got = get_space("megatron").enumerate(ctx, dict(fixed, sequence_parallel="false", dp="1", tp="1"))
    assert got and all(a["virtual_stages"] == 2 and a["sequence_parallel"] is False for a in got)
