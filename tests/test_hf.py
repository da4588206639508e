"""Hugging Face transformers models built from a config and traced unmodified (planlab/graph/hf.py):
the six families trace at a tiny size (GPT-2 and LLaMA also at their full size, on meta), the
tracer's rewrites and the HF operator signatures, every operator piece against the whole, errors
that name the model code's line, and data- and tensor-parallel plans on 2 gloo ranks matching
one process."""

import operator
import re
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.node import map_aggregate

pytest.importorskip("transformers")

from planlab.cli import GRAD_TOL, LOSS_TOL  # noqa: E402
from planlab.errors import ConfigError, GraphError  # noqa: E402
from planlab.executor import launch_local, run_piece  # noqa: E402
from planlab.executor.randomness import PieceRandomness  # noqa: E402
from planlab.graph import trace  # noqa: E402
from planlab.graph.ops_hf import kept_mean  # noqa: E402
from planlab.graph.registry import OpContext, lookup  # noqa: E402
from planlab.models import ModelSpec, build_model  # noqa: E402
from planlab.plan.program import Task, TaskKind  # noqa: E402
from planlab.search_spaces import Context, get_space  # noqa: E402
from planlab.search_spaces.builtin import fused_qkv  # noqa: E402

from conftest import traced  # noqa: E402

HF = "planlab.models.hf:"


def _spec(family: str, **args) -> ModelSpec:
    return ModelSpec(HF + family, tuple(sorted(args.items())))


# ---- the six families trace at a tiny size --------------------------------------------------


@pytest.mark.parametrize(
    "family, kinds",
    [
        ("llama", {"attention", "linear", "embedding", "rsqrt", "cross_entropy"}),
        ("gpt2", {"attention", "linear", "layer_norm", "split", "pointwise"}),
        ("t5", {"matmul", "softmax", "setitem", "constant", "embedding"}),
        ("mixtral", {"attention", "topk", "getitem", "matmul", "softmax"}),
        ("swin", {"conv", "roll", "pad", "attention", "avg_pool"}),
        ("vit", {"conv", "attention", "cat", "layer_norm"}),
    ],
)
def test_tiny_families_trace_with_every_operator_known(family, kinds):
    spec, g = traced(HF + family, 4)
    model, _ = build_model(spec, batch=1)
    assert not g.unknown, g.unknown
    assert g.tensors[g.loss].shape == ()
    assert g.num_params == sum(p.numel() for p in model.parameters())
    present = {op.kind for op in g.operators} | {"rsqrt" for op in g.operators if "rsqrt" in op.name}
    assert kinds <= present, kinds - present


# Full sizes on meta (no memory for weights). Llama-2 7B: the released checkpoint's 6,738,415,616
# parameters (untied, as released). GPT-2 124M: 124,439,808 parameters with the output layer tied
# to the token embedding (Radford et al. 2019), plus 50,257 x 768 for the untied output layer.
@pytest.mark.parametrize(
    "family, params, ops",
    [
        ("llama", 6_738_415_616, 32 * 2),
        ("gpt2", 124_439_808 + 50_257 * 768, 12 * 2),
    ],
)
def test_full_sizes_trace_on_meta(family, params, ops):
    spec, g = traced(HF + family, 8, (("size", "full"),))
    assert g.num_params == params
    assert not g.unknown
    assert (
        sum(
            op.kind in ("attention", "linear") and "proj" in op.module and "o_proj" not in op.module
            for op in g.operators
        )
        >= ops
    )
    assert sum(op.kind == "attention" for op in g.operators) == ops // 2


# ---- what the tracer rewrites ------------------------------------------------------------------


def _flat(x):
    if isinstance(x, (tuple, list)):
        return [y for v in x for y in _flat(v)]
    if isinstance(x, dict):
        return _flat(list(x.values()))
    return [x]


def test_causal_lm_loss_is_a_sum_over_the_kept_targets():
    """HF pads the labels with ignore_index: the mean becomes sum / count, both split over the batch."""
    _, g = traced(HF + "llama", 4)
    ce = next(op for op in g.operators if op.kind == "cross_entropy")
    assert ce.call.kwargs["reduction"] == "sum" and ce.call.kwargs["ignore_index"] == -100
    assert ce.signature.reduce  # a piece's loss is a partial sum
    last = g.producer[g.loss]
    assert last.call.target is kept_mean and last.kind == "kept_mean"  # total / (count x micro-batches) per piece
    count = g.producer[last.inputs[1]]
    assert count.kind == "sum" and g.producer[count.inputs[0]].call.target is operator.ne


@pytest.mark.parametrize("family", ["llama", "t5", "swin"])
def test_no_device_is_recorded(family):
    """Devices are dropped from the recorded calls: pieces run where their inputs are."""
    _, g = traced(HF + family, 4)
    for op in g.operators:
        values = _flat(list(op.call.args) + [op.call.kwargs])
        assert not any(isinstance(v, torch.device) for v in values), op
        assert "device" not in op.call.kwargs, op


def test_causal_attention_keeps_is_causal_and_no_mask():
    """Positions are constants computed while tracing, so HF sees no packed sequences and uses
    sdpa's causal flag instead of a mask tensor; GQA heads are a group of the key/value heads."""
    _, g = traced(HF + "llama", 4)
    att = [op for op in g.operators if op.kind == "attention"]
    assert att and all(op.call.kwargs.get("is_causal") is True and len(op.inputs) == 3 for op in att)
    assert str(att[0].signature) == "a0 (a1 rep^) s^ d^, a0 a1 t^ d^, a0 a1 t^ e^ -> a0 (a1 rep^) s^ e^"
    assert [op.kind for op in g.operators].count("constant") == 1  # the positions


def test_t5_decoder_inputs_are_written_functionally():
    """``_shift_right`` writes a new tensor in place; each write is one setitem operator."""
    _, g = traced(HF + "t5", 4)
    writes = [op for op in g.operators if op.kind == "setitem"]
    assert len(writes) == 2 and all(op.module.endswith("model") for op in writes)
    assert writes[1].inputs[0] == writes[0].outputs[0]  # the second write reads the first's result
    assert "a0" in writes[0].splittable_dims()  # the batch splits


def test_key_value_cache_is_off_while_tracing_and_restored():
    tf = pytest.importorskip("transformers")
    cfg = tf.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    assert cfg.use_cache

    class Loss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = tf.LlamaForCausalLM(cfg)

        def forward(self, ids, labels):
            return self.lm(input_ids=ids, labels=labels).loss

    ids = torch.randint(0, 64, (2, 8))
    module = Loss()
    g = trace(module, (ids, ids))
    assert module.lm.config.use_cache and not g.unknown
    # no cache: the positions are the only constant (a cache would add its empty key and value tensors)
    assert [op.kind for op in g.operators].count("constant") == 1


# ---- signatures of the HF operators --------------------------------------------------------------


def _sig(target, kind: str, tensors: list, args: tuple, kwargs: dict, module=None) -> str:
    """Signature of one call (TensorArg slots in ``args``/``kwargs`` stand for ``tensors``)."""
    _, _, _, T = _hf_functions()
    sub = lambda a: tensors[a.index] if isinstance(a, T) else a  # noqa: E731
    real_args, real_kwargs = map_aggregate(args, sub), map_aggregate(kwargs, sub)
    if module is not None:
        out = module(*tensors)
        tensors = tensors + [p for p in module.parameters()]
    elif isinstance(target, str):
        out = getattr(real_args[0], target)(*real_args[1:], **real_kwargs)
    else:
        out = target(*real_args, **real_kwargs)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    ctx = OpContext(tuple(tuple(t.shape) for t in tensors), tuple(tuple(o.shape) for o in outs), args, kwargs, module)
    d = lookup(
        "call_module" if module is not None else "call_method" if isinstance(target, str) else "call_function",
        target,
        module,
    )
    assert d is not None and d.kind == kind, d
    return str(d.signature(ctx))


def _hf_functions():
    from planlab.graph.ops_hf import Constant, constant, functional_setitem, register_transformers_modules
    from planlab.graph.ir import TensorArg

    register_transformers_modules()
    return Constant, constant, functional_setitem, TensorArg


def _signature_cases():
    Constant, constant, setitem, T = _hf_functions()
    from transformers.pytorch_utils import Conv1D

    q, kv = torch.zeros(2, 4, 5, 8), torch.zeros(2, 2, 5, 8)
    mask = torch.zeros(2, 1, 5, 5, dtype=torch.bool)
    x, ids = torch.zeros(2, 6), torch.zeros(2, 6, dtype=torch.long)
    w = torch.zeros(4, 3, 8)
    return [
        (
            F.scaled_dot_product_attention,
            "attention",
            [q, kv, kv],
            (T(0), T(1), T(2)),
            {"enable_gqa": True, "is_causal": True},
            None,
            "a0 (a1 rep^) s^ d^, a0 a1 t^ d^, a0 a1 t^ e^ -> a0 (a1 rep^) s^ e^",
        ),
        (
            F.scaled_dot_product_attention,
            "attention",
            [q, q, q, mask],
            (T(0), T(1), T(2)),
            {"attn_mask": T(3)},
            None,
            "a0 a1 s^ d^, a0 a1 t^ d^, a0 a1 t^ e^, a0 1 s^ t^ -> a0 a1 s^ e^",
        ),
        (None, "linear", [torch.zeros(2, 5, 8)], (T(0),), {}, Conv1D(12, 8), "a0 a1 k+, k+ n, n -> a0 a1 n"),
        (
            setitem,
            "setitem",
            [ids, ids[:, :-1]],
            (T(0), (Ellipsis, slice(1, None)), T(1)),
            {},
            None,
            "a0 x1^, a0 y1^ -> a0 x1^",
        ),
        (setitem, "setitem", [ids], (T(0), (Ellipsis, 0), 7), {}, None, "a0 x1^ -> a0 x1^"),
        (
            operator.getitem,
            "getitem",
            [w, torch.zeros(10, dtype=torch.long)],
            (T(0), T(1)),
            {},
            None,
            "v^ a1 a2, i0 -> i0 a1 a2",
        ),
        (
            "split",
            "split",
            [torch.zeros(2, 5, 12)],
            (T(0), 4, 2),
            {},
            None,
            "a0 a1 cin^ -> a0 a1 c0^, a0 a1 c1^, a0 a1 c2^",
        ),
        (F.pad, "pad", [ids], (T(0), (0, 1)), {"value": -100}, None, "a0 p1^ -> a0 q1^"),
        (
            torch.where,
            "elementwise",
            [mask, torch.zeros(2, 4, 5, 5), torch.zeros(1)],
            (T(0), T(1), T(2)),
            {},
            None,
            "a0 1 a2 a3, a0 a1 a2 a3, 1 -> a0 a1 a2 a3",
        ),
        ("rsqrt", "pointwise", [x], (T(0),), {}, None, "a0 a1 -> a0 a1"),
        (constant, "constant", [], (Constant(torch.arange(6)[None]),), {}, None, " -> f0^ f1^"),
        ("new_zeros", "factory", [ids], (T(0), (2, 6)), {}, None, "x0^ x1^ -> f0^ f1^"),
        ("mean", "mean", [q], (T(0), -1), {"keepdim": True}, None, "a0 a1 a2 r3^ -> a0 a1 a2 1"),
    ]


@pytest.mark.parametrize("case", range(13))
def test_hf_operator_signatures(case):
    target, kind, tensors, args, kwargs, module, sig = _signature_cases()[case]
    assert _sig(target, kind, tensors, args, kwargs, module) == sig


# ---- every operator piece computes its slice of the whole ----------------------------------------


def _full_inputs(g, op):
    """Whole inputs of one operator: positive floats (norms take square roots), small integers."""
    out = []
    for t in op.inputs:
        spec = g.tensors[t]
        x = torch.rand(spec.shape) + 0.5 if spec.is_float else torch.randint(0, 2, spec.shape)
        out.append(x.bool() if spec.dtype == "bool" else x)
    return out


def _check_pieces(g) -> int:
    """Each operator split in two along each splittable dimension: its pieces' outputs, joined
    (or summed over a reduction), equal the whole operator's outputs."""
    torch.manual_seed(0)
    checked = 0
    rng = PieceRandomness(g, 1, seed=0)  # random operators: each piece draws its box of the whole draw
    for op in g.operators:
        ins = _full_inputs(g, op)
        shape = g.tensors[op.outputs[0]].shape
        with rng.piece(op, tuple((0, n) for n in shape), 0, 0):
            whole = run_piece(op, Task(op.name, TaskKind.FORWARD, shape=shape), ins, g, 1)
        whole = tuple(whole) if isinstance(whole, (tuple, list)) else (whole,)
        for dim in op.splittable_dims():
            if op.dim_sizes[dim] % 2:
                continue
            parts = []
            for p in range(2):
                piece = [
                    x.chunk(2, a)[p] if (a := _axis(axes, dim)) is not None else x
                    for x, axes in zip(ins, op.signature.inputs)
                ]
                out_axis = _axis(op.signature.outputs[0], dim)
                pshape = list(shape)
                if out_axis is not None:
                    pshape[out_axis] //= 2
                lead = p == 0 or dim not in op.signature.reduce  # terms added once go to one piece
                box = tuple(
                    (p * m, p * m + m) if a == out_axis else (0, n) for a, (n, m) in enumerate(zip(shape, pshape))
                )
                with rng.piece(op, box, 0, 0):
                    out = run_piece(
                        op,
                        Task(op.name, TaskKind.FORWARD, shape=tuple(pshape), lead=lead),
                        piece,
                        g,
                        1,
                        vocab_offset=p * op.dim_sizes[dim] // 2 if dim == "v" else 0,
                    )
                parts.append(tuple(out) if isinstance(out, (tuple, list)) else (out,))
            for k, w in enumerate(whole):
                axis = _axis(op.signature.outputs[k], dim)
                joined = (
                    parts[0][k] + parts[1][k]
                    if dim in op.signature.reduce
                    else torch.cat([parts[0][k], parts[1][k]], axis)
                )
                assert torch.allclose(joined.float(), w.float(), atol=1e-5, equal_nan=True), (str(op), dim)
            checked += 1
    return checked


def _axis(axes, dim):
    return next((a for a, ax in enumerate(axes) if ax and ax[0] == dim), None)


@pytest.mark.parametrize(
    "family, args",
    [
        ("llama", (("layers", 1),)),
        ("gpt2", (("layers", 1),)),
        ("t5", (("layers", 1),)),
        ("mixtral", (("layers", 1),)),
        ("swin", ()),
    ],
)
def test_operator_pieces_match_the_whole(family, args):
    _, g = traced(HF + family, 4, args)
    assert _check_pieces(g) > 20


# ---- errors ------------------------------------------------------------------------------------------


def test_value_dependent_control_flow_names_the_line_and_a_way_out():
    spec = _spec("mixtral", experts_impl="eager", layers=1)
    model, inputs = build_model(spec, batch=2)
    with pytest.raises(GraphError) as info:
        trace(model, inputs)
    msg = str(info.value)
    assert msg.startswith("torch.fx could not trace HFLoss: ")
    assert "modeling_mixtral.py:" in msg and "experts_implementation='batched_mm'" in msg


def test_tied_weights_are_refused_by_name():
    tf = pytest.importorskip("transformers")
    cfg = tf.GPT2Config(vocab_size=64, n_positions=8, n_embd=16, n_layer=1, n_head=2)  # ties by default

    class Loss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = tf.GPT2LMHeadModel(cfg)

        def forward(self, ids, labels):
            return self.lm(input_ids=ids, labels=labels).loss

    ids = torch.randint(0, 64, (2, 8))
    with pytest.raises(
        GraphError,
        match=r"parameters 'lm\.transformer\.wte\.weight' and 'lm\.lm_head\.weight' "
        r"are one tied tensor.*tie_word_embeddings=False",
    ):
        trace(Loss(), (ids, ids))


@pytest.mark.parametrize(
    "family, args, message",
    [
        ("llama", {"size": "huge"}, "size='huge': choose 'tiny' or 'full'"),
        ("llama", {"kv_heads": 3}, "kv_heads=3 does not divide heads=4"),
        ("gpt2", {"colour": 1}, "raised TypeError: gpt2() got an unexpected keyword argument 'colour'"),
        ("mixtral", {"top_k": 5}, "top_k=5 must be between 1 and experts=4"),
        ("vit", {"patch": 5}, "patch=5 does not divide image=16"),
    ],
)
def test_bad_model_arguments(family, args, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        build_model(_spec(family, **args), batch=2, device="cpu")


def test_missing_transformers_names_the_extra(monkeypatch):
    from planlab.models import hf

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    with pytest.raises(ConfigError, match=r"install planlab's hf extra \(pip install 'planlab\[hf\]'"):
        hf.llama()


def test_tp_splits_gpt2_mlp_and_keeps_its_fused_qkv_attention_whole():
    spec, g = traced(HF + "gpt2", 4)
    ctx = Context(g, spec, 4, "cpu", 2, 2, 1)
    assert fused_qkv(g) == "model.transformer.h.0.attn.c_attn"
    dims = {p.op: p.dims for p in get_space("megatron").build(ctx, dict(dp=1, tp=2, pp=1, microbatch=4)).ops}
    assert "n" in dims["model_transformer_h_0_mlp_c_fc"] and "k" in dims["model_transformer_h_0_mlp_c_proj"]
    assert not any(dims["model_transformer_h_0_attn_c_attn"])  # its column shards would mix q, k and v


# ---- plans on 2 gloo ranks match one process -----------------------------------------------------------

DP = dict(dp=2, tp=1, pp=1, microbatch=2)
TP = dict(dp=1, tp=2, pp=1, microbatch=4)
# A column-parallel projection whose output dimension tp splits, per family (fx names are snake case).
COLUMN = {
    "llama": "self_attn_k_proj",
    "gpt2": "mlp_c_fc",
    "mixtral": "self_attn_q_proj",
    "t5": "enc_dec_attention_v",
    "vit": "attention_q_proj",
    "swin": "attention_v_proj",
}


@pytest.mark.parametrize(
    "family, knobs",
    [
        *[(f, DP) for f in ("llama", "gpt2", "t5", "mixtral", "swin", "vit")],
        *[(f, TP) for f in ("llama", "gpt2", "t5", "mixtral", "swin", "vit")],
        ("gpt2", {**DP, "microbatch": 1}),  # 2 micro-batches a replica: each divides by its count x 2
        # 2 micro-batches under tp: Swin's window mask, a constant made at the whole batch, gives each its rows
        ("swin", {**TP, "microbatch": 2}),
        # micro-batches of T5: _shift_right's x.new_zeros(x.shape), a factory sized at the whole batch, gives
        # each micro-batch its rows (fuzz plan 206: 2 micro-batches; plan 211: 4 of one sample, where the write
        # into it broadcast one row over the whole batch and the decoder ran on 4 samples)
        ("t5", {**TP, "microbatch": 2}),
        ("t5", {**TP, "microbatch": 1}),
    ],
)
def test_tiny_plans_match_one_process(family, knobs):
    spec, g = traced(HF + family, 4)
    plan = get_space("megatron").build(Context(g, spec, 4, "cpu", 2, 2, 1), knobs)
    dims = {p.op: p.dims for p in plan.ops}
    if knobs["tp"] == 2:
        split = [op for op, d in dims.items() if COLUMN[family] in op and "n" in d]
        assert split, f"no {COLUMN[family]} projection is split"
    res = launch_local(plan, 2, steps=2, lr=1e-2)
    assert res.max_loss_error <= LOSS_TOL, (res.losses, res.ref_losses)
    assert res.max_grad_error <= GRAD_TOL
    assert res.losses[1] < res.losses[0]
