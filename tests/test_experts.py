"""DeepSeek-V3-style models and expert parallelism: the preset against DeepSeek's published
counts, DeepSeekMoE's routing against a token-by-token reference, tensor-parallel splits of
latent attention, the ep/etp knobs and their errors, all-to-all prices worked out by hand, and
expert-parallel plans on 2 and 4 gloo ranks against one process."""

import pytest
import torch
import torch.nn.functional as F

from planlab.cli import LOSS_TOL
from planlab.costmodel.comm import Placement, all_to_all_traffic, collective_time_s
from planlab.costmodel.hardware import ClusterSpec, Network, load_cluster
from planlab.errors import ConfigError
from planlab.executor import launch_local
from planlab.models import ModelSpec, build_model
from planlab.models.deepseek import DeepSeekConfig, DeepSeekMoE
from planlab.models.registry import DEEPSEEK_PRESETS
from planlab.plan import Layout, Mesh, Shard
from planlab.plan.buffer import activation
from planlab.plan.redistribute import plan_conversion
from planlab.search_spaces import Context, get_space
from planlab.search_spaces.builtin import tensor_parallel_dims
from planlab.search_spaces.experts import expert_dims, num_experts

from conftest import all_to_alls, traced
from test_costmodel import GB, TOY_NODE

# ---- the preset against DeepSeek's published sizes -----------------------------------------


def test_deepseek_v3_preset_is_the_published_shape():
    """DeepSeek-V3 technical report (arXiv:2412.19437) section 4.2 and the released config.json."""
    c = DEEPSEEK_PRESETS["deepseek-v3"]
    assert (c.layers, c.dense_layers, c.hidden, c.heads, c.vocab) == (61, 3, 7168, 128, 129280)
    assert (c.experts, c.shared_experts, c.top_k, c.moe_ffn_hidden, c.ffn_hidden) == (256, 1, 8, 2048, 18432)
    assert (c.q_lora_rank, c.kv_lora_rank, c.rope_head_dim, c.nope_head_dim, c.v_head_dim) == (1536, 512, 64, 128, 128)
    # "671B total parameters with 37B activated for each token" (report, abstract); the released
    # weights' README_WEIGHTS.md: 36.6B activated, counting the 0.9B output head but not the embedding
    assert abs(c.num_params() - 671e9) / 671e9 < 0.001
    assert abs(c.active_params() - c.vocab * c.hidden - 36.6e9) / 36.6e9 < 0.005
    # one MLA layer: wq_a + q_norm + wq_b + wkv_a + kv_norm + wkv_b + wo
    mla = 7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * (512 + 64) + 512 + 512 * 128 * 256 + 128 * 128 * 7168
    assert c.attention_params() == mla


def test_deepseek_tiny_traces_whole_with_its_parameters():
    spec, g = traced("deepseek-tiny", 4)
    model, _ = build_model(spec, batch=1)
    assert not g.unknown
    assert g.num_params == sum(p.numel() for p in model.parameters()) == spec.config().num_params()
    kinds = [op.kind for op in g.operators]
    moe_layers = spec.config().layers - spec.config().dense_layers
    assert kinds.count("topk") == kinds.count("scatter") == moe_layers
    assert num_experts(g) == 8
    # the experts' axis: from the dispatch's unflatten to the combine's flatten, 11 operators a layer
    assert len(expert_dims(g)) == 11 * moe_layers


@pytest.mark.slow
def test_deepseek_v3_traces_on_meta():
    spec, g = traced("deepseek-v3", 1)
    assert not g.unknown and g.num_params == spec.config().num_params()


# ---- DeepSeekMoE's routing against a token-by-token reference -------------------------------


def _reference(moe: DeepSeekMoE, x: torch.Tensor) -> torch.Tensor:
    """Sigmoid affinities, top-k chosen with the bias, weights normalised and scaled; a
    sequence's assignments queue for their expert, first choices first, past the capacity dropped;
    the shared expert on every token."""
    E, K, C = moe.num_experts, moe.top_k, moe.capacity
    w1, w3, w2 = moe.experts.w1, moe.experts.w3, moe.experts.w2
    s = torch.sigmoid(moe.gate(x))
    top_i = torch.topk(s + moe.gate_bias, K, dim=-1)[1]
    top_s = s.gather(-1, top_i)
    weight = top_s / top_s.sum(-1, keepdim=True) * moe.scale
    y = moe.shared_experts(x).clone()
    for b in range(x.shape[0]):
        taken = [0] * E
        for k in range(K):
            for t in range(x.shape[1]):
                e = int(top_i[b, t, k])
                if taken[e] < C:
                    y[b, t] += weight[b, t, k] * ((F.silu(x[b, t] @ w1[e]) * (x[b, t] @ w3[e])) @ w2[e])
                taken[e] += 1
    return y


@pytest.mark.parametrize("capacity_factor, dropped", [(4.0, False), (0.5, True)])
def test_deepseek_routing_matches_the_reference(capacity_factor, dropped):
    cfg = DeepSeekConfig(
        layers=1, dense_layers=0, hidden=16, heads=2, ffn_hidden=32, moe_ffn_hidden=8, experts=8, shared_experts=1,
        top_k=2, q_lora_rank=8, kv_lora_rank=8, rope_head_dim=4, nope_head_dim=4, v_head_dim=4, seq=12, vocab=32,
        capacity_factor=capacity_factor,
    )  # fmt: skip
    torch.manual_seed(0)
    moe = DeepSeekMoE(cfg)
    moe.gate_bias.copy_(torch.randn(8) * 0.1)  # the balancing bias steers the choice, not the weights
    x = torch.randn(3, cfg.seq, cfg.hidden)
    y, aux = moe(x)
    assert torch.allclose(y, _reference(moe, x), atol=1e-5)
    assert aux.shape == (3,) and (aux > 0).all()
    assert (cfg.capacity < cfg.seq) == dropped


def test_tensor_parallel_splits_latent_attention_like_megatron_core():
    _, g = traced("deepseek-tiny", 8)
    dims = tensor_parallel_dims(g)
    by_module = {op.module: dims[op.name] for op in g.operators if op.kind == "linear"}
    a, f = "blocks.1.attention.", "blocks.1.feed_forward."
    assert [by_module[a + m] for m in ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo")] == [None, "n", None, "n", "k"]
    assert [by_module[f + "shared_experts." + m] for m in ("w1", "w3", "w2")] == ["n", "n", "k"]
    assert by_module[f + "gate"] is None and by_module["blocks.0.feed_forward.w2"] == "k"


# ---- the ep and etp knobs ----------------------------------------------------------------


def _ctx(name: str, n: int):
    spec, g = traced(name, 8)
    return Context(g, spec, 8, "cpu", n, n, 1)


@pytest.mark.parametrize(
    "name, n, knobs, message",
    [
        ("deepseek-tiny", 2, dict(dp=2, ep=3), "ep=3 does not divide the model's 8 experts; choose 1, 2"),
        ("deepseek-tiny", 4, dict(dp=4, tp=1, ep=4), None),
        ("gpt-tiny", 2, dict(dp=2, tp=1, ep=2), "ep=2 splits routed experts, and the model gpt-tiny has none"),
        ("deepseek-tiny", 4, dict(dp=2, tp=2, ep=4, etp=2), "ep=4 takes 4 data-parallel replicas"),
        ("deepseek-tiny", 4, dict(dp=2, tp=2, ep=1, etp=1), "ep=1 with etp=1 and tp=2"),
        ("deepseek-tiny", 4, dict(dp=1, tp=4, ep=4, etp=2), "etp=2: planlab runs etp=tp=4"),
    ],
)
def test_ep_knob_values_that_do_not_fit(name, n, knobs, message):
    ctx = _ctx(name, n)
    full = dict(dp=1, tp=1, pp=1, microbatch=1, **{k: v for k, v in knobs.items() if k not in ("dp", "tp")})
    full.update(dp=knobs["dp"], tp=knobs.get("tp", 1))
    got = get_space("megatron").explain(ctx, full)
    assert (not got) if message is None else message in got, got


def test_ep_does_not_divide_the_experts_names_what_fits():
    spec, g = traced("deepseek-tiny", 8, (("experts", 6),))
    ctx = Context(g, spec, 8, "cpu", 4, 4, 1)
    got = get_space("megatron").explain(ctx, dict(dp=4, tp=1, pp=1, microbatch=1, ep=4))
    assert got == "ep=4 does not divide the model's 6 experts; choose 1, 2", got


def test_ep_splits_the_experts_and_leaves_the_rest_batch_split():
    ctx = _ctx("deepseek-tiny", 4)
    plan = get_space("megatron").build(ctx, dict(dp=4, tp=1, pp=1, microbatch=1, ep=2))
    experts = expert_dims(ctx.graph)
    batch = ctx.graph.batch_label
    ops = {p.op: p for p in plan.ops}
    for op in ctx.graph.operators:
        p = ops[op.name]
        assert p.sizes[:2] == (2, 2)
        if op.name in experts:  # the batch over 2 (dp / ep), then the experts over 2
            assert ctx.graph.dim_label(op, p.dims[0]) == batch and p.dims[1] == experts[op.name], op.name
        elif p.dims[0] is not None:
            assert p.dims[0] == p.dims[1]  # the batch over both axes: dp = 4 replicas for the attention


# ---- all-to-all prices by hand ----------------------------------------------------------
# the toy node of test_costmodel: 4 devices, NVLink 100 GB/s and 2 us a step, NIC 10 GB/s and 5 us


@pytest.mark.parametrize(
    "placement, rail, traffic",
    [
        (Placement(4, 1, 4, 4), True, (3 / 4, 0.0)),  # one node: peers only
        (Placement(8, 2, 4, 4), False, (3 / 8, 4 / 8)),  # plain fat tree: no relay
        (Placement(8, 2, 4, 4, rails=True), True, (3 / 8 + 4 / 8 * 3 / 4, 4 / 8)),  # PXN relays 3 of 4 rails
        (Placement(2, 2, 1, 1, rails=False), True, (1 / 2, 1 / 2)),  # other local ranks: all relayed
    ],
)
def test_all_to_all_traffic(placement, rail, traffic):
    assert all_to_all_traffic(placement, rail) == pytest.approx(traffic)


@pytest.mark.parametrize(
    "network, group, seconds",
    [
        # 4 nodes under 2 leaves at 4:1; 16 ranks: 15 x 5 us + the NIC's 12/16 GB
        (Network(nodes_per_switch=2, oversubscription=4.0), tuple(range(16)), 75e-6 + 0.75 / (10 / 4)),
        # the same on rails: nothing crosses the spine, so no oversubscription
        (Network("rail_optimized", 2, 4.0), tuple(range(16)), 75e-6 + 0.75 / 10),
        # one rank per node on different local ranks: NVLink carries the relayed half, the NIC the other
        (Network("rail_optimized"), (0, 5), 5e-6 + 0.5 / 10),
    ],
)
def test_all_to_all_by_hand(network, group, seconds):
    c = ClusterSpec(TOY_NODE, nodes=4, network=network)
    assert collective_time_s(c, "all_to_all", GB, group) == pytest.approx(seconds, rel=1e-12)


def test_all_to_all_across_dgx_h100_nodes_runs_near_the_nic():
    """EP 64 over 8 DGX H100 nodes: the bytes leaving each GPU at 0.8-0.95 of its 50 GB/s NIC for
    a 256 MiB buffer (DeepEP measures 43-51 GB/s at EP 16-64 on H800 with the same NICs); inside
    one node NVLink moves it several times faster."""
    c = load_cluster("dgx-h100", 8)
    nbytes = 256 * 2**20
    t = collective_time_s(c, "all_to_all", nbytes, tuple(range(64)))
    assert 0.8 < (56 / 64 * nbytes / t) / 50e9 < 0.95
    assert collective_time_s(c, "all_to_all", nbytes, tuple(range(8))) < t / 4


def test_bad_model_arguments_of_the_family():
    with pytest.raises(ConfigError, match=r"^dense_layers=5 must be between 0 and layers=4"):
        ModelSpec("deepseek-tiny", (("dense_layers", 5),)).config()
    with pytest.raises(ConfigError, match=r"^rope_head_dim=3 must be even"):
        ModelSpec("deepseek-tiny", (("rope_head_dim", 3),)).config()


# ---- expert-parallel plans on gloo match one process -------------------------------------


@pytest.mark.parametrize(
    "name, knobs",
    [
        ("deepseek-tiny", dict(dp=2, tp=1, ep=2)),
        # etp 1: the experts split over the tensor-parallel ranks, the tokens over them along the hidden size
        ("moe-tiny", dict(dp=1, tp=2, ep=2, etp=1)),
    ],
    ids=["ep2", "tp2-ep2-etp1"],
)
def test_expert_parallel_plan_on_2_ranks_matches_one_process(name, knobs):
    ctx = _ctx(name, 2)
    plan = get_space("megatron").build(ctx, dict(pp=1, microbatch=2, **knobs))
    res = launch_local(plan, 2, steps=2, lr=1e-2)
    assert res.max_loss_error <= LOSS_TOL, (res.losses, res.ref_losses)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, knobs",
    [
        # Megatron-Bridge's DeepSeek-V3 layout: tp x ep with expert TP 1 and sequence parallelism, whose
        # dispatch and combine are one all-to-all over the 4 ranks each
        ("deepseek-tiny", dict(dp=2, tp=2, ep=4, etp=1, sequence_parallel=True)),
        ("moe-tiny", dict(dp=4, tp=1, ep=2)),
    ],
    ids=["etp1", "edp2"],
)
def test_expert_parallel_plans_on_4_ranks_match_one_process(name, knobs):
    ctx = _ctx(name, 4)
    plan = get_space("megatron").build(ctx, dict(pp=1, microbatch=2, **knobs))
    res = launch_local(plan, 4, steps=2, lr=1e-2)
    assert res.max_loss_error <= LOSS_TOL, (res.losses, res.ref_losses)


# ---- the executor's all-to-all on gloo -----------------------------------------------------


# (mesh shape, source placements, destination placements) on a (batch, experts, hidden) tensor
_EXPERTS_NESTED = (Shard(1), Shard(1))  # the experts over ep, and over tp inside it (etp 1)
_EXCHANGES = {
    "batch-to-experts": ((2,), (Shard(0),), (Shard(1),)),
    # ep x tp, the tokens' hidden size split over tp: one all-to-all over the 4 ranks each way
    "dispatch-ep-tp": ((2, 2), (Shard(0), Shard(2)), _EXPERTS_NESTED),
    "combine-ep-tp": ((2, 2), _EXPERTS_NESTED, (Shard(0), Shard(2))),
}


def _one_exchange(case: str, group: tuple[int, ...]):
    """The mesh (``group`` in mesh order), the layouts and the one all-to-all the planner makes for ``case``."""
    shape, src, dst = _EXCHANGES[case]
    mesh = Mesh(shape, group)
    a, b = Layout(mesh, src), Layout(mesh, dst)
    conv = plan_conversion(a, b, (8, 8, 4), 4, src_buf=activation("x"), dst_buf=activation("y", 0))
    assert conv.kinds == ["all_to_all"] and not conv.src
    return a, b, {d: ts[0] for d, ts in conv.dst.items()}


def _exchange_rank(rank: int, world: int, path: str, case: str, group: tuple[int, ...], out) -> None:
    import torch.distributed as dist

    from planlab.executor.all_to_all import exchange

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    src, dst, tasks = _one_exchange(case, group)
    whole = torch.arange(8 * 8 * 4.0).reshape(8, 8, 4)  # (batch, experts, hidden)
    pos = group.index(rank)  # the mesh order may differ from the ranks' order
    mine = whole[tuple(slice(*r) for r in src.box(pos, whole.shape))]
    task = tasks[rank]
    got = exchange(mine, task.group, rank, task.exchange, task.shape, dist.new_group(sorted(group)))
    out.put((rank, torch.equal(got, whole[tuple(slice(*r) for r in dst.box(pos, whole.shape))])))
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "case, group",
    [("batch-to-experts", (1, 0)), ("dispatch-ep-tp", (2, 0, 3, 1)), ("combine-ep-tp", (0, 1, 2, 3))],
)
def test_all_to_all_exchange_on_gloo(case, group, tmp_path):
    """torch.distributed.all_to_all_single runs on gloo: each rank's piece of the source layout
    becomes its piece of the destination's, over one mesh axis or, in one all-to-all, over two."""
    ctx = torch.multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_exchange_rank, args=(r, len(group), str(tmp_path / "store"), case, group, out))
        for r in range(len(group))
    ]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join()
    assert results == {r: True for r in group}


def test_dispatch_over_ep_and_tp_sends_each_rank_its_own_share():
    """A dispatch whose tokens are split over tp along the hidden size is one all-to-all over the
    ep x tp ranks moving a quarter of the buffer each (not the half of a tp-replicated buffer)."""
    for case in ("dispatch-ep-tp", "combine-ep-tp"):
        _, _, tasks = _one_exchange(case, (0, 1, 2, 3))
        assert {t.group for t in tasks.values()} == {(0, 1, 2, 3)}
        assert {t.nbytes for t in tasks.values()} == {8 * 8 * 4 * 4 // 4}
    _, _, tasks = _one_exchange("dispatch-ep-tp", (0, 1, 2, 3))
    assert [str(a) for a in tasks[0].exchange] == ["2:1->0", "2:1->2"]


def test_dispatch_and_combine_are_all_to_all_collectives():
    """An EP plan's Program moves tokens by all-to-all over the expert-parallel groups, in the
    forward (dispatch, combine) and in the backward (their gradients), and sends nothing."""
    from planlab.plan import materialize

    ctx = _ctx("deepseek-tiny", 4)
    plan = get_space("megatron").build(ctx, dict(dp=4, tp=1, pp=1, microbatch=1, ep=2))
    program = materialize(plan, ctx.graph)
    moe_layers = 3
    for dev in program.devices:
        a2a = all_to_alls(dev)
        # per micro-batch and MoE layer: dispatch and combine, and both again for the gradients
        assert len(a2a) == 4 * moe_layers * plan.microbatches
        assert {len(t.group) for t in a2a} == {2} and all(t.ident >= 0 for t in a2a)


def test_tp_by_ep_dispatch_sends_each_rank_its_own_share():
    """tp 2 x ep 4 with expert TP 1 and sequence parallelism (Megatron-Bridge's DeepSeek-V3 layout):
    each dispatch and combine (and their gradients) is one all-to-all over the 4 ranks of the ep x tp
    group moving the rank's own half of its sequences' slot buffer, as Megatron-Core's dispatcher
    sends each rank's own tokens; never the whole buffer a tensor-parallel rank pair both hold."""
    from planlab.plan import materialize

    ctx = _ctx("deepseek-tiny", 4)
    plan = get_space("megatron").build(ctx, dict(dp=2, tp=2, pp=1, microbatch=1, ep=4, etp=1, sequence_parallel=True))
    cfg = ctx.config
    slots_bytes = cfg.experts * cfg.capacity * cfg.hidden * 4  # one sequence's (E*C, H) fp32: a micro-batch's per rank
    program = materialize(plan, ctx.graph)
    for dev in program.devices:
        ep_tp = [t for t in all_to_alls(dev) if len(t.group) == 4]
        assert len(ep_tp) == 4 * 3 * plan.microbatches
        assert {t.nbytes for t in ep_tp} == {slots_bytes // 2}


def test_a_saved_broadcast_view_keeps_only_the_storage_under_it():
    """The dispatch's ``scatter_add`` and the combine's ``gather`` keep their index, the routing's slot
    numbers expanded to the hidden size (``Tensor.expand``, a view): the bound, the screen and the
    Program keep the ``tokens x top-k`` integers under the view, not ``x hidden`` of them."""
    from planlab.plan import TaskKind, materialize
    from planlab.costmodel.precision import MIXED_BF16
    from planlab.plan.saved import saved_activations, view_of
    from planlab.search_spaces.screen_structure import Tables

    ctx = _ctx("deepseek-tiny", 2)
    g = ctx.graph
    plan = get_space("megatron").build(ctx, dict(dp=2, ep=2, microbatch=2))
    plans = {p.op: p for p in plan.ops}
    kept = [(op, t) for op in g.operators for t in op.saves if view_of(t, g) is not None]
    views = {t: view_of(t, g) for _, t in kept}
    assert {op.kind for op, _ in kept} == {"scatter", "gather"} and {v.kind for v in views.values()} == {"expand"}
    for op, t in kept:
        base = views[t].inputs[0]
        assert g.tensors[base].numel * g.tensors[t].shape[-1] == g.tensors[t].numel  # the hidden size is broadcast
        got = saved_activations(op, plans[op.name], g, None, MIXED_BF16, plan.microbatches, plans)
        assert [k[0] for k, _ in got] == [base]
    screen = Tables(g, MIXED_BF16)
    names = {op.name: screen.save_names[i] for i, op in enumerate(g.operators)}
    assert all(views[t].inputs[0] in names[op.name] and t not in names[op.name] for op, t in kept)
    prog = materialize(plan, g)
    tasks = [t for dp in prog.devices for b in dp.blocks.values() for t in b.tasks if t.kind is TaskKind.FORWARD]
    saved = {b.tensor for t in tasks if t.op in {op.name for op, _ in kept} for b in t.saved}
    assert not saved & set(views) and {v.inputs[0] for v in views.values()} <= saved


def test_the_experts_matmuls_are_marked_as_matmuls_with_a_weight():
    """The experts' GEMMs (matmuls over the stacked expert weights) carry ``weight_matmul`` forward and
    backward, so that a software with ``fp8_weight_matmuls`` runs them in FP8; the attention's and the
    router's products and the linear layers do not."""
    from planlab.plan import TaskKind, materialize
    from planlab.search_spaces.experts import EXPERT_WEIGHTS

    ctx = _ctx("deepseek-tiny", 2)
    g = ctx.graph
    plan = get_space("megatron").build(ctx, dict(dp=2, ep=2, microbatch=2))
    prog = materialize(plan, g)
    experts = {
        op.name for op in g.operators if op.kind == "matmul" and any(EXPERT_WEIGHTS.search(t) for t in op.inputs)
    }
    assert experts
    for kind in (TaskKind.FORWARD, TaskKind.BACKWARD):
        tasks = [t for dp in prog.devices for b in dp.blocks.values() for t in b.tasks if t.kind is kind and t.op]
        marked = {t.op for t in tasks if t.weight_matmul}
        assert marked == experts
