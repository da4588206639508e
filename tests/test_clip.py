"""Gradient clipping across shards, without launching: each rank's gradient buffers are filled
with its slices of one whole-model gradient (ZeRO shards from the flattened buckets, as the
Interpreter reduces them), and the ranks' weighted sums of squares must add up to the whole
gradient's squared norm, each element counted once whatever the replication."""

import pytest
import torch

from planlab.executor import Interpreter
from planlab.executor.clip import EPS, clip_coefficient, copies, local_square_sum
from planlab.executor.shards import build_shards
from planlab.models.init import build_skeleton
from planlab.plan import materialize
from planlab.plan.buffer import weight_grad
from planlab.search_spaces import Context, get_space

from conftest import traced


def _rank_grads(interp: Interpreter, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The buffers ``interp`` holds at its optimizer when the whole gradient is ``grads``."""
    boxes = dict(interp.dp.params)
    out = {weight_grad(p): grads[p][tuple(slice(a, b) for a, b in boxes[p])] for p, _ in interp.leaves}
    for name, z in interp.zero.items():
        flat = torch.cat([grads[p][tuple(slice(a, b) for a, b in boxes[p])].reshape(-1) for p in z.params])
        flat = torch.nn.functional.pad(flat, (0, z.chunk * z.n - flat.numel()))
        out[name] = flat[z.me * z.chunk : (z.me + 1) * z.chunk]
        for p in z.params:
            out.pop(weight_grad(p))
    return out


@pytest.mark.parametrize(
    "n, knobs",
    [
        (2, dict(dp=2, tp=1, pp=1, microbatch=2)),  # replicas
        (2, dict(dp=1, tp=2, pp=1, microbatch=8)),  # split and replicated (norms) pieces
        (2, dict(dp=1, tp=2, pp=1, microbatch=8, sequence_parallel=True)),
        (2, dict(dp=1, tp=1, pp=2, microbatch=2)),  # stages
        (4, dict(dp=2, tp=2, pp=1, microbatch=2, zero=2)),  # ZeRO shards of replicated buckets
        (4, dict(dp=2, tp=1, pp=2, microbatch=2, zero=1)),
    ],
)
def test_ranks_sum_to_the_whole_norm(n, knobs):
    spec, g = traced("gpt-tiny", 8)
    plan = get_space("megatron").build(Context(g, spec, 8, "cpu", n, n, 1), knobs)
    program = materialize(plan, g)
    skeleton, inputs = build_skeleton(spec, batch=8)
    gen = torch.Generator().manual_seed(0)
    grads = {p: torch.randn(w.shape, generator=gen) for p, w in skeleton.named_parameters()}
    total = torch.zeros((), dtype=torch.float64)
    for r in range(n):
        interp = Interpreter(
            program, g, r, skeleton, inputs, {}, shards=build_shards(program, r, skeleton, seed=0), clip_grad_norm=1.0
        )
        mine = _rank_grads(interp, grads)
        assert set(mine) == set(interp._norm_weights)
        total += local_square_sum(mine, interp._norm_weights)
    whole = torch.nn.utils.get_total_norm(list(grads.values())).double()
    assert float(total.sqrt()) == pytest.approx(float(whole), rel=1e-6)


@pytest.mark.parametrize(
    "box, others, expect",
    [
        (((0, 4), (0, 6)), [((0, 4), (0, 6))] * 3, 3.0),  # identical replicas
        (((0, 2), (0, 6)), [((0, 2), (0, 6)), ((2, 4), (0, 6))], 1.0),  # disjoint pieces
        (((0, 4), (0, 2)), [((0, 4), (0, 2)), ((2, 4), (0, 6))], [[1, 1], [1, 1], [2, 2], [2, 2]]),  # partial overlap
    ],
)
def test_copies(box, others, expect):
    got = copies(box, others)
    if isinstance(expect, float):
        assert got == expect
    else:
        assert torch.equal(got, torch.tensor(expect, dtype=torch.float64))


def test_clip_coefficient_as_torch():
    g = [torch.full((3,), 2.0), torch.full((2,), 1.0)]
    norm = float(torch.nn.utils.get_total_norm(g))
    for max_norm in (0.5, 100.0):
        h = [x.clone().requires_grad_() for x in g]
        for x, y in zip(h, g):
            x.grad = y.clone()
        torch.nn.utils.clip_grad_norm_(h, max_norm)
        assert float(h[0].grad[0]) == pytest.approx(2.0 * clip_coefficient(norm, max_norm), rel=1e-6)
    assert clip_coefficient(norm, 100.0) == 1.0 and clip_coefficient(1.0, 0.5) == pytest.approx(0.5 / (1 + EPS))
