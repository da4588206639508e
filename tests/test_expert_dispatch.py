"""Expert dispatch that sends a token once to each node (DeepEP, HybridEP, DeepSeek-V3's kernels):
the mean number of nodes a token's experts are on, by enumeration; the all-to-alls the pass marks;
the network share it prices; and DeepSeek-V3's node-limited routing token by token."""

import itertools
import math

import pytest
import torch

from planlab.costmodel.comm import collective_time_s
from planlab.costmodel.hardware import load_cluster
from planlab.costmodel.software import load_software
from planlab.errors import ConfigError
from planlab.models import ModelSpec
from planlab.models.deepseek import DeepSeekMoE
from planlab.plan import materialize
from planlab.plan.expert_dispatch import Routing, dedup_expert_dispatch, distinct_nodes, routing_of
from planlab.plan.program import TaskKind
from planlab.search_spaces import Context, get_space

from conftest import traced


def _enumerated(r: Routing, nodes: int) -> float:
    """The mean distinct nodes over every choice of groups and then of experts in them, each equally
    likely (experts in order on the nodes, groups in order over the experts)."""
    per_group, per_node = r.experts // r.groups, r.experts // nodes
    total, count = 0.0, 0
    for groups in itertools.combinations(range(r.groups), r.group_topk):
        pool = [e for g in groups for e in range(g * per_group, (g + 1) * per_group)]
        for chosen in itertools.combinations(pool, r.top_k):
            total += len({e // per_node for e in chosen})
            count += 1
    return total / count


@pytest.mark.parametrize(
    "routing, nodes",
    [
        (Routing(16, 4), 4),  # no group limit
        (Routing(16, 4, 8, 3), 4),  # two groups a node
        (Routing(16, 4, 4, 2), 4),  # a group a node (DeepSeek-V3's 8 of 8 at EP 64)
        (Routing(16, 3, 2, 1), 4),  # a group over two nodes
        (Routing(12, 2), 3),
    ],
)
def test_distinct_nodes_by_enumeration(routing, nodes):
    assert distinct_nodes(routing, nodes) == pytest.approx(_enumerated(routing, nodes), rel=1e-12)


def test_deepseek_v3_reaches_fewer_nodes_than_its_copies():
    """DeepSeek-V3 at EP 64 over 8 nodes: 8 copies reach about 3.6 nodes with its node-limited
    routing (at most 4, report section 2.1.2), 5.3 without; so 0.45 of the copies cross the network."""
    r = routing_of(traced("deepseek-v3", 1)[1])
    assert r == Routing(256, 8, 8, 4)
    assert 3.5 < distinct_nodes(r, 8) < 4 and 5.2 < distinct_nodes(Routing(256, 8), 8) < 5.4
    assert distinct_nodes(r, 1) == 1.0


def _ctx(n: int):
    spec, g = traced("deepseek-tiny", 8, (("route_groups", 4), ("route_group_topk", 2)))
    return Context(g, spec, 8, "cpu", n, n, 1)


def test_the_pass_marks_only_the_dispatch_and_combine_across_nodes():
    """ep 4 over two nodes of two devices: each dispatch and combine all-to-all and their gradients
    carry ``distinct nodes / top_k``; on one node, or without routed experts, nothing changes."""
    ctx = _ctx(4)
    plan = get_space("megatron").build(ctx, dict(dp=4, tp=1, pp=1, microbatch=1, ep=4))
    program = materialize(plan, ctx.graph)
    r = routing_of(ctx.graph)
    assert r == Routing(8, 2, 4, 2)
    marked = dedup_expert_dispatch(program, ctx.graph, lambda d: d // 2)
    for dev in marked.devices:
        tasks = [t for _, t in dev.tasks_in_order()]
        a2a = [t for t in tasks if t.kind is TaskKind.COLLECTIVE and t.collective == "all_to_all"]
        assert len(a2a) == 4 * 3 * plan.microbatches
        assert [t.node_share for t in a2a] == pytest.approx([distinct_nodes(r, 2) / 2] * len(a2a))
        assert all(t.node_share == 1.0 for t in tasks if t not in a2a)
    same = dedup_expert_dispatch(program, ctx.graph, lambda d: 0)
    assert all(t.node_share == 1.0 for dev in same.devices for _, t in dev.tasks_in_order())


def test_node_share_prices_the_network_part_only():
    """EP 64 over 8 DGX H100 nodes is NIC-bound: half the copies crossing takes about half the time;
    inside one node nothing crosses the network and the price does not move."""
    c = load_cluster("dgx-h100", 8)
    nbytes = 256 * 2**20
    full = collective_time_s(c, "all_to_all", nbytes, tuple(range(64)))
    half = collective_time_s(c, "all_to_all", nbytes, tuple(range(64)), node_share=0.5)
    assert 0.45 < half / full < 0.55
    inside = tuple(range(8))
    assert collective_time_s(c, "all_to_all", nbytes, inside, node_share=0.5) == collective_time_s(
        c, "all_to_all", nbytes, inside
    )


def test_software_names_its_dispatch():
    assert load_software("megatron").expert_dispatch == "all_to_all"
    assert load_software("megatron-hybridep").expert_dispatch == "node_dedup"
    hai = load_software("hai-llm")
    assert hai.expert_dispatch == "node_dedup" and hai.precision("fp8").optimizer_bytes == 8


def test_bad_dispatch_value_is_one_line(tmp_path):
    p = tmp_path / "sw.json"
    p.write_text('{"name": "x", "base": "megatron", "expert_dispatch": "fast"}')
    with pytest.raises(ConfigError, match=r"expert_dispatch.*'fast'.*all_to_all.*node_dedup"):
        load_software(str(p))


def test_node_limited_routing_token_by_token():
    """The experts chosen come from the best ``route_group_topk`` groups by the sum of their two best
    affinities, and are the best ``top_k`` of those (the released modeling_deepseek.py)."""
    cfg = ModelSpec("deepseek-tiny", (("route_groups", 4), ("route_group_topk", 2))).config()
    torch.manual_seed(0)
    moe = DeepSeekMoE(cfg)
    x = torch.randn(2, cfg.seq, cfg.hidden)
    got = {}
    import planlab.models.deepseek as ds

    real = ds.route_to_experts

    def spy(x, top_i, *args, **kw):
        got["top_i"] = top_i
        return real(x, top_i, *args, **kw)

    ds.route_to_experts = spy
    try:
        moe(x)
    finally:
        ds.route_to_experts = real
    scores = torch.sigmoid(moe.gate(x))
    per = cfg.experts // cfg.route_groups
    for b, s in itertools.product(range(2), range(cfg.seq)):
        row = scores[b, s]
        best = row.view(cfg.route_groups, per).topk(2, dim=-1)[0].sum(-1).topk(cfg.route_group_topk)[1]
        pool = torch.cat([torch.arange(g * per, (g + 1) * per) for g in best.tolist()])
        want = pool[row[pool].topk(cfg.top_k)[1]]
        assert sorted(got["top_i"][b, s].tolist()) == sorted(want.tolist())


def test_bad_route_groups():
    with pytest.raises(ConfigError, match=r"^route_groups=3 must divide experts=8"):
        ModelSpec("deepseek-tiny", (("route_groups", 3),)).config()
    with pytest.raises(ConfigError, match=r"^route_group_topk=1 groups of 1 experts hold fewer than top_k=2"):
        ModelSpec("deepseek-tiny", (("route_groups", 8), ("route_group_topk", 1))).config()


def test_fused_permutation_leaves_the_scatter_gather_and_experts():
    """Under a fused permutation the routing's copies, products and sums around the dispatch's scatter
    and the combine's gather run inside their kernels (no time of their own), forward and backward;
    the scatter, the gather and the experts' GEMMs keep their own tasks."""
    from planlab.plan.expert_dispatch import fuse_token_permutation, permutation_ops

    ctx = _ctx(2)
    g = ctx.graph
    plan = get_space("megatron").build(ctx, dict(dp=2, tp=1, pp=1, microbatch=1, ep=2))
    program = fuse_token_permutation(materialize(plan, g), g)
    ops = permutation_ops(g)
    kinds = {op.name: op.kind for op in g.operators}
    assert {kinds[n] for n in ops} <= {"expand", "reshape", "transpose", "mul", "fill_like", "getitem", "sum"}
    assert len([n for n in ops if kinds[n] == "mul"]) == 2 * 3  # the kept copies and the routing weights, 3 layers
    tasks = [t for dp in program.devices for _, t in dp.tasks_in_order()]
    inside = [t for t in tasks if t.in_kernel]
    assert inside and {t.kind for t in inside} <= {TaskKind.FORWARD, TaskKind.BACKWARD, TaskKind.LOCAL}
    computing = [t for t in tasks if t.kind in (TaskKind.FORWARD, TaskKind.BACKWARD)]
    for t in computing:
        assert t.in_kernel == (t.op in ops)
        if kinds.get(t.op) in ("scatter", "gather", "matmul", "activation"):
            assert not t.in_kernel


def test_fused_permutation_moves_each_copy_once():
    """The dispatch's scatter and the combine's gather stand for Transformer Engine's fused permute and
    unpermute (forward and backward): top_k copies of each token written (read) once, the token read
    (written) once, an int32 row-map entry a copy; unfused, PyTorch's scatter_add and gather also read the
    empty buffer and the expanded int64 index, several times as much. Other tasks keep their bytes."""
    from planlab.plan.expert_dispatch import fuse_token_permutation, fused_permute_bytes, permutation_kernels

    ctx = _ctx(2)
    g = ctx.graph
    r = routing_of(g)
    plan = get_space("megatron").build(ctx, dict(dp=2, tp=1, pp=1, microbatch=1, ep=2))
    before = materialize(plan, g)
    after = fuse_token_permutation(before, g)
    kinds = {op.name: op.kind for op in g.operators}
    kernels = permutation_kernels(g)
    assert {kinds[n] for n in kernels} == {"scatter", "gather"} and len(kernels) == 2 * 3  # one each, 3 layers
    eb = before.precision.activation_bytes
    moved = set()
    for d0, d1 in zip(before.devices, after.devices):
        for (_, t0), (_, t1) in zip(d0.tasks_in_order(), d1.tasks_in_order()):
            if t0.op in kernels and t0.kind in (TaskKind.FORWARD, TaskKind.BACKWARD):
                copies = math.prod(t0.shapes[1])
                want = copies * eb + copies // r.top_k * eb + copies // t0.shapes[1][-1] * 4
                assert t1.bytes_moved == pytest.approx(want) == fused_permute_bytes(t0.shapes, r.top_k, eb)
                assert t1.bytes_moved < t0.bytes_moved / 2
                moved.add((d0.device, t0.op, t0.kind))
            else:
                assert t1.bytes_moved == t0.bytes_moved
    # on every device the scatter and the gather of the 3 layers, forward and backward
    assert len(moved) == 2 * 3 * 2 * len(before.devices)
