"""The ``alpa`` space: its integer program, its stage-slicing dynamic program, and its plans (built,
materialized, simulated and run on gloo ranks against one process)."""

import itertools
import math

import numpy as np
import pytest

from planlab.cli import GRAD_TOL, LOSS_TOL
from planlab.costmodel import CostModel
from planlab.errors import ConfigError, InfeasiblePlan
from planlab.executor import launch_local
from planlab.plan import materialize
from planlab.search_spaces import Context, get_space
from planlab.search_spaces import alpa
from planlab.search_spaces.alpa_costs import CostTables, Mesh2D
from planlab.search_spaces.alpa_ilp import Edge, evaluate, slice_stages, solve_strategies
from planlab.plan.program import FP32
from planlab.simulator import simulate

from conftest import traced

# A GPT big enough that splitting pays on the CPU cluster's cost model (gpt-tiny's default shape
# is so small that replicating every operator is the fastest plan), small enough to run in seconds.
ARGS = (("hidden", 256), ("seq", 64))


# -- the integer program ---------------------------------------------------------------------------
def _three_ops():
    """A -> B -> C. A: 2 strategies, B: 3, C: 2. Alone, A prefers 0, B prefers 2, C prefers 1; the
    edges charge 5 for a change of layout and 0 for A0-B0, B0-C0 (and B1-C1): the optimum is
    A0 B0 C0 = 1 + 2 + 3 = 6, against A0 B2 C1 = 1 + 0 + 0 + 5 + 5 = 11 and A0 B0 C1 = 1 + 2 + 0 + 0 + 5 = 8."""
    node = [np.array([1.0, 4.0]), np.array([2.0, 3.0, 0.0]), np.array([3.0, 0.0])]
    ab = np.full((2, 3), 5.0)
    ab[0, 0] = ab[1, 1] = 0.0
    bc = np.full((3, 2), 5.0)
    bc[0, 0] = bc[1, 1] = 0.0
    return node, [Edge(0, 1, ab), Edge(1, 2, bc)]


def test_ilp_finds_the_known_optimum_of_three_operators():
    node, edges = _three_ops()
    sol = solve_strategies(node, edges)
    assert sol.choice == (0, 0, 0)
    assert sol.objective == pytest.approx(6.0)
    brute = min(itertools.product(range(2), range(3), range(2)), key=lambda c: evaluate(c, node, edges))
    assert brute == sol.choice


def test_ilp_respects_the_memory_bound():
    """Memory 10 for B's strategy 0 and 1 for the others: under a bound of 5 B cannot take 0; the best
    is then A1 B1 C1 = 4 + 3 + 0 = 7 (A0 B1 costs 1 + 5 + 3 + 0 = 9). Under a bound of 2 nothing fits."""
    node, edges = _three_ops()
    mem = [np.array([1.0, 1.0]), np.array([10.0, 1.0, 1.0]), np.array([1.0, 1.0])]
    sol = solve_strategies(node, edges, node_memory=mem, memory_bound=5.0)
    assert sol.choice == (1, 1, 1) and sol.objective == pytest.approx(7.0) and sol.memory == 3.0
    assert solve_strategies(node, edges, node_memory=mem, memory_bound=2.0) is None


# -- the stage-slicing dynamic program -------------------------------------------------------------
def _brute_slicing(t, layers, stages, m):
    best = None
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        b = (0, *cuts, layers)
        ts = [t(b[s], b[s + 1], s) for s in range(stages)]
        if not all(math.isfinite(x) for x in ts):
            continue
        v = sum(ts) + (m - 1) * max(ts)
        if best is None or v < best[0] - 1e-12:
            best = (v, b)
    return best


def test_dp_slices_even_layers_evenly_and_avoids_infeasible_stages():
    assert slice_stages(lambda a, b, s: float(b - a), 4, 2, 4).bounds == (0, 2, 4)
    # stage 0 also holds an embedding worth 2 layers: it takes fewer layers
    sl = slice_stages(lambda a, b, s: (b - a) + (2.0 if s == 0 else 0.0), 6, 2, 8)
    assert sl.bounds == (0, 2, 6) and sl.latency_s == pytest.approx(4 + 4 + 7 * 4)
    # stage 0 cannot hold more than one layer (memory)
    assert slice_stages(lambda a, b, s: math.inf if s == 0 and b - a > 1 else float(b - a), 4, 2, 1).bounds == (0, 1, 4)
    with pytest.raises(InfeasiblePlan, match="no slicing"):
        slice_stages(lambda a, b, s: math.inf, 4, 2, 1)
    with pytest.raises(InfeasiblePlan, match="3 pipeline stages cannot hold 2 layers"):
        slice_stages(lambda a, b, s: 1.0, 2, 3, 1)


@pytest.mark.parametrize("seed", range(4))
def test_dp_matches_brute_force_on_a_random_cost_table(seed):
    rng = np.random.default_rng(seed)
    layers, stages, m = 7, 3, int(rng.integers(1, 9))
    table = rng.uniform(0.5, 2.0, size=(layers + 1, layers + 1, stages))
    table[rng.uniform(size=table.shape) < 0.1] = math.inf  # some stages out of memory

    def t(a, b, s):
        return float(table[a, b, s] * (b - a))

    want = _brute_slicing(t, layers, stages, m)
    got = slice_stages(t, layers, stages, m)
    assert got.latency_s == pytest.approx(want[0])
    assert _brute_slicing(lambda a, b, s: t(a, b, s), layers, stages, m)[0] == pytest.approx(
        sum(got.times_s) + (m - 1) * max(got.times_s)
    )


# -- cost tables -----------------------------------------------------------------------------------
def test_edge_costs_are_zero_when_layouts_agree_and_priced_by_collectives_otherwise():
    spec, g = traced("gpt-tiny", 8, ARGS)
    t = CostTables(g, CostModel.load("cpu", 2), FP32, Mesh2D((1, 2)), 1)
    fc, act = g.op("blocks_0_mlp_fc"), g.op("blocks_0_mlp_act")
    m = t.edge_costs(fc, act, "blocks_0_mlp_fc")
    sf, sa = t.strategies(fc), t.strategies(act)
    same = m[sf.index((None, "n")), sa.index((None, "a2"))]  # column-parallel fc feeds act its shard
    gather = m[sf.index((None, "n")), sa.index((None, None))]  # act wants the whole tensor
    partial = m[sf.index((None, "k")), sa.index((None, "a2"))]  # fc's partial sums reduce-scattered
    assert same == 0.0 and gather > 0 and partial > 0
    assert t.strategies(g.op("scaled_dot_product_attention"))  # heads and batch split; s, t, d frozen
    assert all(d in (None, "a0", "a1") for s in t.strategies(g.op("scaled_dot_product_attention")) for d in s)


def test_a_partial_gradient_over_the_data_parallel_replicas_is_reduced_once_a_step_at_its_weight():
    """GPT's position embedding, replicated, feeds a batch-split add: its gradient stays a partial
    sum over the replicas (no all-reduce per micro-batch on the edge, which was priced before), and
    the embedding's weight gradient is all-reduced once a step (planlab.plan.partial_grads)."""
    spec, g = traced("gpt-tiny", 8, ARGS)
    cost = CostModel.load("cpu", 2)
    t = CostTables(g, cost, FP32, Mesh2D((2, 1)), 2)
    wpe, add = g.op("wpe"), g.op("add")
    split = t.strategies(add).index((g.dim_with_label(add, g.batch_label), None))
    assert t.edge_costs(wpe, add, "wpe")[t.strategies(wpe).index((None, None)), split] == 0.0
    alone = CostTables(g, cost, FP32, Mesh2D((1, 1)), 2).node_costs(wpe)[0][0]  # the same compute
    reduce_s = t._collective_s("all_reduce", g.tensors["wpe.weight"].numel * FP32.grad_bytes, 0)
    assert reduce_s > 0
    assert t.node_costs(wpe)[0][t.strategies(wpe).index((None, None))] == pytest.approx(alone + reduce_s)


# -- plans -----------------------------------------------------------------------------------------
def _ctx(n):
    spec, g = traced("gpt-tiny", 8, ARGS)
    return Context(g, spec, 8, "cpu", n, n, 1)


@pytest.mark.parametrize("n", [2, 4])
def test_every_alpa_plan_materializes_and_simulates(n):
    ctx = _ctx(n)
    sp = get_space("alpa")
    knobs = sp.enumerate(ctx)
    assert len(knobs) >= 6
    split = False
    for k in knobs:
        plan = sp.build(ctx, k)
        draft = sp.draft(ctx, sp.with_defaults(k))
        split |= any(d is not None for ds in draft.dims.values() for d in ds)
        res = simulate(materialize(plan, ctx.graph), CostModel.load("cpu", n))
        assert res.iter_time_s > 0 and res.peak_mem_bytes > 0
    assert split  # the program splits some operators (not everything replicated)


def test_uneven_stages_follow_the_dp():
    """pp=2 on 2 devices: every operator's stage is its layer's stage in the DP's slicing."""
    ctx = _ctx(2)
    sol = alpa.solve(ctx, 2, 1, 4)
    draft = get_space("alpa").draft(ctx, dict(pp=2, tp=1, microbatch=2))
    L = alpa.layers_of(ctx.graph)
    for s in range(2):
        for i in range(sol.bounds[s], sol.bounds[s + 1]):
            assert {draft.stages[n] for n in L.blocks[i]} == {s}
    assert all(draft.stages[n] == 0 for n in L.pre) and all(draft.stages[n] == 1 for n in L.post)
    assert draft.num_stages == 2 and draft.microbatches == 4 and draft.schedule == "1f1b"


def _check_run(plan, n):
    res = launch_local(plan, n, steps=2, lr=1e-2)
    assert res.max_loss_error <= LOSS_TOL, (res.losses, res.ref_losses)
    assert res.max_grad_error <= GRAD_TOL
    assert res.losses[1] < res.losses[0]


@pytest.mark.parametrize(
    "n, knobs",
    [
        (2, dict(pp=1, tp=1, microbatch=4)),  # a one-axis mesh of 2: batch, sequence or heads per operator
        (2, dict(pp=2, tp=1, microbatch=2)),  # two uneven-capable stages, 1F1B over 4 micro-batches
    ],
)
def test_alpa_plans_match_one_process(n, knobs):
    ctx = _ctx(n)
    _check_run(get_space("alpa").build(ctx, knobs), n)


@pytest.mark.slow
def test_alpa_plan_on_a_2x2_mesh_and_two_stages_matches_one_process():
    ctx = _ctx(4)
    for knobs in (dict(pp=1, tp=2, microbatch=2), dict(pp=2, tp=1, microbatch=2)):
        _check_run(get_space("alpa").build(ctx, knobs), 4)


# -- errors ----------------------------------------------------------------------------------------
def test_impossible_knobs_are_config_errors_naming_space_knob_and_value():
    ctx = _ctx(4)
    sp = get_space("alpa")
    with pytest.raises(ConfigError, match=r"space 'alpa': knob 'pp' = 3 is outside its range: choose 1 or 2"):
        sp.build(ctx, dict(pp=3, tp=1, microbatch=1))
    with pytest.raises(ConfigError, match=r"tp=4 does not divide the 2 devices of a stage \(pp=2"):
        sp.build(ctx, dict(pp=2, tp=4, microbatch=1))
    with pytest.raises(ConfigError, match=r"dp=4 x microbatch=4 does not divide the global batch 8"):
        sp.build(ctx, dict(pp=1, tp=1, microbatch=4))
    with pytest.raises(
        ConfigError,
        match=r"tp=2 leaves dp=1, a one-axis mesh: with microbatch=4 it is the plan "
        r"of tp=1, microbatch=2",
    ):
        sp.build(ctx, dict(pp=2, tp=2, microbatch=4))
    assert sp.build(ctx, dict(pp=2, tp=2, microbatch=1)).num_devices == 4  # 8 micro-batches: no tp=1 twin
    with pytest.raises(ConfigError, match=r"space 'alpa' has no knob 'dp'"):
        sp.build(ctx, dict(dp=2))


def test_layers_out_of_order_are_refused():
    spec, g = traced("gpt-tiny", 8, ARGS)
    ops = list(g.operators)
    i = next(k for k, op in enumerate(ops) if op.module.startswith("blocks.1"))
    ops.insert(i + 1, ops.pop(i - 1))  # the last operator of layer 0 runs inside layer 1
    bad = type(g)(g.tensors, ops, g.inputs, g.loss, g.labels)
    with pytest.raises(ConfigError, match="space 'alpa': operator .* of layer 0 comes after"):
        alpa.layers_of(bad)


def test_swin_layers_of_several_kinds_and_the_merges_between_them():
    """swin-tiny: 6 layers in 3 stages of different widths, window-shifted every other layer, with a
    patch merging between stages: each kind of layer has its own solution, the merges theirs,
    and the plan simulates."""
    spec, g = traced("swin-tiny", 4)
    L = alpa.layers_of(g)
    assert len(L.blocks) == 6 and L.kind[0] != L.kind[2] != L.kind[4] and len(set(L.kind)) >= 3
    assert [bool(x) for x in L.glue] == [False, False, True, False, True, False]
    ctx = Context(g, spec, 4, "cpu", 2, 2, 1)
    plan = get_space("alpa").build(ctx, dict(pp=2, tp=1, microbatch=1))
    res = simulate(materialize(plan, g), CostModel.load("cpu", 2))
    assert res.iter_time_s > 0


def test_layer_solutions_trade_time_for_memory():
    """The representative layer's solutions: the fastest first, each further one smaller and no faster."""
    ctx = _ctx(4)
    sol = alpa.solutions(ctx, 2, 2, 2, 1)
    parts = sol.layers[0]
    assert len(parts) >= 2
    mems = [p.memory(1) for p in parts]
    times = [p.time_s for p in parts]
    assert mems == sorted(mems, reverse=True) and len(set(mems)) == len(mems)
    assert times[0] == min(times)


def test_a_device_too_small_for_any_slicing_gives_the_least_memory_plan(monkeypatch):
    """With a device of 1 MB nothing fits: the plan holds each stage's smallest solutions (the explorer's
    memory bound then rejects it) rather than failing the exploration."""
    import dataclasses

    ctx = _ctx(2)
    ctx = dataclasses.replace(ctx, graph=dataclasses.replace(ctx.graph))  # a copy: its own cache of solutions
    cost = CostModel.load("cpu", 2)
    node = cost.cluster.node
    small = dataclasses.replace(node, device=dataclasses.replace(node.device, memory_bytes=1e6))
    tiny = CostModel(dataclasses.replace(cost.cluster, node=small))
    monkeypatch.setattr(alpa, "_cost_of", lambda cluster, nodes: tiny)
    got = alpa.solve(ctx, 2, 1, 2)
    assert not got.fits
    smallest = min(range(len(got.solved.layers[0])), key=lambda p: got.solved.layers[0][p].memory(1))
    assert set(got.choice) == {smallest}
    assert get_space("alpa").build(ctx, dict(pp=2, tp=1, microbatch=1)).num_devices == 2


@pytest.mark.slow
def test_alpa_plan_of_a_swin_matches_one_process():
    """A Swin of three kinds of layers with patch merging between them, on a one-axis mesh of 2:
    the program splits about a third of the operators; one step's loss and gradients match one
    process (one step: Adam's first update magnifies the rounding of near-zero gradients)."""
    spec, g = traced("swin-tiny", 8, (("embed", 64), ("image", 64)))
    ctx = Context(g, spec, 8, "cpu", 2, 2, 1)
    sp = get_space("alpa")
    knobs = dict(pp=1, tp=1, microbatch=2)
    draft = sp.draft(ctx, sp.with_defaults(knobs))
    assert sum(any(d is not None for d in ds) for ds in draft.dims.values()) > len(g.operators) // 4
    res = launch_local(sp.build(ctx, knobs), 2, steps=1)
    assert res.max_loss_error <= LOSS_TOL and res.max_grad_error <= GRAD_TOL


def test_a_recycling_model_is_refused_saying_why():
    spec, g = traced("evoformer-tiny", 4, (("recycles", 2),))
    with pytest.raises(ConfigError, match="runs its layers more than once .*recycling Evoformer"):
        alpa.layers_of(g)
