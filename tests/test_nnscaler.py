"""nnScaler's eleven workloads as presets: their shapes as the artifact's scripts state them, each
module's parameters against its config's count, a small variant traced, and the T5 the T5 workloads
use (two-matrix feed-forward, vocabulary-parallel loss): its tensor-parallel splits, and tensor-parallel
and interlaced plans on 2 gloo ranks against one process."""

import pytest

from planlab.cli import GRAD_TOL, LOSS_TOL
from planlab.errors import ConfigError
from planlab.executor import launch_local
from planlab.models import ModelSpec, build_model
from planlab.models.registry import PRESET_FAMILY
from planlab.search_spaces import Context, get_space
from planlab.search_spaces.builtin import tensor_parallel_dims

from conftest import traced

# microsoft/nnscaler, branch osdi24ae, cupilot/evaluation/swin_{N}gpus.sh: LAYERS, HIDDEN, HEADS with
# --img-size 1536 --window-size 48; examples/swin/model.py build_config: depths (2, 2, LAYERS - 6, 2),
# heads doubling per stage, 1,024 classes.
SWIN = {
    "nnscaler-swin-4gpu": (512, (2, 2, 26, 2), (16, 32, 64, 128)),
    "nnscaler-swin-8gpu": (768, (2, 2, 34, 2), (24, 48, 96, 192)),
    "nnscaler-swin-16gpu": (1024, (2, 2, 42, 2), (32, 64, 128, 256)),
    "nnscaler-swin-32gpu": (1536, (2, 2, 50, 2), (32, 64, 128, 256)),
}
# cupilot/evaluation/t5_{N}gpus.sh: LAYERS (each of encoder and decoder), HIDDEN, HEADS, VOCAB_K * 1000
T5 = {
    "nnscaler-t5-4gpu": (24, 2048, 32, 512_000),
    "nnscaler-t5-8gpu": (32, 3072, 48, 1_024_000),
    "nnscaler-t5-16gpu": (32, 4096, 64, 1_536_000),
    "nnscaler-t5-32gpu": (32, 6144, 96, 2_048_000),
}
EVOFORMER = {
    "nnscaler-evoformer-128x256": (128, 256),
    "nnscaler-evoformer-512x256": (512, 256),
    "nnscaler-evoformer-512x384": (512, 384),
}


def test_the_eleven_presets_have_the_artifacts_shapes():
    assert sorted(p for p in PRESET_FAMILY if p.startswith("nnscaler-")) == sorted({**SWIN, **T5, **EVOFORMER})
    for name, (embed, depths, heads) in SWIN.items():
        c = ModelSpec(name).config()
        assert (c.embed, c.depths, c.num_heads) == (embed, depths, heads)
        assert (c.image, c.window, c.patch, c.classes) == (1536, 48, 4, 1024)
        assert [c.window_at(s) for s in range(4)] == [48] * 4  # the last stage's 48 x 48 map is one window
    for name, (layers, hidden, heads, vocab) in T5.items():
        c = ModelSpec(name).config()
        assert (c.encoder_layers, c.decoder_layers, c.hidden, c.heads, c.vocab) == (
            layers,
            layers,
            hidden,
            heads,
            vocab,
        )
        assert (c.head_dim, c.ffn_hidden, c.seq, c.decoder_seq) == (hidden // heads, 4 * hidden, 1024, 1024)
        assert not c.gated_ffn and c.vocab_parallel == 1 and c.dropout == 0.1
    for name, (n_seq, n_res) in EVOFORMER.items():
        c = ModelSpec(name).config()
        assert (c.blocks, c.n_seq, c.n_res, c.recycles, c.c_m, c.c_z) == (48, n_seq, n_res, 3, 256, 128)


@pytest.mark.parametrize("family", [SWIN, T5, EVOFORMER], ids=["swin", "t5", "evoformer"])
def test_each_preset_builds_on_meta_with_its_configs_parameters(family):
    for name in family:
        spec = ModelSpec(name)
        model, _ = build_model(spec, batch=1)
        assert sum(p.numel() for p in model.parameters()) == spec.config().num_params(), name


def test_a_small_variant_of_a_preset_traces():
    # nnscaler-swin-4gpu's structure (4 stages, heads doubling) at 1/16 of the image, 1/16 of the width
    args = (("embed", 32), ("depths", (2, 2, 2, 2)), ("num_heads", (1, 2, 4, 8)), ("image", 96), ("window", 3))
    spec, g = traced("nnscaler-swin-4gpu", 2, args)
    assert g.num_params == spec.config().num_params() and not g.unknown


T5_PLAIN = (("gated_ffn", 0),)


def test_two_matrix_feed_forward_splits_columns_then_rows():
    spec, g = traced("t5-tiny", 8, T5_PLAIN)
    assert g.num_params == spec.config().num_params()
    dims = tensor_parallel_dims(g)
    by_module = {op.module: dims[op.name] for op in g.operators if op.kind == "linear"}
    for layer in ("blocks.0", "blocks.3"):
        assert by_module[f"{layer}.ff.wi"] == "n" and by_module[f"{layer}.ff.wo"] == "k"
    assert not any(".wi_0" in m or ".wi_1" in m for m in by_module)


def test_gated_ffn_must_be_0_or_1():
    with pytest.raises(ConfigError, match=r"^gated_ffn=2 must be 0 \(two-matrix feed-forward\) or 1"):
        ModelSpec("t5-tiny", (("gated_ffn", 2),)).config()


# nnScaler's T5 variant at t5-tiny's sizes: the two-matrix feed-forward, the vocabulary-parallel loss
T5_NNSCALER = (("gated_ffn", 0), ("vocab_parallel", 1))


@pytest.mark.parametrize(
    "space, knobs",
    [
        ("megatron", dict(dp=1, tp=2, pp=1, microbatch=8)),  # heads, FFN columns and the vocabulary split
        ("interlaced", dict(pp=2, dp=1, tp=1, microbatch=1)),  # one sequence a micro-batch: the loss split by vocab
    ],
)
def test_nnscaler_t5_variant_plans_match_one_process(space, knobs):
    spec, g = traced("t5-tiny", 8, T5_NNSCALER)
    plan = get_space(space).build(Context(g, spec, 8, "cpu", 2, 2, 1), knobs)
    ops = {p.op: p for p in plan.ops}
    assert ops["vocab_cross_entropy"].dims and ops["vocab_embedding"].dims  # split along the vocabulary
    res = launch_local(plan, 2, steps=2, lr=1e-2)
    assert res.max_loss_error <= LOSS_TOL, (res.losses, res.ref_losses)
    assert res.max_grad_error <= GRAD_TOL
    assert res.losses[1] < res.losses[0]
