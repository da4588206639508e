"""The Swin Transformer family: preset sizes against the published counts, the model against
Hugging Face's implementation, the vision operators' signatures and their pieces, the model
registry, and data-, tensor- and pipeline-parallel plans on 2 gloo ranks."""

import re
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from planlab.cli import GRAD_TOL, LOSS_TOL, main
from planlab.errors import ConfigError
from planlab.executor import launch_local
from planlab.graph import trace
from planlab.graph.registry import OpContext, lookup
from planlab.models import SWIN_PRESETS, ModelSpec, Swin, build_model
from planlab.models.swin import PatchMerging, shift_mask, window_partition, window_reverse
from planlab.search_spaces import Context, get_space
from planlab.search_spaces.builtin import tensor_parallel_dims

from conftest import traced
import test_llama
from test_llama import _check_pieces
from test_llama import _full_inputs as _llama_full_inputs

# Published parameter counts. Swin-T/S/B/L: Liu et al. 2021, table 1 (28M, 50M, 88M, 197M), to one
# decimal as timm's model cards of the released ImageNet-1k weights report them (Params (M): 28.3,
# 49.6, 87.8, 196.5; the paper's 28M is 1.03% off the exact 28.29M). SwinV2-H and SwinV2-G: Liu et
# al. 2022, "Swin Transformer V2" (658M and 3.0B).
PUBLISHED = {
    "swin-t": 28.3e6,
    "swin-s": 49.6e6,
    "swin-b": 87.8e6,
    "swin-l": 196.5e6,
    "swin-h": 658e6,
    "swin-g": 3.0e9,
}


@pytest.mark.parametrize("preset, published", sorted(PUBLISHED.items()))
def test_preset_parameter_counts_match_published(preset, published):
    assert abs(SWIN_PRESETS[preset].num_params() - published) / published < 0.01


@pytest.mark.parametrize("preset", ["swin-tiny", "swin-t"])
def test_module_parameter_count_is_the_config_count(preset):
    model, _ = build_model(ModelSpec(preset), batch=1)
    assert sum(p.numel() for p in model.parameters()) == SWIN_PRESETS[preset].num_params()


# Liu et al. 2021, table 1: FLOPs of one 224x224 image, counted as multiply-adds (4.5G, 8.7G,
# 15.4G, 34.5G), with the position bias, softmax and norms left out.
PUBLISHED_GMACS = {"swin-t": 4.5, "swin-s": 8.7, "swin-b": 15.4, "swin-l": 34.5}


@pytest.mark.parametrize("preset, gmacs", sorted(PUBLISHED_GMACS.items()))
def test_traced_multiply_adds_match_published_flops(preset, gmacs):
    _, g = traced(preset, 1)
    macs = sum(op.flops for op in g.operators if op.kind in ("linear", "matmul", "conv")) / 2
    assert abs(macs / 1e9 - gmacs) / gmacs < 0.01


def test_swin_g_traces_on_meta():
    t0 = time.perf_counter()
    spec, g = traced("swin-g", 8)
    seconds = time.perf_counter() - t0
    print(f"swin-g: traced in {seconds:.1f} s, {len(g.operators)} operators, {g.flops / 1e12:.1f} TFLOP forward")
    cfg = spec.config()
    assert g.num_params == cfg.num_params() == 3_000_821_192
    assert not g.unknown
    kinds = [op.kind for op in g.operators]
    assert kinds.count("conv") == 1 and kinds.count("roll") == 2 * 23  # every second block shifts, but not stage 4
    assert kinds.count("linear") == 4 * 50 + 2 * 50 + 3 + 1


def test_nothing_is_kept_whole_but_position_bias_gathers():
    """Every operator has a dimension to split, except possibly the relative-position-bias gathers
    ``table[index]`` (a getitem with a tensor index), one per block: whole, they would read a
    (2w-1)^2 x heads table, which costs nothing next to the attention they feed."""
    spec, g = traced("swin-tiny", 8)
    assert not g.unknown
    for op in g.operators:
        if not op.splittable_dims():
            assert op.kind == "getitem" and op.inputs[0].endswith("attn.relative_position_bias_table"), str(op)
            assert op.inputs[1].endswith("attn.relative_position_index")


# ---- the model computes Swin -------------------------------------------------------


def test_window_partition_and_reverse_are_inverse_and_masks_separate_regions():
    x = torch.randn(2, 8, 8, 3)
    w = window_partition(x, 4, 8, 3)  # (2 * 4, 16, 3)
    assert w.shape == (8, 16, 3) and torch.equal(w[1], x[0, :4, 4:].reshape(16, 3))
    assert torch.equal(window_reverse(w, 4, 8, 3), x)
    m = shift_mask(8, 4, 2)  # (4 windows, 16, 16)
    assert m.shape == (4, 16, 16)
    assert (m[0] == 0).all()  # the top-left window holds one region of the unshifted map
    assert (m[3] == -100).sum() == 16 * 16 - 4 * 4 * 4  # the corner window: 4 regions of 4 tokens


def test_patch_merging_is_the_reference_concatenation_of_strided_slices():
    torch.manual_seed(0)
    m = PatchMerging(dim=3, res=4)
    x = torch.randn(2, 16, 3)
    g = x.view(2, 4, 4, 3)
    ref = torch.cat([g[:, 0::2, 0::2], g[:, 1::2, 0::2], g[:, 0::2, 1::2], g[:, 1::2, 1::2]], -1).view(2, 4, 12)
    assert torch.allclose(m(x), m.reduction(m.norm(ref)))


_HF_BLOCK = {
    "layernorm_before": "norm1",
    "layernorm_after": "norm2",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
    "attention.q_proj": "attn.q",
    "attention.k_proj": "attn.k",
    "attention.v_proj": "attn.v",
    "attention.o_proj": "attn.proj",
    "attention.relative_position_bias.relative_position_bias_table": "attn.relative_position_bias_table",
    # transformers 4.x names
    "attention.self.query": "attn.q",
    "attention.self.key": "attn.k",
    "attention.self.value": "attn.v",
    "attention.output.dense": "attn.proj",
    "intermediate.dense": "mlp.fc1",
    "output.dense": "mlp.fc2",
    "attention.self.relative_position_bias_table": "attn.relative_position_bias_table",
}
_HF_OTHER = [
    (r"^swin\.embeddings\.patch_embeddings\.projection\.", "patch_embed.proj."),
    (r"^swin\.embeddings\.norm\.", "patch_embed.norm."),
    (r"^swin\.layernorm\.", "norm."),
    (r"^classifier\.", "head."),
    (r"^swin\.encoder\.layers\.(\d+)\.downsample\.", r"merges.\1."),
]


def test_matches_hugging_face_swin():
    """Hugging Face's SwinForImageClassification with our weights computes the same loss: the
    shifted windows, their masks, the position bias and patch merging are Swin's."""
    transformers = pytest.importorskip("transformers")
    cfg = SWIN_PRESETS["swin-tiny"]
    torch.manual_seed(0)
    ours = Swin(cfg).eval()
    hf = transformers.SwinForImageClassification(
        transformers.SwinConfig(
            image_size=cfg.image,
            patch_size=cfg.patch,
            num_channels=cfg.channels,
            embed_dim=cfg.embed,
            depths=list(cfg.depths),
            num_heads=list(cfg.num_heads),
            window_size=cfg.window,
            mlp_ratio=cfg.mlp_ratio,
            drop_path_rate=0.0,
            num_labels=cfg.classes,
        )
    ).eval()
    first = [sum(cfg.depths[:s]) for s in range(cfg.stages)]

    def our_name(k: str) -> str:
        m = re.match(
            r"^swin\.encoder\.layers\.(\d+)\.blocks\.(\d+)\.(.*)\."
            r"(weight|bias|relative_position_bias_table)$",
            k,
        )
        if m:
            inner = m[3] if m[4] in ("weight", "bias") else f"{m[3]}.{m[4]}"
            tail = f".{m[4]}" if m[4] in ("weight", "bias") else ""
            return f"blocks.{first[int(m[1])] + int(m[2])}.{_HF_BLOCK[inner]}{tail}"
        for pat, rep in _HF_OTHER:
            if re.match(pat, k):
                return re.sub(pat, rep, k)
        raise KeyError(k)

    params = dict(ours.named_parameters())
    hf_params = [k for k, _ in hf.named_parameters()]
    assert len(hf_params) == len(params)
    hf.load_state_dict({k: params[our_name(k)].detach() for k in hf_params}, strict=False)
    images, labels = Swin.example_inputs(cfg, 4, "cpu", seed=1)
    with torch.no_grad():
        ref = F.cross_entropy(hf(pixel_values=images).logits, labels)
        assert torch.allclose(ours(images, labels), ref, atol=1e-5)


# ---- signatures ----------------------------------------------------------------------


def _sig(target, kind: str, args: tuple, kwargs: dict | None = None, module=None) -> str:
    """Signature of one call, read by the registry from the shapes the call produces."""
    kwargs = kwargs or {}
    tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
    if module is not None:
        tensors += [p for p in module.parameters()]
        out = module(*args)
    else:
        out = getattr(args[0], target)(*args[1:], **kwargs) if isinstance(target, str) else target(*args, **kwargs)
    slot = lambda a: "T" if isinstance(a, torch.Tensor) else a  # noqa: E731
    ctx = OpContext(
        tuple(tuple(t.shape) for t in tensors),
        (tuple(out.shape),),
        tuple(slot(a) for a in args),
        {k: slot(v) for k, v in kwargs.items()},
        module,
    )
    d = lookup(
        "call_module" if module is not None else "call_method" if isinstance(target, str) else "call_function",
        target,
        module,
    )
    assert d is not None and d.kind == kind
    return str(d.signature(ctx))


img = torch.zeros(2, 3, 8, 8, device="meta")
x4 = torch.zeros(2, 4, 4, 6, device="meta")
x3 = torch.zeros(2, 5, 6, device="meta")
w33 = torch.zeros(6, 3, 3, 3, device="meta")


@pytest.mark.parametrize(
    "target, kind, args, kwargs, sig",
    [
        (
            F.conv2d,
            "conv",
            (img, torch.zeros(6, 3, 4, 4, device="meta")),
            {"stride": 4},
            "a0 ci+ (s0 k0^) (s1 k1^), o ci+ k0^ k1^ -> a0 o s0 s1",
        ),  # patches: rows and columns split
        (
            F.conv2d,
            "conv",
            (img, w33, torch.zeros(6, device="meta")),
            {"padding": 1},
            "a0 ci+ x0^ x1^, o ci+ k0^ k1^, o -> a0 o y0^ y1^",
        ),  # overlapping windows: spatial axes whole
        (
            F.conv2d,
            "conv",
            (img, torch.zeros(6, 1, 3, 3, device="meta")),
            {"groups": 3},
            "a0 cx^ x0^ x1^, o^ cw^ k0^ k1^ -> a0 o^ y0^ y1^",
        ),  # grouped: channels whole
        (
            F.conv1d,
            "conv",
            (x3, torch.zeros(4, 5, 2, device="meta")),
            {"stride": 2},
            "a0 ci+ (s0 k0^), o ci+ k0^ -> a0 o s0",
        ),
        (torch.roll, "roll", (x4,), {"shifts": (-1, -1), "dims": (1, 2)}, "a0 a1^ a2^ a3 -> a0 a1^ a2^ a3"),
        ("roll", "roll", (x4, 2), {}, "i0_0^ i0_1^ i0_2^ i0_3^ -> o0_0^ o0_1^ o0_2^ o0_3^"),  # flattened roll
        ("sum", "sum", (x3, -1), {}, "a0 a1 r2+ -> a0 a1"),
        (torch.sum, "sum", (x4, (1, 2)), {"keepdim": True}, "a0 r1+ r2+ a3 -> a0 1 1 a3"),
        ("mean", "mean", (x3,), {"dim": 1}, "a0 r1^ a2 -> a0 a2"),
        ("mean", "mean", (x3,), {}, "r0^ r1^ r2^ -> "),
        (F.adaptive_avg_pool1d, "avg_pool", (x3, 1), {}, "a0 a1 p0^ -> a0 a1 q0^"),
        (F.adaptive_avg_pool2d, "avg_pool", (img, (2, 2)), {}, "a0 a1 p0^ p1^ -> a0 a1 q0^ q1^"),
        (
            "masked_fill",
            "masked_fill",
            (x4, torch.zeros(4, 1, 6, dtype=torch.bool, device="meta"), -1.0),
            {},
            "a0 a1 a2 a3, a1 1 a3 -> a0 a1 a2 a3",
        ),
    ],
)
def test_signatures(target, kind, args, kwargs, sig):
    assert _sig(target, kind, args, kwargs) == sig


@pytest.mark.parametrize(
    "module, x, kind, sig",
    [
        (
            nn.Conv2d(3, 6, 4, stride=4, device="meta"),
            img,
            "conv",
            "a0 ci+ (s0 k0^) (s1 k1^), o ci+ k0^ k1^, o -> a0 o s0 s1",
        ),
        (
            nn.Conv2d(3, 6, 2, stride=2, bias=False, padding_mode="reflect", padding=1, device="meta"),
            img,
            "conv",
            "a0 ci+ x0^ x1^, o ci+ k0^ k1^ -> a0 o y0^ y1^",
        ),
        (nn.AdaptiveAvgPool1d(1), x3, "avg_pool", "a0 a1 p0^ -> a0 a1 q0^"),
        (nn.Softmax(dim=1), x3, "softmax", "a0 a1^ a2 -> a0 a1^ a2"),
        (nn.Flatten(1), x3, "reshape", "g0_0 g1_0 g1_1 -> g0_0 (g1_0 g1_1)"),
        (nn.Identity(), x3, "copy", "a0 a1 a2 -> a0 a1 a2"),
    ],
)
def test_module_signatures(module, x, kind, sig):
    assert _sig(None, kind, (x,), module=module) == sig


# ---- every operator piece computes its slice of the whole -------------------------------


class _VisionOps(nn.Module):
    """The vision operators Swin does not use, in a model that ends in a loss."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1, padding_mode="circular")
        self.w = nn.Parameter(torch.randn(4, 2, 1, 1))  # a grouped 1x1 convolution
        self.pool = nn.AdaptiveAvgPool2d((2, 2))
        self.soft = nn.Softmax(dim=-1)
        self.flat = nn.Flatten(1)
        self.register_buffer("mask", torch.rand(4, 1, 8) > 0.5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.conv2d(self.stem(x), self.w, groups=2)  # (B, 4, 8, 8)
        h = torch.roll(h, shifts=1, dims=2).masked_fill(self.mask, 0.5)  # (B, 4, 8, 8)
        s = h.sum(dim=(2, 3), keepdim=True) + h.mean(dim=3, keepdim=True)  # (B, 4, 8, 1)
        z = self.flat(self.soft(self.pool(h * s)))  # (B, 16)
        return F.cross_entropy(z, y)


def _full_inputs(g, op):
    """test_llama's random whole inputs, with boolean masks as booleans."""
    out = _llama_full_inputs(g, op)
    return [x.bool() if g.tensors[t].dtype == "bool" else x for x, t in zip(out, op.inputs)]


def test_vision_operator_pieces_match_the_whole(monkeypatch):
    monkeypatch.setattr(test_llama, "_full_inputs", _full_inputs)
    g = trace(_VisionOps(), (torch.zeros(2, 3, 8, 8), torch.zeros(2, dtype=torch.long)))
    assert not g.unknown
    assert {"conv", "roll", "masked_fill", "sum", "mean", "avg_pool", "softmax", "reshape"} <= {
        op.kind for op in g.operators
    }
    assert _check_pieces(g) > 15


def test_swin_operator_pieces_match_the_whole():
    _, g = traced("swin-tiny", 2, (("depths", "2,2"), ("num_heads", "2,4")))
    assert {"conv", "roll", "avg_pool", "matmul", "softmax", "permute"} <= {op.kind for op in g.operators}
    assert _check_pieces(g) > 300


# ---- registry --------------------------------------------------------------------------


def test_family_with_overrides_builds_and_runs():
    spec = ModelSpec("swin", (("depths", "1,1"), ("embed", 8), ("image", 16), ("num_heads", "2,4"), ("window", 2)))
    cfg = spec.config()
    assert (cfg.depths, cfg.num_heads, cfg.layers, cfg.heads, cfg.classes) == ((1, 1), (2, 4), 2, 2, 1000)
    model, (images, labels) = build_model(spec, batch=3, device="cpu")
    assert images.shape == (3, 3, 16, 16) and model(images, labels).shape == ()
    assert ModelSpec("swin-t", (("depths", "2,2,2,2"),)).config().layers == 8


@pytest.mark.parametrize(
    "name, args, message",
    [
        ("swin", (("embed", 96),), "model family 'swin' needs --model-arg for depths, num_heads"),
        ("swin-t", (("depths", "2,two"),), "depths='2,two' is not a list of integers like 2,2,6,2"),
        ("swin-t", (("num_heads", "3,6,12"),), "num_heads=3,6,12 must give positive heads for each of the 4 stages"),
        ("swin-t", (("window", 5),), "stage 0's 56x56 token map is not divisible into windows of window=5"),
        ("swin-t", (("embed", 100),), "stage 0's 100 channels (embed=100 x 1) are not divisible by its num_heads=3"),
        ("swin-t", (("image", 226),), "image=226 is not divisible by patch=4"),
        ("swin-t", (("image", 200),), "the 50x50 patch grid (image=200, patch=4) does not halve 3 times"),
        ("swin-t", (("window", 0),), "window=0 must be a positive integer"),
    ],
)
def test_bad_model_arguments(name, args, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        ModelSpec(name, args).config()


def test_models_command_lists_swin(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"swin-g +3,000\.8M params  embed=512 depths=2,2,42,4 num_heads=16,32,64,128\n", out)
    assert "swin-tiny" in out and "family: swin (use --model swin --model-arg embed=.. depths=.. num_heads=..)" in out


@pytest.mark.parametrize(
    "preset, tp, message",
    [
        ("swin-t", 2, "tp=2 does not divide the model's 3 attention heads"),  # heads 3, 6, 12, 24: their gcd
        ("swin-b", 4, ""),  # heads 4, 8, 16, 32
        ("swin-b", 8, "tp=8 does not divide the model's 4 attention heads"),
        ("swin-tiny", 2, ""),  # heads 2, 4, 8
    ],
)
def test_tp_must_divide_every_stage_heads(preset, tp, message):
    spec, g = traced(preset, 8)
    ctx = Context(g, spec, 8, "cpu", tp, tp, 1)
    assert get_space("tp").explain(ctx, {"tp": tp}) == message


# ---- plans on 2 gloo ranks match one process ---------------------------------------------


@pytest.mark.parametrize(
    "knobs",
    [
        dict(dp=2, tp=1, pp=1, microbatch=2),  # data parallel, 2 micro-batches: windows split by image
        dict(dp=1, tp=2, pp=1, microbatch=8),  # tensor parallel: q/k/v, fc1 columns; proj, fc2 rows; heads between
        dict(dp=1, tp=1, pp=2, microbatch=4),  # 2 pipeline stages of 3 blocks, patch merging with its stage
    ],
)
def test_swin_tiny_plans_match_one_process(knobs):
    spec, g = traced("swin-tiny", 8)
    plan = get_space("megatron").build(Context(g, spec, 8, "cpu", 2, 2, 1), knobs)
    if knobs["tp"] == 2:
        dims = tensor_parallel_dims(g)
        assert {dims[f"blocks_0_{n}"] for n in ("attn_q", "attn_k", "attn_v", "mlp_fc1")} == {"n"}
        assert dims["blocks_0_attn_proj"] == dims["blocks_0_mlp_fc2"] == "k"
        split = {op.kind for op in g.operators if dims[op.name] is not None}
        assert {"matmul", "softmax", "add", "roll"} - split == {"roll"}  # heads split, window shifts whole
    res = launch_local(plan, 2, steps=2, lr=1e-2)
    assert res.max_loss_error <= LOSS_TOL, (res.losses, res.ref_losses)
    assert res.max_grad_error <= GRAD_TOL
    assert res.losses[1] < res.losses[0]
