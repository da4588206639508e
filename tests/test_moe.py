"""The mixture-of-experts family: preset sizes against Mistral AI's published counts, routing
against a plain reference, the routing operators' signatures and their pieces, and data-,
tensor- and expert-parallel plans on 2 gloo ranks."""

import resource
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from planlab.cli import GRAD_TOL, LOSS_TOL, main
from planlab.errors import ConfigError
from planlab.executor import launch_local
from planlab.executor.pieces import run_piece
from planlab.graph import ops_routing, trace
from planlab.graph.registry import OpContext, lookup
from planlab.models import MOE_PRESETS, ModelSpec, MoEConfig, build_model
from planlab.models.moe import SparseMoE
from planlab.plan.plan import PlanBuilder
from planlab.plan.program import Task, TaskKind
from planlab.search_spaces import Context, get_space
from planlab.search_spaces.builtin import tensor_parallel_dims

from conftest import traced

# Total and active (per token) parameters as Mistral AI announced them: "Mixtral has 46.7B total
# parameters but only uses 12.9B parameters per token" (mistral.ai/news/mixtral-of-experts, Dec.
# 2023); Mixtral 8x22B uses "only 39B active parameters out of 141B" (mistral.ai/news/mixtral-8x22b,
# Apr. 2024).
PUBLISHED = {
    "mixtral-8x7b": (46.7e9, 12.9e9),
    "mixtral-8x22b": (141e9, 39e9),
}


@pytest.mark.parametrize("preset, total, active", [(p, t, a) for p, (t, a) in sorted(PUBLISHED.items())])
def test_preset_parameter_counts_match_published(preset, total, active):
    cfg = MOE_PRESETS[preset]
    assert abs(cfg.num_params() - total) / total < 0.01
    assert abs(cfg.active_params() - active) / active < 0.01


def test_module_parameter_count_is_the_config_count():
    spec, g = traced("moe-tiny", 8)
    model, _ = build_model(spec, batch=1)
    assert g.num_params == sum(p.numel() for p in model.parameters()) == spec.config().num_params()


def test_mixtral_8x22b_traces_on_meta():
    t0 = time.perf_counter()
    spec, g = traced("mixtral-8x22b", 8)
    seconds = time.perf_counter() - t0
    rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"mixtral-8x22b: traced in {seconds:.1f} s, peak RSS {rss_gib:.2f} GiB, {len(g.operators)} operators")
    cfg = spec.config()
    assert g.num_params == cfg.num_params()
    assert not g.unknown
    kinds = [op.kind for op in g.operators]
    assert kinds.count("topk") == kinds.count("scatter") == kinds.count("gather") == cfg.layers
    experts = [op for op in g.operators if op.module.endswith("feed_forward.experts") and op.kind == "matmul"]
    assert len(experts) == 3 * cfg.layers
    # (E, B*C, H) x (E, H, F): every expert takes `capacity` tokens of each of the 8 sequences
    assert experts[0].dim_sizes == {"a0": 8, "m": 8 * cfg.capacity, "k": 6144, "n": 16384}


def test_every_operator_splits_but_the_scalar_loss_sums():
    """Nothing is kept whole: each operator splits along some dimension (the batch, for all
    but the few scalar additions that assemble the loss)."""
    _, g = traced("moe-tiny", 8)
    assert not g.unknown
    whole = [op for op in g.operators if not op.splittable_dims()]
    assert whole and all(g.tensors[op.outputs[0]].shape == () for op in whole)
    batch = [op for op in g.operators if g.dim_with_label(op, g.batch_label) in op.splittable_dims()]
    assert len(batch) + len(whole) == len(g.operators)


@pytest.mark.parametrize("coef, loss_kind", [(0.02, "add"), (0.0, "cross_entropy")])
def test_the_balancing_loss_is_added_only_when_weighed(coef, loss_kind):
    _, g = traced("moe-tiny", 4, (("aux_loss_coef", coef),))
    assert g.producer[g.loss].kind == loss_kind
    assert (sum(op.kind == "one_hot" for op in g.operators), sum(op.kind == "sum" for op in g.operators)) == (
        2,
        13 if coef else 6,
    )  # per layer 3 (weights, queue positions, over k), the loss 3 more, then its total


# ---- routing against a plain reference -------------------------------------------------


def _reference(moe: SparseMoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token: top-k experts, renormalised weights; a sequence's assignments queue for
    their expert first choices first, and those past the capacity are dropped."""
    E, K, C = moe.num_experts, moe.top_k, moe.capacity
    w1, w3, w2 = moe.experts.w1, moe.experts.w3, moe.experts.w2
    probs = F.softmax(moe.gate(x), dim=-1)  # (B, S, E)
    top_p, top_i = torch.topk(probs, K, dim=-1)
    weight = top_p / top_p.sum(-1, keepdim=True)
    y = torch.zeros_like(x)
    aux = torch.zeros(x.shape[0])
    for b in range(x.shape[0]):
        taken = [0] * E
        for k in range(K):
            for s in range(x.shape[1]):
                e = int(top_i[b, s, k])
                if taken[e] < C:
                    h = F.silu(x[b, s] @ w1[e]) * (x[b, s] @ w3[e])
                    y[b, s] += weight[b, s, k] * (h @ w2[e])
                taken[e] += 1
        routed = torch.stack([(top_i[b] == e).sum() for e in range(E)]).float() / x.shape[1]
        aux[b] = E * (routed * probs[b].mean(0)).sum()
    return y, aux


@pytest.mark.parametrize("capacity_factor, dropped", [(2.0, False), (0.5, True)])
def test_routing_matches_the_reference(capacity_factor, dropped):
    cfg = MoEConfig(
        layers=1,
        hidden=16,
        heads=2,
        kv_heads=2,
        ffn_hidden=24,
        experts=4,
        top_k=2,
        seq=12,
        vocab=32,
        capacity_factor=capacity_factor,
    )
    torch.manual_seed(0)
    moe = SparseMoE(cfg)
    x = torch.randn(3, cfg.seq, cfg.hidden)
    y, aux = moe(x)
    y_ref, aux_ref = _reference(moe, x)
    assert torch.allclose(y, y_ref, atol=1e-5) and torch.allclose(aux, aux_ref, atol=1e-6)
    assert cfg.capacity == (cfg.seq if not dropped else 3)
    top_i = torch.topk(moe.gate(x), cfg.top_k, dim=-1)[1]
    assert (F.one_hot(top_i, cfg.experts).sum((1, 2)) > cfg.capacity).any() == dropped


# ---- signatures ------------------------------------------------------------------------


def _sig(target, kind: str, args: tuple, kwargs: dict | None = None) -> str:
    """Signature of one call, read by the registry from the shapes the call produces."""
    kwargs = kwargs or {}
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    out = getattr(args[0], target)(*args[1:], **kwargs) if isinstance(target, str) else target(*args, **kwargs)
    outs = tuple(out) if isinstance(out, tuple) else (out,)
    tmpl = tuple("T" if isinstance(a, torch.Tensor) else a for a in args)
    ctx = OpContext(tuple(tuple(t.shape) for t in tensors), tuple(tuple(o.shape) for o in outs), tmpl, kwargs)
    d = lookup("call_method" if isinstance(target, str) else "call_function", target)
    assert d is not None and d.kind == kind
    return str(d.signature(ctx))


x3 = torch.zeros(2, 5, 4, device="meta")
i3 = torch.zeros(2, 5, 4, dtype=torch.long, device="meta")
i2 = torch.zeros(2, 3, dtype=torch.long, device="meta")


@pytest.mark.parametrize(
    "target, kind, args, kwargs, sig",
    [
        (torch.topk, "topk", (x3, 2), {"dim": 1}, "a0 t^ a2 -> a0 k^ a2, a0 k^ a2"),
        ("topk", "topk", (x3, 3), {}, "a0 a1 t^ -> a0 a1 k^, a0 a1 k^"),
        (F.one_hot, "one_hot", (i2, 7), {}, "a0 a1 -> a0 a1 c^"),
        (torch.cumsum, "cumsum", (i3, 1), {}, "a0 a1^ a2 -> a0 a1^ a2"),
        (torch.gather, "gather", (x3, 1, i3[:, :3]), {}, "a0 t^ a2, a0 s a2 -> a0 s a2"),
        (torch.gather, "gather", (x3, 2, i3[:, :, :1]), {}, "a0 a1 t^, a0 a1 s -> a0 a1 s"),
        (torch.gather, "gather", (x3, 1, i3[:1]), {}, "x0^ t^ a2, i0^ s a2 -> i0^ s a2"),  # a shorter index: whole
        (torch.scatter_add, "scatter", (x3, 1, i3[:, :2], x3[:, :2]), {}, "a0 t^ a2, a0 s^ a2, a0 s^ a2 -> a0 t^ a2"),
        ("scatter", "scatter", (x3, 2, i3, 0.5), {}, "a0 a1 t^, a0 a1 s^ -> a0 a1 t^"),
        ("index_select", "index_select", (x3, 1, i3[0, :, 0]), {}, "a0 t^ a2, s -> a0 s a2"),
        (torch.index_add, "index_add", (x3, 1, i3[0, :2, 0], x3[:, :2]), {}, "a0 t^ a2, s^, a0 s^ a2 -> a0 t^ a2"),
    ],
)
def test_signatures(target, kind, args, kwargs, sig):
    assert _sig(target, kind, args, kwargs) == sig


@pytest.mark.parametrize(
    "args, kwargs, sig",
    [
        ((1,), {}, "a0 a1+ a2 -> a0 a2"),
        (((0, 2),), {"keepdim": True}, "a0+ a1 a2+ -> 1 a1 1"),
        ((), {}, "a0+ a1+ a2+ -> "),
        ((-1, True), {}, "a0 a1 a2+ -> a0 a1 1"),
    ],
)
def test_sum_signature(args, kwargs, sig):
    """ops_routing's own ``sum`` (used where no other operator module defines one first)."""
    out = x3.sum(*args, **kwargs)
    ctx = OpContext(((2, 5, 4),), (tuple(out.shape),), ("T", *args), kwargs)
    assert str(ops_routing._sum(ctx)) == sig


# ---- every operator piece computes its slice of the whole -------------------------------


class _Routing(nn.Module):
    """The index operators the MoE layer does not use, with indices made from data."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)  # (B, T, 6)
        top = torch.topk(h, 2, dim=1)  # (B, 2, 6) the two largest over the sequence
        rows = top[1][0, :, 0]  # (2,) sequence positions picked by the first sample
        picked = h.index_select(1, rows)  # (B, 2, 6)
        back = torch.index_add(h, 1, rows, picked * top[0])  # (B, T, 6)
        spread = back.scatter(2, torch.cumsum(F.one_hot(y, 6), 2), 0.25)  # (B, T, 6)
        return F.cross_entropy(spread.flatten(0, 1), y.flatten())


def _run_graph(g, model: nn.Module, inputs) -> dict[str, torch.Tensor]:
    """Every tensor of the graph, computed operator by operator with ``run_piece`` on whole operators."""
    values = dict(zip(g.inputs, inputs))
    values.update(dict(model.named_parameters()))
    values.update(dict(model.named_buffers()))
    for op in g.operators:
        out = run_piece(
            op,
            Task(op.name, TaskKind.FORWARD, shape=g.tensors[op.outputs[0]].shape),
            [values[t] for t in op.inputs],
            g,
            1,
        )
        values.update(zip(op.outputs, out if isinstance(out, tuple) else (out,)))
    return values


def _axis(axes, dim):
    return next((a for a, ax in enumerate(axes) if ax and ax[0] == dim), None)


def _check_pieces(g, values) -> int:
    """Each operator split in two along each splittable dimension, run on its real inputs: the
    pieces' outputs, concatenated (or summed over a reduction), equal the whole operator's."""
    checked = 0
    for op in g.operators:
        full_in = [values[t] for t in op.inputs]
        whole = [values[t] for t in op.outputs]
        for dim in op.splittable_dims():
            if op.dim_sizes[dim] % 2:
                continue
            parts = []
            for p in range(2):
                ins = [
                    x.chunk(2, a)[p] if (a := _axis(axes, dim)) is not None else x
                    for x, axes in zip(full_in, op.signature.inputs)
                ]
                shape = list(whole[0].shape)
                if (a := _axis(op.signature.outputs[0], dim)) is not None:
                    shape[a] //= 2
                lead = p == 0 or dim not in op.signature.reduce  # terms added once go to one piece
                out = run_piece(
                    op,
                    Task(op.name, TaskKind.FORWARD, shape=tuple(shape), lead=lead),
                    ins,
                    g,
                    1,
                    vocab_offset=p * op.dim_sizes[dim] // 2 if dim == "v" else 0,
                )
                parts.append(out if isinstance(out, tuple) else (out,))
            for j, w in enumerate(whole):
                a = _axis(op.signature.outputs[j], dim)
                joined = parts[0][j] + parts[1][j] if a is None else torch.cat([parts[0][j], parts[1][j]], a)
                assert joined.dtype == w.dtype and torch.allclose(joined, w, atol=1e-5), (str(op), dim)
            checked += 1
    return checked


def test_moe_graph_runs_as_the_module_and_its_pieces_match_the_whole():
    spec, g = traced("moe-tiny", 4, (("layers", 1), ("capacity_factor", 0.75)))
    model, inputs = build_model(spec, batch=4, device="cpu")
    values = _run_graph(g, model, inputs)
    assert torch.allclose(values[g.loss], model(*inputs), atol=1e-6)
    kinds = {op.kind for op in g.operators}
    assert {"topk", "one_hot", "cumsum", "compare", "fill_like", "scatter", "gather", "sum", "matmul"} <= kinds
    assert _check_pieces(g, values) > 100


def test_routing_operator_pieces_match_the_whole():
    torch.manual_seed(0)
    model = _Routing()
    inputs = (torch.randn(4, 8, 6), torch.randint(0, 6, (4, 8)))
    g = trace(model, inputs)
    assert not g.unknown
    assert {"topk", "index_select", "index_add", "scatter", "cumsum", "one_hot"} <= {op.kind for op in g.operators}
    values = _run_graph(g, model, inputs)
    assert torch.allclose(values[g.loss], model(*inputs), atol=1e-6)
    assert _check_pieces(g, values) > 15


# ---- registry and spaces -------------------------------------------------------------

FAMILY_ARGS = (
    ("experts", 4),
    ("ffn_hidden", 48),
    ("heads", 4),
    ("hidden", 32),
    ("kv_heads", 2),
    ("layers", 2),
    ("seq", 16),
    ("top_k", 2),
    ("vocab", 64),
)


def test_family_with_overrides_builds_and_runs():
    spec = ModelSpec("moe", FAMILY_ARGS)
    cfg = spec.config()
    assert (cfg.experts, cfg.top_k, cfg.capacity, cfg.rope_theta) == (4, 2, 10, 1e6)
    model, (idx, tgt) = build_model(spec, batch=3, device="cpu")
    loss = model(idx, tgt)
    assert idx.shape == (3, 16) and loss.shape == ()
    loss.backward()
    assert model.blocks[0].feed_forward.gate.weight.grad.abs().sum() > 0  # through the weights and the aux loss


@pytest.mark.parametrize(
    "name, args, message",
    [
        (
            "moe",
            (("layers", 2),),
            "model family 'moe' needs --model-arg for hidden, heads, kv_heads, ffn_hidden, experts",
        ),
        ("moe-tiny", (("top_k", 5),), "top_k=5 must be between 1 and experts=4"),
        ("moe-tiny", (("experts", 0),), "experts=0 must be at least 1"),
        ("moe-tiny", (("capacity_factor", 0.0),), "capacity_factor=0.0 must be positive"),
        ("moe-tiny", (("aux_loss_coef", -1.0),), "aux_loss_coef=-1.0 must be at least 0"),
        ("moe-tiny", (("kv_heads", 3),), "kv_heads=3 does not divide heads=4"),
        ("moe-tiny", (("num_experts", 8),), "unknown model argument 'num_experts' for 'moe-tiny'"),
    ],
)
def test_bad_model_arguments(name, args, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        ModelSpec(name, args).config()


def test_tp_splits_experts_like_megatron_and_checks_kv_heads():
    spec, g = traced("moe-tiny", 8)
    dims = tensor_parallel_dims(g)
    experts = [
        (op.inputs[1].rsplit(".", 1)[1], dims[op.name])
        for op in g.operators
        if op.kind == "matmul" and op.module == "blocks.0.feed_forward.experts"
    ]
    assert experts == [("w1", "n"), ("w3", "n"), ("w2", "k")]  # column, column, row
    assert dims["blocks_0_feed_forward_gate"] is None  # the router stays whole
    spec1, g1 = traced("moe-tiny", 8, (("kv_heads", 1),))
    ctx = Context(g1, spec1, 8, "cpu", 2, 2, 1)
    assert get_space("tp").explain(ctx, {"tp": 2}) == "tp=2 does not divide the model's 1 key/value heads"


def test_models_command_lists_the_mixtral_presets(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "mixtral-8x7b" in out and "46,702.8M params" in out and "140,620.6M params" in out


# ---- plans on 2 gloo ranks match one process -------------------------------------------


def _expert_parallel(spec, g):
    """Experts split over 2 devices (every operator carrying an expert axis splits it), the
    rest replicated: each device runs half of the experts on every token."""
    labels = {g.labels[(t, 0)] for t in g.tensors if t.endswith(("experts.w1", "experts.w2", "experts.w3"))}
    b = PlanBuilder(g, model=spec, global_batch=8, cluster="cpu", nodes=2, num_devices=2, space="ep")
    split = 0
    for op in g.operators:
        dim = next((d for d in op.splittable_dims() if g.dim_label(op, d) in labels), None)
        split += dim is not None
        b.op_trans(op.name, dim, 2)
        b.op_assign(op.name, (0, 1))
    assert split >= 2 * 9  # per layer: reshapes and transposes around the 3 matmuls, silu, mul
    return b.build()


@pytest.mark.parametrize(
    "plan_of",
    [
        dict(dp=2, tp=1, pp=1, microbatch=2),  # data parallel, 2 micro-batches
        dict(dp=1, tp=2, pp=1, microbatch=8),  # Megatron tensor parallel: attention heads, expert ffn columns/rows
        "ep",  # expert parallel
    ],
    ids=["dp", "tp", "ep"],
)
def test_moe_tiny_plans_match_one_process(plan_of):
    spec, g = traced("moe-tiny", 8)
    if plan_of == "ep":
        plan = _expert_parallel(spec, g)
    else:
        plan = get_space("megatron").build(Context(g, spec, 8, "cpu", 2, 2, 1), plan_of)
    res = launch_local(plan, 2, steps=2, lr=1e-2)
    assert res.max_loss_error <= LOSS_TOL, (res.losses, res.ref_losses)
    assert res.max_grad_error <= GRAD_TOL
    assert res.losses[1] < res.losses[0]
