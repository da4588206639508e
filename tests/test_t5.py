"""The T5 family: preset sizes against the released checkpoints, numerics against Hugging Face's
T5, the biased-attention operator and its pieces, the registry, pipeline stages, and data-,
tensor- and pipeline-parallel plans on 2 gloo ranks."""

import math
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from planlab.cli import GRAD_TOL, LOSS_TOL, main
from planlab.errors import ConfigError
from planlab.executor import launch_local
from planlab.graph import trace
from planlab.graph.ops_biased_attention import attention_with_bias
from planlab.graph.registry import OpContext, lookup
from planlab.models import T5_PRESETS, ModelSpec, build_model
from planlab.models.t5 import relative_position_buckets
from planlab.search_spaces import Context, get_space
from planlab.search_spaces.builtin import pipeline_stages, tensor_parallel_dims

from conftest import traced
from test_llama import _check_pieces

# Parameter counts of Google's released T5 v1.1 checkpoints, google/t5-v1_1-{small,base,large,xl,xxl}:
# the model cards and the T5 v1.1 release notes round them to 77M, 248M, 783M, 2.85B and 11.1B. The
# exact totals, counting the embedding that encoder and decoder share once and the untied output
# layer, are those of transformers' T5ForConditionalGeneration built from each released
# config.json (checked with transformers 5.23: 76,961,152 / 247,577,856 / 783,150,080 /
# 2,849,757,184 / 11,135,332,352; the fp32 pytorch_model.bin files hold 4 bytes per parameter).
PUBLISHED = {
    "t5-v1_1-small": 77e6,
    "t5-v1_1-base": 248e6,
    "t5-v1_1-large": 783e6,
    "t5-v1_1-xl": 2.85e9,
    "t5-v1_1-xxl": 11.1e9,
}
EXACT = {
    "t5-v1_1-small": 76_961_152,
    "t5-v1_1-base": 247_577_856,
    "t5-v1_1-large": 783_150_080,
    "t5-v1_1-xl": 2_849_757_184,
    "t5-v1_1-xxl": 11_135_332_352,
}


@pytest.mark.parametrize("preset, published", sorted(PUBLISHED.items()))
def test_preset_parameter_counts_match_published(preset, published):
    n = T5_PRESETS[preset].num_params()
    assert abs(n - published) / published < 0.01
    assert n == EXACT[preset]


def test_module_parameter_count_is_the_config_count():
    spec, g = traced("t5-tiny", 8)
    model, _ = build_model(spec, batch=1)
    assert g.num_params == sum(p.numel() for p in model.parameters()) == spec.config().num_params()
    assert not g.unknown


def test_t5_v1_1_xxl_traces_on_meta():
    t0 = time.perf_counter()
    spec, g = traced("t5-v1_1-xxl", 8)
    elapsed_s = time.perf_counter() - t0
    print(f"t5-v1_1-xxl: built and traced in {elapsed_s:.2f} s")  # 1.4 s on this 2-core machine when idle
    assert g.num_params == EXACT["t5-v1_1-xxl"]
    assert not g.unknown  # every operator has a signature: nothing is kept whole
    kinds = [op.kind for op in g.operators]
    # 24 encoder and 24 decoder self-attentions with the position bias, 24 cross-attentions
    assert sum(op.call.target is attention_with_bias for op in g.operators) == 48
    assert kinds.count("attention") == 72
    # the shared embedding once, and one relative position table per stack
    assert kinds.count("embedding") == 3


# ---- the relative position buckets ------------------------------------------------


@pytest.mark.parametrize(
    "bidirectional, rel, bucket",
    [
        # bidirectional, 32 buckets up to 128: 16 per direction, 8 exact distances, later keys from 16
        (True, 0, 0),
        (True, -1, 1),
        (True, -7, 7),
        (True, -8, 8),
        (True, -16, 10),
        (True, -127, 15),
        (True, -128, 15),
        (True, -1000, 15),
        (True, 1, 17),
        (True, 8, 24),
        (True, 200, 31),
        # causal: 32 buckets for past keys (16 exact), future keys in bucket 0
        (False, 0, 0),
        (False, 5, 0),
        (False, -1, 1),
        (False, -15, 15),
        (False, -16, 16),
        (False, -32, 21),
        (False, -127, 31),
        (False, -1000, 31),
    ],
)
def test_relative_position_buckets(bidirectional, rel, bucket):
    # relative distance = key - query; a query at position 1000 sees keys from 0 to 1200
    grid = relative_position_buckets(1001, 1201, bidirectional=bidirectional, num_buckets=32, max_distance=128)
    assert int(grid[1000, 1000 + rel]) == bucket


def test_matches_hugging_face_t5():
    """The same weights in transformers' T5ForConditionalGeneration (T5 v1.1: gated-gelu, untied
    output) give the same loss and gradients."""
    transformers = pytest.importorskip("transformers")
    spec = ModelSpec("t5-tiny", (("decoder_layers", 3),))
    cfg = spec.config()
    model, (enc, dec, labels) = build_model(spec, batch=3, device="cpu", seed=0)
    hc = transformers.T5Config(
        d_model=cfg.hidden,
        d_ff=cfg.ffn_hidden,
        num_heads=cfg.heads,
        d_kv=cfg.head_dim,
        num_layers=cfg.encoder_layers,
        num_decoder_layers=cfg.decoder_layers,
        vocab_size=cfg.vocab,
        relative_attention_num_buckets=cfg.rel_buckets,
        relative_attention_max_distance=cfg.rel_max_distance,
        dropout_rate=0.0,
        layer_norm_epsilon=cfg.norm_eps,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
    )  # as google/t5-v1_1-*'s config.json: no output scaling by hidden**-0.5
    hc.tie_word_embeddings = False  # transformers 5 sets it back to True; False keeps lm_head untied
    hf = transformers.T5ForConditionalGeneration(hc)

    def hf_names(name: str) -> list[str]:
        if not name.startswith("blocks."):
            return {
                "shared.weight": ["shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight"],
                "encoder_norm.weight": ["encoder.final_layer_norm.weight"],
                "decoder_norm.weight": ["decoder.final_layer_norm.weight"],
                "lm_head.weight": ["lm_head.weight"],
            }[name]
        _, i, rest = name.split(".", 2)
        enc_side = int(i) < cfg.encoder_layers
        stack, j = ("encoder", int(i)) if enc_side else ("decoder", int(i) - cfg.encoder_layers)
        sub = {"self_attn_norm": "layer.0.layer_norm", "self_attn": "layer.0.SelfAttention"}
        sub |= (
            {"ff_norm": "layer.1.layer_norm", "ff": "layer.1.DenseReluDense"}
            if enc_side
            else {
                "cross_attn_norm": "layer.1.layer_norm",
                "cross_attn": "layer.1.EncDecAttention",
                "ff_norm": "layer.2.layer_norm",
                "ff": "layer.2.DenseReluDense",
            }
        )
        head, tail = rest.split(".", 1)
        return [f"{stack}.block.{j}.{sub[head]}.{tail.replace('position_bias.', '')}"]

    weights = {h: p.detach() for n, p in model.named_parameters() for h in hf_names(n)}
    hf.load_state_dict(weights, strict=False)
    hf_params = dict(hf.named_parameters())
    assert set(hf_params) <= set(weights)  # every Hugging Face parameter came from ours

    ours, theirs = model(enc, dec, labels), hf(input_ids=enc, decoder_input_ids=dec, labels=labels).loss
    assert abs(ours.item() - theirs.item()) < 1e-5
    ours.backward()
    theirs.backward()
    for n, p in model.named_parameters():
        distinct = {id(hf_params[h]): hf_params[h] for h in hf_names(n) if h in hf_params}
        g = sum(q.grad for q in distinct.values() if q.grad is not None)  # the embedding: summed over its uses
        assert torch.allclose(p.grad, g, atol=1e-6), n


# ---- attention with an additive bias: signature and pieces ------------------------


def _sig(q, k, v, bias) -> str:
    out = attention_with_bias(q, k, v, bias)
    d = lookup("call_function", attention_with_bias)
    assert d is not None and d.kind == "attention"
    ctx = OpContext(tuple(tuple(t.shape) for t in (q, k, v, bias)), (tuple(out.shape),), (), {})
    return str(d.signature(ctx))


def _m(*shape):
    return torch.zeros(*shape, device="meta")


@pytest.mark.parametrize(
    "shapes, sig",
    [
        (
            ((2, 3, 5, 4), (2, 3, 7, 4), (2, 3, 7, 6), (1, 3, 5, 7)),
            "a0 a1 s d^, a0 a1 t^ d^, a0 a1 t^ e^, 1 a1 s t^ -> a0 a1 s e^",
        ),  # T5's (1, nh, S, T) bias
        (
            ((2, 3, 5, 4), (2, 3, 5, 4), (2, 3, 5, 4), (5, 5)),
            "a0 a1 s d^, a0 a1 t^ d^, a0 a1 t^ e^, s t^ -> a0 a1 s e^",
        ),  # one bias for all heads
        (
            ((2, 3, 5, 4), (2, 3, 5, 4), (2, 3, 5, 4), (2, 1, 5, 5)),
            "a0 a1 s d^, a0 a1 t^ d^, a0 a1 t^ e^, a0 1 s t^ -> a0 a1 s e^",
        ),  # a per-sample mask
        (
            ((2, 5, 4), (2, 7, 4), (2, 7, 4), (2, 5, 7)),
            "a0 s d^, a0 t^ d^, a0 t^ e^, a0 s t^ -> a0 s e^",
        ),  # 3-D, full bias
    ],
)
def test_biased_attention_signatures(shapes, sig):
    assert _sig(*(_m(*s) for s in shapes)) == sig


class _Biased(nn.Module):
    """Cross-attention with a bias input, in a model that ends in a loss."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(8, 8, bias=False) for _ in range(3))

    def forward(self, x, m, bias, y):
        # x: (B, S, 8), m: (B, T, 8), bias: broadcasts to (B, 2, S, T), y: (B, S)
        q = self.q(x).unflatten(-1, (2, 4)).transpose(1, 2)  # (B, 2, S, 4)
        k = self.k(m).unflatten(-1, (2, 4)).transpose(1, 2)  # (B, 2, T, 4)
        v = self.v(m).unflatten(-1, (2, 4)).transpose(1, 2)  # (B, 2, T, 4)
        o = attention_with_bias(q, k, v, bias, 0.5)  # (B, 2, S, 4)
        return F.cross_entropy(o.transpose(1, 2).flatten(-2).flatten(0, 1), y.flatten())


@pytest.mark.parametrize("bias_shape", [(1, 2, 4, 6), (4, 6), (2, 1, 4, 6), (2, 2, 4, 6)])
def test_biased_attention_pieces_match_the_whole(bias_shape):
    g = trace(
        _Biased(),
        (torch.zeros(2, 4, 8), torch.zeros(2, 6, 8), torch.zeros(bias_shape), torch.zeros(2, 4, dtype=torch.long)),
    )
    assert not g.unknown
    att = next(op for op in g.operators if op.call.target is attention_with_bias)
    assert att.splittable_dims() == ["a0", "a1", "s"]  # batch, heads and queries; never keys or head sizes
    assert _check_pieces(g) > 20


def test_t5_operator_pieces_match_the_whole():
    """Every operator of a one-layer-per-stack T5 (including the shared-embedding slices, the
    position-bias lookup and causal mask, cross-attention), split in two, equals the whole."""
    _, g = traced("t5-tiny", 4, (("decoder_layers", 1), ("encoder_layers", 1)))
    kinds = {op.kind for op in g.operators}
    assert {"cat", "getitem", "embedding", "permute", "attention", "rms_norm", "activation"} <= kinds
    assert _check_pieces(g) > 60


# ---- registry and spaces -----------------------------------------------------------

FAMILY_ARGS = (
    ("decoder_layers", 1),
    ("decoder_seq", 6),
    ("encoder_layers", 2),
    ("ffn_hidden", 48),
    ("head_dim", 8),
    ("heads", 2),
    ("hidden", 32),
    ("seq", 10),
    ("vocab", 64),
)


def test_family_with_overrides_builds_and_runs():
    spec = ModelSpec("t5", FAMILY_ARGS)
    cfg = spec.config()
    assert (cfg.layers, cfg.inner, cfg.rel_buckets) == (3, 16, 32)
    model, (enc, dec, labels) = build_model(spec, batch=3, device="cpu")
    assert enc.shape == (3, 10) and dec.shape == labels.shape == (3, 6)
    assert torch.equal(dec[:, 1:], labels[:, :-1]) and not dec[:, 0].any()  # shifted right behind token 0
    loss = model(enc, dec, labels)
    assert loss.shape == () and abs(loss.item() - math.log(64)) < 1.0
    assert ModelSpec("t5-v1_1-xxl", (("decoder_seq", 512),)).config().decoder_seq == 512


@pytest.mark.parametrize(
    "name, args, message",
    [
        ("t5-huge", (), "unknown model 't5-huge'; choose 'gpt-tiny'"),
        ("t5", (("hidden", 32),), "model family 't5' needs --model-arg for encoder_layers, decoder_layers, heads"),
        ("t5-tiny", (("layers", 2),), "unknown model argument 'layers' for 't5-tiny'; choose 'encoder_layers'"),
        ("t5-tiny", (("heads", 0),), "heads=0 must be a positive integer"),
        ("t5-tiny", (("decoder_seq", 1),), "decoder_seq=1 must be at least 2"),
        ("t5-tiny", (("rel_buckets", 7),), "rel_buckets=7 must be an even number of at least 4"),
        ("t5-tiny", (("rel_max_distance", 16),), "rel_max_distance=16 must exceed rel_buckets/2=16"),
        ("t5-tiny", (("dropout", 1.0),), "dropout=1.0 must be in [0, 1)"),
    ],
)
def test_bad_model_names_and_arguments(name, args, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        ModelSpec(name, args).config()


def test_tensor_parallel_splits_heads_and_ffn():
    _, g = traced("t5-tiny", 8)
    dims = tensor_parallel_dims(g)
    by_module = {op.module: dims[op.name] for op in g.operators if op.kind in ("linear", "embedding")}
    for stack_layer in ("blocks.0", "blocks.3"):
        for m in ("self_attn.q", "self_attn.k", "self_attn.v", "ff.wi_0", "ff.wi_1"):
            assert by_module[f"{stack_layer}.{m}"] == "n", m
        assert by_module[f"{stack_layer}.self_attn.o"] == by_module[f"{stack_layer}.ff.wo"] == "k"
    assert by_module["blocks.3.cross_attn.k"] == "n" and by_module["blocks.3.cross_attn.o"] == "k"
    # the position tables are split by heads with the attention that reads them
    assert by_module["blocks.0.self_attn.position_bias.relative_attention_bias"] == "h"
    assert by_module["blocks.2.self_attn.position_bias.relative_attention_bias"] == "h"
    assert by_module["shared"] is None and by_module["lm_head"] is None


@pytest.mark.parametrize(
    "preset, tp, message",
    [
        ("t5-tiny", 8, "tp=8 does not divide the model's 4 attention heads"),
        ("t5-v1_1-small", 4, "tp=4 does not divide the model's 6 attention heads"),
        ("t5-v1_1-small", 2, ""),
    ],
)
def test_tp_must_divide_the_heads(preset, tp, message):
    spec, g = traced(preset, 8)
    ctx = Context(g, spec, 8, "cpu", tp, tp, 1)  # tp single-device nodes
    assert get_space("tp").explain(ctx, {"tp": tp}) == message


@pytest.mark.parametrize(
    "encoder_layers, decoder_layers, pp, stages",
    [
        (2, 2, 2, (0, 0, 1, 1)),  # encoder on the first stage, decoder on the second
        (3, 1, 2, (0, 0, 1, 1)),  # the cut falls inside the encoder
        (2, 2, 4, (0, 1, 2, 3)),
    ],
)
def test_pipeline_stages_follow_the_layer_order(encoder_layers, decoder_layers, pp, stages):
    spec, g = traced("t5-tiny", 8, (("decoder_layers", decoder_layers), ("encoder_layers", encoder_layers)))
    st = pipeline_stages(g, pp, spec.config().layers)
    by_module = {op.module: st[op.name] for op in g.operators}
    assert tuple(by_module[f"blocks.{i}.ff.wo"] for i in range(4)) == stages
    assert by_module["shared"] == 0 and by_module["lm_head"] == pp - 1
    assert by_module["encoder_norm"] == stages[encoder_layers - 1]
    # the space's knob offers exactly the degrees that divide the 4 layers
    ctx = Context(g, spec, 8, "cpu", 8, 8, 1)
    assert [k.values(ctx) for k in get_space("pp").knobs if k.name == "pp"] == [(1, 2, 4)]


def test_models_command_lists_t5(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for name in ("t5-tiny", "t5-v1_1-small", "t5-v1_1-xxl"):
        assert name in out
    assert "11,135.3M params" in out and "family: t5" in out


# ---- plans on 2 gloo ranks match one process --------------------------------------


@pytest.mark.parametrize(
    "knobs",
    [
        dict(dp=2, tp=1, pp=1, microbatch=2),  # data parallel, 2 micro-batches
        dict(dp=1, tp=2, pp=1, microbatch=8),  # tensor parallel: heads (and position tables), FFN columns
        # interleaved pipeline, stages enc0, enc1, dec0, dec1 on devices 0, 1, 0, 1: the encoder's
        # output goes from stage 1 to both decoder stages, each stack's position bias to its later layer
        dict(dp=1, tp=1, pp=2, microbatch=2, schedule="interleaved", virtual_stages=2),
    ],
)
def test_t5_tiny_plans_match_one_process(knobs):
    spec, g = traced("t5-tiny", 8)
    plan = get_space("megatron").build(Context(g, spec, 8, "cpu", 2, 2, 1), knobs)
    dims = {p.op: p.dims for p in plan.ops}
    if knobs["tp"] == 2:
        assert (
            "n" in dims["blocks_2_cross_attn_k"]
            and "h" in dims["blocks_0_self_attn_position_bias_relative_attention_bias"]
        )
    res = launch_local(plan, 2, steps=2, lr=1e-2)
    assert res.max_loss_error <= LOSS_TOL, (res.losses, res.ref_losses)
    assert res.max_grad_error <= GRAD_TOL
    assert res.losses[1] < res.losses[0]
