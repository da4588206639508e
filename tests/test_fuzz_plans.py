"""benchmarks/fuzz_plans.py draws the same plans for a given seed: its per-plan timing and summary
changed nothing a plan is drawn from (the descriptions below are those seed 0 drew before them)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import fuzz_plans  # noqa: E402

# (index, what, Plan.describe(), refusals) as main 133605e drew them for seed 0; since then the pp space
# names its uneven-stage knobs at their default 0 (an even split) in the assignment and the description,
# the recompute space its module knobs at their default False, and the pp space Llama 3's pipeline group
# at its default 0 (pp: Megatron-LM's order) and its expert all-to-all overlap off; the plan is the same
SEED0 = [
    (
        157,
        "llama-tiny on 2, pp {'pp': 2, 'schedule': '1f1b', 'virtual_stages': 1, 'first_stage_layers': 0, 'last_stage_layers': 0, '"
        "pipeline_group': 0, 'expert_overlap': False}",
        "pp(expert_overlap=False first_stage_layers=0 last_stage_layers=0 pipeline_group=0 pp=2 schedule=1f1b "
        "virtual_stages=1) on 2 devices, "
        "1 micro-batches",
        [],
    ),
    (
        159,
        "llama-tiny on 2, dp*recompute {'dp': 2, 'microbatch': 2, 'zero': 2, 'recompute': 'none', "
        "'recompute_moe_act': False, 'recompute_mlp': False, 'recompute_mla_up_proj': False}",
        "dp*recompute(dp=2 microbatch=2 recompute=none recompute_mla_up_proj=False recompute_mlp=False "
        "recompute_moe_act=False zero=2) on 2 devices, 2 micro-batches",
        [
            "evoformer-tiny on 4, pp: ConfigError: space 'pp' has no plan with no knob fixed: its constraints "
            "leave no assignment on 4 devices with global batch 8 and 2 layers"
        ],
    ),
    (
        162,
        "swin-tiny on 2, pp {'pp': 2, 'schedule': '1f1b', 'virtual_stages': 1, 'first_stage_layers': 0, 'last_stage_layers': 0, '"
        "pipeline_group': 0, 'expert_overlap': False}",
        "pp(expert_overlap=False first_stage_layers=0 last_stage_layers=0 pipeline_group=0 pp=2 schedule=1f1b "
        "virtual_stages=1) on 2 devices, "
        "1 micro-batches",
        [],
    ),
]


@pytest.mark.parametrize("index, what, describe, refused", SEED0)
def test_seed_0_draws_the_same_plans(index, what, describe, refused):
    got_what, plan, n, got_refused = fuzz_plans.draw_plan(0, index)
    assert (got_what, plan.describe(), got_refused) == (what, describe, refused)
    assert n == plan.num_devices == 2


def test_summary_splits_the_time():
    rows = [
        dict(seconds=10.0, draw_s=1.0, launch_s=9.0, steps_s=2.0, cpu_s=5.0),
        dict(seconds=30.0, draw_s=2.0, launch_s=28.0, steps_s=4.0, cpu_s=7.0),
    ]
    text = fuzz_plans.summary(rows)
    assert text.startswith("time: 40 s wall (median 20 s a plan, largest 30 s): drawing 3 s (8%), launches 37 s (92%)")
    assert text.endswith("of which the ranks' steps 6 s (15%); 12 s CPU (6.0 s a plan)")
    assert fuzz_plans.summary([]) == "no plan ran"


def test_a_pool_runs_plans_on_ranks_started_once_and_restarts_after_a_failure(monkeypatch):
    """Two seed-0 plans (LLaMA under pp=2, then dp=2 with ZeRO-2 and 2 micro-batches) on one pool of 2
    ranks match one process; a rank that fails before them is reported as ``launch_local`` reports
    it, and the pool starts again."""
    from planlab.errors import RankFailure
    from planlab.executor import RunConfig
    from planlab.executor.failures import FAULT_ENV
    from planlab.executor.pool import RankPool

    plans = [fuzz_plans.draw_plan(0, i)[1] for i in (157, 159)]
    cfg = RunConfig(steps=2, lr=1e-2, timeout_s=60)
    with RankPool(2) as pool:
        monkeypatch.setenv(FAULT_ENV, "rank=1,task=blocks_0_attention_norm,kind=raise")  # the ranks inherit it
        with pytest.raises(RankFailure, match=r"rank 1 failed at step 0.*blocks_0_attention_norm.*InjectedFault"):
            pool.run(plans[1], cfg)
        assert pool.procs == []  # ended; the next plan starts them again
        monkeypatch.delenv(FAULT_ENV)
        for plan in plans:
            res = pool.run(plan, cfg)
            assert res.passed(loss_tol=fuzz_plans.LOSS_TOL, grad_tol=fuzz_plans.GRAD_TOL), plan.describe()
            assert len(res.losses) == 2 and res.world_size == 2
        assert pool.starts == 2
