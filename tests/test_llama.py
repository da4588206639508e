"""The LLaMA family: preset sizes against Meta's published counts, its operators' signatures and
their pieces, the model registry, and data- and tensor-parallel plans on 2 gloo ranks."""

import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from planlab.cli import GRAD_TOL, LOSS_TOL, main
from planlab.errors import ConfigError
from planlab.executor import launch_local
from planlab.executor.pieces import run_piece
from planlab.graph import trace
from planlab.graph.registry import OpContext, lookup
from planlab.models import LLAMA_PRESETS, ModelSpec, build_model
from planlab.plan.program import Task, TaskKind
from planlab.search_spaces import Context, get_space

from conftest import traced

# Exact parameter totals of Meta's released checkpoints, as the Hugging Face model pages of
# meta-llama/Llama-2-{7b,13b,70b}-hf, Meta-Llama-3-{8B,70B} and Llama-3.1-405B report them
# (safetensors metadata: 6.74B, 13.0B, 69.0B, 8.03B, 70.6B, 406B). The papers round them to
# 7B/13B/70B (Touvron et al. 2023, table 1) and 8B/70B/405B (Llama Team 2024, table 3).
PUBLISHED = {
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3-405b": 405_853_388_800,
}


@pytest.mark.parametrize("preset, published", sorted(PUBLISHED.items()))
def test_preset_parameter_counts_match_published(preset, published):
    assert abs(LLAMA_PRESETS[preset].num_params() - published) / published < 0.01


def test_module_parameter_count_is_the_config_count():
    spec, g = traced("llama-tiny", 8)
    model, _ = build_model(spec, batch=1)
    assert g.num_params == sum(p.numel() for p in model.parameters()) == spec.config().num_params()
    assert not g.unknown


def test_llama3_405b_traces_on_meta():
    spec, g = traced("llama3-405b", 8)
    assert g.num_params == PUBLISHED["llama3-405b"]
    assert not g.unknown
    assert not any(op.kind == "repeat_interleave" for op in g.operators)  # grouped heads read unrepeated
    att = [op for op in g.operators if op.kind == "attention"]
    assert len(att) == 126 and all(g.tensors[op.inputs[1]].shape[1] == 8 for op in att)  # 8 key/value heads


# ---- signatures ---------------------------------------------------------------


def _sig(target, kind: str, args: tuple, kwargs: dict | None = None, module=None) -> str:
    """Signature of one call, read by the registry from the shapes the call produces."""
    kwargs = kwargs or {}
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if args and isinstance(args[0], (list, tuple)):
        tensors = list(dict.fromkeys(args[0]))
    if module is not None:
        tensors += [p for p in module.parameters()]
        out = module(*args)
    else:
        out = getattr(args[0], target)(*args[1:], **kwargs) if isinstance(target, str) else target(*args, **kwargs)
    slot = lambda a: "T" if isinstance(a, torch.Tensor) else a  # noqa: E731
    tmpl = tuple(type(a)(slot(x) for x in a) if isinstance(a, (list, tuple)) else slot(a) for a in args)
    ctx = OpContext(tuple(tuple(t.shape) for t in tensors), (tuple(out.shape),), tmpl, kwargs, module)
    d = lookup(
        "call_module" if module is not None else "call_method" if isinstance(target, str) else "call_function",
        target,
        module,
    )
    assert d is not None and d.kind == kind
    return str(d.signature(ctx))


x4 = torch.zeros(2, 3, 4, 6, device="meta")
x3 = torch.zeros(2, 3, 8, device="meta")


@pytest.mark.parametrize(
    "target, kind, args, kwargs, sig",
    [
        (operator.getitem, "getitem", (x4, (Ellipsis, slice(None, 3))), {}, "a0 a1 a2 x3^ -> a0 a1 a2 y3^"),
        (operator.getitem, "getitem", (x4, (slice(None), 1)), {}, "a0 x1^ a2 a3 -> a0 a2 a3"),
        (operator.getitem, "getitem", (x4, (None, Ellipsis)), {}, "a0 a1 a2 a3 -> 1 a0 a1 a2 a3"),
        (operator.getitem, "getitem", (x4, slice(1, 2)), {}, "x0^ a1 a2 a3 -> y0^ a1 a2 a3"),
        (operator.neg, "neg", (x4,), {}, "a0 a1 a2 a3 -> a0 a1 a2 a3"),
        (torch.cat, "cat", ((x4, x4[..., :2]),), {"dim": -1}, "a0 a1 a2 c0^, a0 a1 a2 c1^ -> a0 a1 a2 cout^"),
        (torch.cat, "cat", ((x4, x4),), {"dim": 1}, "a0 c0^ a2 a3 -> a0 cout^ a2 a3"),
        ("repeat_interleave", "repeat_interleave", (x4, 2), {"dim": 1}, "a0 a1 a2 a3 -> a0 (a1 rep^) a2 a3"),
        (torch.repeat_interleave, "repeat_interleave", (x4, 2, 0), {}, "a0 a1 a2 a3 -> (a0 rep^) a1 a2 a3"),
        ("unsqueeze", "reshape", (x3, 2), {}, "g0_0 g1_0 g2_0 -> g0_0 g1_0 1 g2_0"),
        ("expand", "expand", (x3[:, :, None, :], 2, 3, 5, 8), {}, "a0 a1 1 a3 -> a0 a1 e2^ a3"),
        (F.rms_norm, "rms_norm_fn", (x3, (8,), torch.zeros(8, device="meta")), {}, "a0 a1 h0^, h0^ -> a0 a1 h0^"),
    ],
)
def test_signatures(target, kind, args, kwargs, sig):
    assert _sig(target, kind, args, kwargs) == sig


def test_rms_norm_module_signature():
    m = nn.RMSNorm(8, device="meta")
    assert _sig(None, "rms_norm", (x3,), module=m) == "a0 a1 h0^, h0^ -> a0 a1 h0^"


# ---- every operator piece computes its slice of the whole -------------------------


class _Ops(nn.Module):
    """The shape operators LLaMA does not use, in a model that ends in a loss."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)  # (B, T, 8)
        e = h.unsqueeze(2).expand(-1, -1, 2, -1).flatten(2)  # (B, T, 16)
        s = h[:, 1:, None, :4].squeeze(2)  # (B, T-1, 4)
        z = torch.cat((e[:, 1:], s, -s), dim=-1)  # (B, T-1, 24)
        return F.cross_entropy(z.flatten(0, 1), y[:, 1:].flatten())


def _full_inputs(g, op):
    out = []
    for t in op.inputs:
        spec = g.tensors[t]
        out.append(torch.randn(spec.shape) if spec.is_float else torch.randint(0, 2, spec.shape))
    return out


def _axis(axes, dim):
    return next((a for a, ax in enumerate(axes) if ax and ax[0] == dim), None)


def _check_pieces(g):
    """Each operator split in two along each splittable dimension: the pieces' outputs,
    concatenated (or summed over a reduction), equal the whole operator's output."""
    torch.manual_seed(0)
    checked = 0
    for op in g.operators:
        full_in = _full_inputs(g, op)
        whole = run_piece(op, Task(op.name, TaskKind.FORWARD, shape=g.tensors[op.outputs[0]].shape), full_in, g, 1)
        for dim in op.splittable_dims():
            if op.dim_sizes[dim] % 2:
                continue
            parts = []
            for p in range(2):
                ins = [
                    x.chunk(2, a)[p] if (a := _axis(axes, dim)) is not None else x
                    for x, axes in zip(full_in, op.signature.inputs)
                ]
                out_axis = _axis(op.signature.outputs[0], dim)
                shape = list(whole.shape)
                if out_axis is not None:
                    shape[out_axis] //= 2
                lead = p == 0 or dim not in op.signature.reduce  # terms added once go to one piece
                task = Task(op.name, TaskKind.FORWARD, shape=tuple(shape), lead=lead)
                parts.append(
                    run_piece(
                        op,
                        task,
                        ins,
                        g,
                        1,  # an embedding piece's rows start at its offset
                        vocab_offset=p * op.dim_sizes[dim] // 2 if dim == "v" else 0,
                    )
                )
            joined = parts[0] + parts[1] if dim in op.signature.reduce else torch.cat(parts, out_axis)
            assert torch.allclose(joined, whole, atol=1e-5), (str(op), dim)
            checked += 1
    return checked


def test_llama_operator_pieces_match_the_whole():
    _, g = traced("llama-tiny", 4, (("layers", 1),))
    kinds = {op.kind for op in g.operators}
    assert {"getitem", "neg", "cat", "attention", "rms_norm"} <= kinds  # the attention on grouped heads
    assert _check_pieces(g) > 50


def test_shape_operator_pieces_match_the_whole():
    g = trace(_Ops(), (torch.zeros(2, 4, 8), torch.zeros(2, 4, dtype=torch.long)))
    assert not g.unknown
    assert {"expand", "reshape", "getitem", "cat", "neg"} <= {op.kind for op in g.operators}
    assert _check_pieces(g) > 10


# ---- registry ------------------------------------------------------------------

FAMILY_ARGS = (
    ("ffn_hidden", 96),
    ("heads", 4),
    ("hidden", 32),
    ("kv_heads", 2),
    ("layers", 2),
    ("seq", 16),
    ("vocab", 64),
)


def test_family_with_overrides_builds_and_traces():
    spec = ModelSpec("llama", FAMILY_ARGS)
    cfg = spec.config()
    assert (cfg.layers, cfg.kv_heads, cfg.rope_theta) == (2, 2, 10000.0)
    model, (idx, tgt) = build_model(spec, batch=3, device="cpu")
    assert idx.shape == (3, 16) and model(idx, tgt).shape == ()
    assert ModelSpec("llama3-8b", (("layers", 2),)).config().layers == 2


@pytest.mark.parametrize(
    "name, args, message",
    [
        ("llama-huge", (), "unknown model 'llama-huge'; choose 'gpt-tiny'"),
        ("llama", (("layers", 2),), "model family 'llama' needs --model-arg for hidden, heads, kv_heads, ffn_hidden"),
        ("llama-tiny", (("ffn_mult", 2),), "unknown model argument 'ffn_mult' for 'llama-tiny'; choose 'layers'"),
        ("llama-tiny", (("kv_heads", 3),), "kv_heads=3 does not divide heads=4"),
        ("llama-tiny", (("heads", 3),), "hidden=64 is not divisible by heads=3"),
    ],
)
def test_bad_model_names_and_arguments(name, args, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        ModelSpec(name, args).config()


def test_tp_must_divide_the_key_value_heads():
    spec, g = traced("llama-tiny", 8, (("kv_heads", 1),))
    ctx = Context(g, spec, 8, "cpu", 2, 2, 1)
    assert get_space("tp").explain(ctx, {"tp": 2}) == "tp=2 does not divide the model's 1 key/value heads"
    assert [a["tp"] for a in get_space("megatron").assignments(ctx, {"pp": 1, "dp": 1})] == []


def test_models_command_lists_both_families(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for name in ("gpt3-175b", "llama-tiny", "llama2-70b", "llama3-405b"):
        assert name in out
    assert "405,853.4M params" in out and "kv_heads=8" in out


# ---- plans on 2 gloo ranks match one process --------------------------------------


@pytest.mark.parametrize(
    "knobs",
    [
        dict(dp=2, tp=1, pp=1, microbatch=2),  # data parallel, 2 micro-batches
        dict(dp=1, tp=2, pp=1, microbatch=8),  # Megatron tensor parallel: q/k/v, w1/w3 columns; wo, w2 rows
    ],
)
def test_llama_tiny_plans_match_one_process(knobs):
    spec, g = traced("llama-tiny", 8)
    plan = get_space("megatron").build(Context(g, spec, 8, "cpu", 2, 2, 1), knobs)
    if knobs["tp"] == 2:  # key/value projections are split by heads, as the queries are
        assert "n" in {p.op: p.dims for p in plan.ops}["blocks_0_attention_wk"]
    res = launch_local(plan, 2, steps=2, lr=1e-2)
    assert res.max_loss_error <= LOSS_TOL, (res.losses, res.ref_losses)
    assert res.max_grad_error <= GRAD_TOL
    assert res.losses[1] < res.losses[0]
