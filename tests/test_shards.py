"""Shard-only building: any region of any parameter drawn from the seed equals the same slice
of the whole parameter drawn by the reference; each module's rule is PyTorch's own draw; the
ranks of TP, PP and ZeRO plans build exactly the slices of the reference's tensors they
hold, and the memory refusal counts each rank's pieces, not the whole model per rank."""

import math

import pytest
import torch
import torch.nn as nn

from planlab.errors import ConfigError
from planlab.executor.shards import build_shards, check_memory, held_elements, rank_bytes
from planlab.models import ModelSpec
from planlab.models import init as minit
from planlab.models.init import (
    InitRule,
    build_full,
    build_skeleton,
    init_region,
    init_rules,
    params_on_meta,
    rows_per_chunk,
)
from planlab.plan import materialize
from planlab.search_spaces import Context, get_space

from conftest import traced

N01 = InitRule("normal", 0.0, 1.0)


REGIONS = [
    ((10, 7), ((0, 10), (0, 7))),  # whole
    ((10, 7), ((3, 9), (0, 7))),  # rows across chunk boundaries
    ((10, 7), ((0, 10), (2, 5))),  # columns: every chunk drawn, then sliced
    ((10, 7), ((4, 5), (6, 7))),  # one element
    ((5, 3, 4), ((1, 4), (0, 3), (1, 3))),  # 3-D
    ((37,), ((5, 33),)),  # 1-D: chunks of CHUNK_ELEMENTS
    ((), ()),  # a scalar parameter
]
RULES = [N01, InitRule("uniform", -0.3, 0.3), InitRule("constant", 1.0), InitRule("normal", 0.0, 1.0, zero_row=4)]


@pytest.mark.parametrize(
    "shape, box, rule", [(s, b, r) for s, b in REGIONS for r in RULES if s or r.zero_row is None]
)  # a scalar has no rows
def test_a_region_is_the_slice_of_the_whole(monkeypatch, shape, box, rule):
    monkeypatch.setattr(minit, "CHUNK_ELEMENTS", 16)  # many chunks on small shapes
    whole = init_region(rule, "blocks.0.w", shape, None, seed=3)
    part = init_region(rule, "blocks.0.w", shape, box, seed=3)
    assert torch.equal(part, whole[tuple(slice(a, b) for a, b in box)])
    assert whole.shape == shape
    if rule.zero_row is not None:
        assert not whole[4].any() and whole[3].all()


def test_draws_depend_on_seed_and_name_only():
    a = init_region(N01, "w", (64, 64), None, seed=0)
    assert torch.equal(a, init_region(N01, "w", (64, 64), None, seed=0))
    assert not torch.equal(a, init_region(N01, "w", (64, 64), None, seed=1))
    assert not torch.equal(a, init_region(N01, "v", (64, 64), None, seed=0))
    big = init_region(InitRule("normal", 0.0, 0.5), "w", (512, 512), None, seed=0)
    assert abs(float(big.mean())) < 0.01 and abs(float(big.std()) - 0.5) < 0.01
    u = init_region(InitRule("uniform", -0.2, 0.2), "w", (512, 512), None, seed=0)
    assert -0.2 <= float(u.min()) < -0.199 and 0.199 < float(u.max()) <= 0.2
    assert rows_per_chunk((51200, 12288)) == 21 and rows_per_chunk((7,)) == 1 << 18


class _Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.empty(9, 2))  # never drawn: the fallback
        self.gate_bias = nn.Parameter(torch.empty(2))
        self.trunc = nn.Parameter(torch.empty(4, 4))
        nn.init.trunc_normal_(self.trunc, std=0.02)  # recorded as the normal it truncates
        self.twice = nn.Parameter(torch.empty(3))
        nn.init.normal_(self.twice)
        self.twice.data.uniform_(-2.0, 3.0)  # the last draw wins, through .data too
        self.copy = nn.Parameter(self.trunc.detach().clone())  # a copy is drawn as its source


class _Declared(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(5, 5))

    def param_init(self, name):
        return InitRule("uniform", -1.0, 1.0)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)
        self.emb = nn.Embedding(10, 4, padding_idx=2)
        self.ln = nn.LayerNorm(4)
        self.rms = nn.RMSNorm(4)
        self.conv = nn.Conv2d(3, 5, kernel_size=3)
        self.custom = _Custom()
        self.declared = _Declared()


@pytest.mark.parametrize(
    "name, rule",
    [
        ("fc.weight", InitRule("uniform", -0.25, 0.25)),  # kaiming_uniform_(a=sqrt(5)): 1/sqrt(fan_in = 16)
        ("fc.bias", InitRule("uniform", -0.25, 0.25)),
        ("emb.weight", InitRule("normal", 0.0, 1.0, zero_row=2)),
        ("ln.weight", InitRule("constant", 1.0)),
        ("ln.bias", InitRule("constant", 0.0)),
        ("rms.weight", InitRule("constant", 1.0)),
        ("conv.weight", InitRule("uniform", -1 / math.sqrt(27), 1 / math.sqrt(27))),  # fan_in 3 * 3 * 3
        ("custom.table", InitRule("normal", 0.0, minit.FALLBACK_STD)),
        ("custom.gate_bias", InitRule("constant", 0.0)),
        ("custom.trunc", InitRule("normal", 0.0, 0.02)),
        ("custom.twice", InitRule("uniform", -2.0, 3.0)),
        ("custom.copy", InitRule("normal", 0.0, 0.02)),
        ("declared.w", InitRule("uniform", -1.0, 1.0)),
    ],
)
def test_rules_are_the_models_own_draws(name, rule):
    with params_on_meta() as recorder:
        net = _Net()
    assert all(p.is_meta for p in net.parameters())
    got = init_rules(net, recorder)[name]
    assert (got.kind, got.zero_row) == (rule.kind, rule.zero_row)
    assert (got.a, got.b) == (pytest.approx(rule.a, rel=1e-12), pytest.approx(rule.b, rel=1e-12))
    if name.startswith(("fc.", "ln.")):  # the module's rule, without a record, is the same draw
        fallback = init_rules(net)[name]
        assert (fallback.a, fallback.b) == (pytest.approx(got.a, rel=1e-12), pytest.approx(got.b, rel=1e-12))


def test_hugging_face_draws_are_recorded():
    pytest.importorskip("transformers")
    skeleton, _ = build_skeleton(ModelSpec("planlab.models.hf:t5"), batch=1)
    rules, cfg = init_rules(skeleton), skeleton.model.config
    q = rules["model.encoder.block.0.layer.0.SelfAttention.q.weight"]
    assert q == InitRule("normal", 0.0, pytest.approx((cfg.d_model * cfg.d_kv) ** -0.5))  # T5's _init_weights
    assert rules["model.lm_head.weight"] == InitRule("normal", 0.0, 1.0)  # untie_t5's clone of it
    rules = init_rules(build_skeleton(ModelSpec("planlab.models.hf:gpt2"), batch=1)[0])
    assert rules["model.transformer.h.0.attn.c_attn.weight"] == InitRule("normal", 0.0, 0.02)


def test_the_skeleton_holds_no_parameter_memory_but_real_buffers_and_inputs():
    spec = ModelSpec("gpt", (("heads", 4), ("hidden", 256), ("layers", 2), ("seq", 16), ("vocab", 1000)))
    module, (idx, tgt) = build_skeleton(spec, batch=3)
    assert all(p.is_meta for p in module.parameters())
    assert torch.equal(module.pos, torch.arange(16)) and idx.shape == (3, 16) and not idx.is_meta
    full, inputs = build_full(spec, batch=3)
    assert not any(p.is_meta for p in full.parameters())
    assert torch.equal(inputs[0], idx) and math.isfinite(float(full(*inputs).detach()))
    assert torch.equal(full.blocks[1].ln1.weight, torch.ones(256))


@pytest.mark.parametrize(
    "n, knobs",
    [
        (2, dict(dp=1, tp=2, pp=1, microbatch=8)),  # column and row splits
        (2, dict(dp=1, tp=1, pp=2, microbatch=2)),  # layers by stage
        (4, dict(dp=2, tp=2, pp=1, microbatch=2, zero=2)),  # replicas
    ],
)
def test_every_rank_builds_the_slices_of_the_reference(n, knobs):
    spec, g = traced("gpt-tiny", 8)
    plan = get_space("megatron").build(Context(g, spec, 8, "cpu", n, n, 1), knobs)
    program = materialize(plan, g)
    full = dict(build_full(spec, batch=8)[0].named_parameters())
    skeleton, _ = build_skeleton(spec, batch=8)
    covered = {p: torch.zeros(w.shape, dtype=torch.int32) for p, w in full.items()}
    for r in range(n):
        shards = build_shards(program, r, skeleton, seed=0)
        for p, box in program.devices[r].params:
            region = tuple(slice(a, b) for a, b in box)
            assert torch.equal(shards[p], full[p].detach()[region]), (r, p)
            covered[p][region] += 1
        assert sum(s.numel() for s in shards.values()) == held_elements(program, r)
    assert all(bool((c >= 1).all()) for c in covered.values())  # every element on some rank
    if knobs["pp"] == n:  # stages: each element on exactly one rank
        assert all(bool((c == 1).all()) for c in covered.values())


def test_memory_refusal_counts_each_ranks_pieces():
    spec, g = traced("gpt-tiny", 8)
    plan = get_space("megatron").build(Context(g, spec, 8, "cpu", 2, 2, 1), dict(dp=1, tp=1, pp=2, microbatch=2))
    program = materialize(plan, g)
    shards = rank_bytes(program, 0) + rank_bytes(program, 1)
    assert shards == 16 * g.num_params  # two stages hold every parameter once
    old = 2 * 4 * g.num_params + shards  # every rank building the whole model, as before
    assert check_memory(plan, program, [0, 1], num_params=g.num_params, reference=False, available=shards) == shards
    assert shards < old
    with pytest.raises(
        ConfigError,
        match=r"needs about .* GiB of host memory: .* for the pieces of 2 ranks .*; "
        r".* GiB is available",
    ):
        check_memory(plan, program, [0, 1], num_params=g.num_params, reference=False, available=shards - 1)
    with pytest.raises(ConfigError, match="for the numeric check's single-process reference"):
        check_memory(plan, program, [0, 1], num_params=g.num_params, reference=True, available=shards)


@pytest.mark.slow
def test_a_rank_holds_its_pieces_not_the_whole_model():
    """An embedding-heavy GPT in four pipeline stages: the middle ranks hold one layer each
    (12 MiB of pieces while training) of a model whose weights alone are 140 MiB; their peak
    resident set above what they held before building stays far below the whole model's
    weights, so no rank ever built the whole model."""
    from planlab.executor import launch_local
    from planlab.graph import trace
    from planlab.models import build_model

    spec = ModelSpec("gpt", (("heads", 4), ("hidden", 256), ("layers", 4), ("seq", 16), ("vocab", 65536)))
    graph = trace(*build_model(spec, batch=4))
    plan = get_space("megatron").build(Context(graph, spec, 4, "cpu", 4, 4, 1), dict(dp=1, tp=1, pp=4, microbatch=1))
    program = materialize(plan, graph)
    whole = 4 * graph.num_params
    res = launch_local(plan, 4, steps=1, check=False)
    assert res.mem_kind == "RSS" and len(res.peak_mem_bytes) == 4
    for r in (1, 2):
        above = res.peak_mem_bytes[r] - res.base_mem_bytes[r]
        assert rank_bytes(program, r) < whole / 8
        assert rank_bytes(program, r) / 4 <= above < whole / 2, (r, above, whole)
