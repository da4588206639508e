"""Multi-rank tests: plans run on 2 or 4 gloo processes through torchrun's launcher and
must match one process (loss within 1e-4, every gradient element within 1e-4, fp32)."""

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from planlab.cli import GRAD_TOL, LOSS_TOL
from planlab.executor import launch_local
from planlab.plan import PlanBuilder
from planlab.search_spaces import Context, get_space

from conftest import traced


def _check(plan, n, steps=2):
    res = launch_local(plan, n, steps=steps, lr=1e-2)
    assert len(res.losses) == steps and res.world_size == n
    assert res.max_loss_error <= LOSS_TOL, (res.losses, res.ref_losses)
    assert res.max_grad_error <= GRAD_TOL
    assert res.losses[1] < res.losses[0]  # the optimizer step took effect
    return res


@pytest.mark.parametrize(
    "n, knobs",
    [
        (2, dict(dp=2, tp=1, pp=1, microbatch=2)),  # data parallel, 2 micro-batches
        (2, dict(dp=1, tp=2, pp=1, microbatch=8)),  # Megatron tensor parallel
        (2, dict(dp=1, tp=2, pp=1, microbatch=8, sequence_parallel=True)),  # ... with sequence parallelism
        (2, dict(dp=1, tp=1, pp=2, microbatch=2)),  # 1F1B pipeline, 4 micro-batches
        (4, dict(dp=1, tp=2, pp=2, microbatch=4)),  # TP x PP
        (2, dict(dp=1, tp=2, pp=1, microbatch=4, recompute="full")),  # recomputed layers
        (2, dict(dp=1, tp=1, pp=2, microbatch=2, schedule="interleaved", virtual_stages=2)),
        (4, dict(dp=2, tp=2, pp=1, microbatch=2, zero=2)),  # ZeRO-2: sharded Adam steps, weights all-gathered
        # ZeRO-3 over the dp ranks, norms' gradients summed over tp first (sequence parallelism)
        (4, dict(dp=2, tp=2, pp=1, microbatch=2, zero=3, sequence_parallel=True)),
    ],
)
def test_megatron_plans_match_one_process(n, knobs):
    spec, g = traced("gpt-small" if knobs.get("virtual_stages", 1) > 1 else "gpt-tiny", 8)
    plan = get_space("megatron").build(Context(g, spec, 8, "cpu", n, n, 1), knobs)
    _check(plan, n)


@st.composite
def random_plans(draw):
    """Random op-trans (a splittable dimension or replication, 2 pieces, or kept whole) and
    op-assign (either device order, or one device) on a one-layer GPT with dropout on (its masks
    are the same under any split: planlab/executor/randomness.py)."""
    spec, g = traced("gpt-tiny", 4, (("dropout", 0.1), ("layers", 1)))
    b = PlanBuilder(g, model=spec, global_batch=4, cluster="cpu", nodes=2, num_devices=2)
    b.microbatch(draw(st.sampled_from([1, 2])))
    for op in g.operators:
        choice = draw(st.sampled_from(["whole", "replicate"] + op.splittable_dims()))
        if choice == "whole":
            b.op_assign(op.name, [draw(st.sampled_from([0, 1]))])
            continue
        dim = None if choice == "replicate" else choice
        try:
            b.op_trans(op.name, dim, 2)
        except Exception:
            b.op_trans(op.name, None, 2)  # the dimension does not split in two at this size
        b.op_assign(op.name, draw(st.sampled_from([[0, 1], [1, 0]])))
    return b.build()


# no shrinking: each example launches two processes, and a failing plan is printed whole anyway
@settings(
    max_examples=8,
    deadline=None,
    derandomize=True,
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(random_plans())
def test_random_plans_match_one_process(plan):
    res = launch_local(plan, 2, steps=1, lr=1e-2)
    assert res.max_loss_error <= LOSS_TOL, (res.losses, res.ref_losses)
    assert res.max_grad_error <= GRAD_TOL
