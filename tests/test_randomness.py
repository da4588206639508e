"""Plan-invariant randomness (planlab/executor/randomness.py): Threefry-2x32 against its published
answers, any box split of a draw against the whole draw, the torch calls the generator takes over,
and a tensor-parallel plan with dropout in a replicated region on 2 gloo ranks against one process."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from planlab.cli import GRAD_TOL, LOSS_TOL
from planlab.errors import ConfigError, ExecutionError
from planlab.executor import launch_local
from planlab.executor.randomness import (
    BITS_TO_UNIT,
    CHUNK_ELEMENTS,
    MASK32,
    Draw,
    RandomMode,
    reference_draws,
    stream_key,
    threefry2x32,
)
from planlab.graph.random_ops import random_operators
from planlab.plan import materialize
from planlab.plan.program import TaskKind
from planlab.search_spaces import Context, get_space

from conftest import traced


@pytest.mark.parametrize(
    "key, counter, expected",
    [  # Random123's known-answer vectors for threefry2x32_20 (kat_vectors), as JAX's tests use them
        ((0, 0), (0, 0), (0x6B200159, 0x99BA4EFE)),
        ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
        ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
    ],
)
def test_threefry_matches_the_published_answers(key, counter, expected):
    assert threefry2x32(key, *counter) == expected
    x0, x1 = threefry2x32(key, torch.tensor([counter[0]]), torch.tensor([counter[1]]))  # the tensor path too
    assert (int(x0), int(x1)) == expected


def _cuts(draw, n: int) -> list[int]:
    return sorted(set(draw(st.lists(st.integers(1, n - 1), max_size=3)))) if n > 1 else []


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_any_box_split_draws_what_the_whole_draws(data):
    """Cut every axis of a tensor anywhere: each box's draw is the whole draw's slice."""
    shape = tuple(data.draw(st.lists(st.integers(1, 7), min_size=0, max_size=4)))
    seed, step = data.draw(st.integers(-(2**40), 2**40)), data.draw(st.integers(0, 10**6))
    whole = Draw(seed, "layer.dropout", step, (0,) * len(shape), shape, shape)
    bits = whole.bits()
    assert bits.shape == shape and bool(((bits >= 0) & (bits < 2**32)).all())
    edges = [[0, *_cuts(data.draw, n), n] for n in shape]
    boxes = [[]]
    for e in edges:
        boxes = [b + [(lo, hi)] for b in boxes for lo, hi in zip(e, e[1:])]
    for box in boxes:
        piece = Draw(seed, "layer.dropout", step, tuple(a for a, _ in box), tuple(b - a for a, b in box), shape)
        assert torch.equal(piece.bits(), bits[tuple(slice(a, b) for a, b in box)])
        assert torch.equal(piece.keep(0.3), whole.keep(0.3)[tuple(slice(a, b) for a, b in box)])


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_the_chunked_hash_draws_the_bits_of_the_whole_index(data):
    """The draws hash a bounded number of elements at a time: every chunk size gives, bit for bit,
    the hash of the whole global index at once (what the generator was defined by)."""
    shape = tuple(data.draw(st.lists(st.integers(1, 6), min_size=0, max_size=4)))
    offset = tuple(data.draw(st.integers(0, 5)) for _ in shape)
    whole = tuple(o + n + data.draw(st.integers(0, 3)) for o, n in zip(offset, shape))
    d = Draw(
        data.draw(st.integers(-(2**40), 2**40)), "blocks.0.drop", data.draw(st.integers(0, 99)), offset, shape, whole
    )
    idx = d.global_index()
    want = threefry2x32(stream_key(d.seed, d.op, d.step), idx & MASK32, idx >> 32)[0]
    chunk = data.draw(st.integers(1, 2 * max(1, want.numel())))
    assert torch.equal(d.bits(chunk_elements=chunk), want)
    assert torch.equal(d.keep(0.3, chunk_elements=chunk), want >= math.ceil(0.3 * 2**32))
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        u = d.uniform(dtype, chunk_elements=chunk)
        assert torch.equal(u, ((want >> 8).to(torch.float32) * BITS_TO_UNIT).to(dtype))


def test_a_large_draw_is_hashed_in_bounded_chunks():
    """A draw of 2**20 elements (4 MiB of float32) in chunks of CHUNK_ELEMENTS: equal to the same
    draw in one chunk; the chunked one's indices are built CHUNK_ELEMENTS at a time."""
    d = Draw(3, "attn.drop", 1, (8, 0, 0), (4, 512, 512), (32, 512, 512))
    assert CHUNK_ELEMENTS < 2**20
    assert d.index_range(0, CHUNK_ELEMENTS).numel() == CHUNK_ELEMENTS
    assert torch.equal(d.index_range(5, 9), d.global_index().reshape(-1)[5:9])
    assert torch.equal(d.keep(0.1), d.keep(0.1, chunk_elements=2**20))
    with pytest.raises(ConfigError, match="chunk_elements must be at least 1, got 0"):
        d.bits(chunk_elements=0)


def test_draws_differ_by_seed_operator_and_step_and_keep_the_rate():
    base = Draw(0, "h.0.drop", 0, (0, 0), (64, 256), (64, 256))
    others = [
        Draw(1, "h.0.drop", 0, (0, 0), (64, 256), (64, 256)),
        Draw(0, "h.1.drop", 0, (0, 0), (64, 256), (64, 256)),
        Draw(0, "h.0.drop", 1, (0, 0), (64, 256), (64, 256)),
    ]
    for o in others:
        assert (o.bits() != base.bits()).float().mean() > 0.99
    assert len({stream_key(s, "x", t) for s in range(4) for t in range(4)}) == 16
    kept = float(base.keep(0.1).float().mean())  # 16,384 elements: within 5 standard deviations of 0.9
    assert abs(kept - 0.9) < 5 * math.sqrt(0.09 / base.bits().numel())
    u = base.uniform()
    assert u.dtype == torch.float32 and float(u.min()) >= 0.0 and float(u.max()) < 1.0


def test_the_mode_takes_over_dropout_attention_and_rand_and_refuses_other_draws():
    draws = []

    def place(kind, shape):
        draws.append((kind, shape))
        return Draw(7, f"op{len(draws)}", 0, (0,) * len(shape), tuple(shape), tuple(shape))

    x = torch.ones(4, 8)
    q = torch.randn(2, 2, 5, 4)
    with RandomMode(place):
        y = F.dropout(x, 0.5)
        same = F.dropout(x, 0.5, training=False)  # not training: no draw
        a = F.scaled_dot_product_attention(q, q, q, dropout_p=0.25)
        r = torch.rand(3, 1, 1)
        with pytest.raises(ExecutionError, match="randn"):
            torch.randn(3)
    assert draws == [("dropout", (4, 8)), ("attention", (2, 2, 5, 5)), ("rand", (3, 1, 1))]
    assert torch.equal(same, x)
    assert set(y.unique().tolist()) <= {0.0, 2.0} and 0 < int((y == 0).sum()) < 32
    keep = Draw(7, "op1", 0, (0, 0), (4, 8), (4, 8)).keep(0.5)
    assert torch.equal(y, keep.float() * 2.0)
    assert a.shape == (2, 2, 5, 4) and r.shape == (3, 1, 1)
    want = torch.softmax(q @ q.transpose(-2, -1) / 2.0, -1)
    want = want * Draw(7, "op2", 0, (0,) * 4, (2, 2, 5, 5), (2, 2, 5, 5)).keep(0.25) / 0.75
    assert torch.allclose(a, want @ q, atol=1e-6)


def test_the_reference_names_a_model_that_draws_unlike_its_graph():
    spec, g = traced(
        "gpt", 4, (("dropout", 0.1), ("heads", 2), ("hidden", 16), ("layers", 1), ("seq", 8), ("vocab", 32))
    )
    assert [op.kind for op in random_operators(g)] == ["dropout"] * 3
    with pytest.raises(ExecutionError, match="drew from 1 random operators; the traced graph has 3"):
        with reference_draws(g, 0, 0):
            F.dropout(torch.ones(3), 0.1)


def test_tensor_parallel_dropout_in_a_replicated_region_matches_one_process():
    """Megatron's tp=2 leaves the residual dropouts replicated (after the row-parallel all-reduce):
    both ranks hold the whole tensor, draw the same mask, and the run matches one process."""
    args = (("dropout", 0.2), ("heads", 4), ("hidden", 32), ("layers", 2), ("seq", 16), ("vocab", 64))
    spec, g = traced("gpt", 4, args)
    plan = get_space("tp").build(Context(g, spec, 4, "cpu", 2, 2, 1), {"tp": 2})
    program = materialize(plan, g)
    random = {op.name for op in random_operators(g)}
    boxes = {}
    for dp in program.devices:
        for block in dp.blocks.values():
            for t in block.tasks:
                if t.kind is TaskKind.FORWARD and t.op in random:
                    boxes.setdefault(t.op, []).append(t.box)
    assert len(boxes) == 5 and all(len(b) == 2 and b[0] == b[1] for b in boxes.values()), boxes  # whole on both
    res = launch_local(plan, 2, steps=2, lr=1e-2)
    assert res.max_loss_error <= LOSS_TOL, (res.losses, res.ref_losses)
    assert res.max_grad_error <= GRAD_TOL
