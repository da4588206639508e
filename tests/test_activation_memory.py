"""Activation memory per transformer layer against Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", sections 4.1 to 4.3 and Table 2).

With 16-bit activations, sequence s, micro-batch b, hidden h, a heads and tensor parallelism t, a
Megatron-LM layer keeps (bytes): no recomputation ``s b h (34 + 5 a s / h)`` without tensor
parallelism, ``s b h (10 + 24 / t + 5 a s / (h t))`` with it, ``s b h / t (34 + 5 a s / h)`` with
sequence parallelism; selective recomputation with sequence parallelism ``34 s b h / t``; full
recomputation ``2 s b h`` (``2 s b h / t`` with sequence parallelism). Under FP8 training with
Transformer Engine (``megatron`` software, ``fp8``) the linear layers keep the one-byte FP8 cast of
their inputs: the QKV, projection and fc1 inputs ``2 s b h`` become ``s b h`` each and fc2's
``8 s b h`` becomes ``4 s b h``, so 34 becomes 27 (10 + 24 / t: 8 + 19 / t). planlab's per-layer figure
is the simulated peak of a GPT with 4 layers less that of the same GPT with 2 layers, halved
(embedding, output layer and the backward's working set cancel), under the ``megatron-2022``
software (Megatron-LM's unfused attention, as the paper measured it).

With fused attention (``megatron``: Transformer Engine's flash / cuDNN attention in Megatron-Core) no
score matrix is kept: the ``5 a s / h`` term becomes the softmax's log-sum-exp, 4 bytes per query
row and head (``4 a / h`` in units of ``s b h``), so no recomputation keeps what selective
recomputation keeps, plus that. Under FP8 the fused attention keeps its 16-bit output ``O`` for its
backward (``2 s b h``) beside the projection's FP8 cast of it, so 27 becomes 29 (8 + 21 / t) unless
selective recomputation recomputes the attention core.
"""

from __future__ import annotations

import dataclasses

import pytest

from planlab.costmodel import CostModel
from planlab.explore import memory_lower_bound_bytes
from planlab.graph.trace import trace
from planlab.models.registry import ModelSpec, build_model
from planlab.plan.software_passes import build_program
from planlab.search_spaces.builtin import get_space
from planlab.search_spaces.screen import Screen
from planlab.search_spaces.space import Context
from planlab.simulator import simulate

H, A, S, B = 256, 8, 128, 2  # hidden, heads, sequence, micro-batch
SBH = S * B * H
COST = CostModel.load("dgx-a100-80g", 1, software="megatron-2022", precision="bf16")
FUSED = CostModel.load("dgx-a100-80g", 1, software="megatron", precision="bf16")
TORCH = CostModel.load("dgx-a100-80g", 1, software="torch", precision="bf16")
FP8 = CostModel.load("dgx-h100", 1, software="megatron", precision="fp8")


def korthikanti(t: int, sp: bool, recompute: str, fp8: bool = False, fused: bool = False) -> float:
    """Bytes one layer keeps, Korthikanti et al. 2022 (module docstring; ``fp8``: with the casts;
    ``fused``: fused attention, the log-sum-exp instead of the scores)."""
    attn = 4 * A / H if fused else 5 * A * S / H
    kept, whole, split = ((29, 8, 21) if fused and recompute != "selective" else (27, 8, 19)) if fp8 else (34, 10, 24)
    if recompute == "full":
        return 2 * SBH / (t if sp else 1)
    if recompute == "selective":
        return kept * SBH / t
    if sp:
        return SBH / t * (kept + attn)
    return SBH * (kept + attn) if t == 1 else SBH * (whole + split / t + attn / t)


@pytest.fixture(scope="module")
def graphs():
    out = {}
    for layers in (2, 4):
        args = dict(layers=layers, hidden=H, heads=A, seq=S, vocab=512, dropout=0.1, vocab_parallel=1)
        spec = ModelSpec("gpt", tuple(sorted(args.items())))
        model, inputs = build_model(spec, batch=B)
        out[layers] = (spec, trace(model, inputs))
    return out


def activations(
    graphs, layers: int, t: int, sp: bool, recompute: str, cost: CostModel = COST
) -> tuple[float, float, float, float]:
    """(simulated peak less static bytes, simulated peak, the explorer's bound, the screen's bound) of one device."""
    spec, g = graphs[layers]
    ctx = Context(g, spec, B, cost.cluster.node.name, 1, t, 8)
    knobs = dict(dp=1, tp=t, pp=1, microbatch=B, sequence_parallel=sp, recompute=recompute)
    plan = get_space("megatron").build(ctx, knobs)
    program = build_program(plan, g, cost)
    peak = simulate(program, cost).peak_mem_bytes
    bound = sum(memory_lower_bound_bytes(plan, g, cost.precision, cost.software))
    screen = Screen(g, cost, cost.precision).estimate(get_space("megatron").draft(ctx, knobs)).bound_bytes
    return peak - program.devices[0].static_bytes, peak, bound, screen


@pytest.mark.parametrize(
    "t, sp, recompute",
    [
        (1, False, "none"),
        (2, False, "none"),
        (4, False, "none"),
        (2, True, "none"),
        (4, True, "none"),
        (2, True, "selective"),
        (4, True, "selective"),
        (2, False, "full"),
        (4, True, "full"),
    ],
)
def test_activation_memory_per_layer_is_korthikanti(graphs, t: int, sp: bool, recompute: str) -> None:
    acts = {n: activations(graphs, n, t, sp, recompute) for n in (2, 4)}
    per_layer = (acts[4][0] - acts[2][0]) / 2
    assert per_layer == pytest.approx(korthikanti(t, sp, recompute), rel=0.03)
    for _, peak, bound, screen in acts.values():  # the bounds that prune plans stay below the peak
        assert bound <= peak * 1.001 and screen <= peak * 1.001


@pytest.mark.parametrize("t, sp, recompute", [(1, False, "none"), (2, False, "none"), (2, True, "selective")])
def test_fp8_training_keeps_the_linear_layers_inputs_as_their_one_byte_casts(graphs, t: int, sp: bool, recompute):
    """Transformer Engine under FP8 (``--software megatron --precision fp8``): each linear layer keeps
    the FP8 cast of its input for the weight-gradient GEMM (module docstring), in the Program, the
    explorer's bound and the screen alike."""
    acts = {n: activations(graphs, n, t, sp, recompute, FP8) for n in (2, 4)}
    per_layer = (acts[4][0] - acts[2][0]) / 2
    assert per_layer == pytest.approx(korthikanti(t, sp, recompute, fp8=True, fused=True), rel=0.03)
    for _, peak, bound, screen in acts.values():
        assert bound <= peak * 1.001 and screen <= peak * 1.001


@pytest.mark.parametrize(
    "t, sp, recompute, cost",
    [(1, False, "none", FUSED), (2, True, "none", FUSED), (2, True, "selective", FUSED), (1, False, "none", TORCH)],
    ids=["megatron-t1", "megatron-t2-sp", "megatron-t2-sp-selective", "torch-t1"],
)
def test_fused_attention_keeps_no_scores(graphs, t: int, sp: bool, recompute: str, cost: CostModel) -> None:
    """Megatron-Core's fused attention (``--software megatron``) and PyTorch's flash SDPA (``torch``)
    keep Q, K, V, O and the log-sum-exp, not the ``B x H x T x S`` scores, O in one storage with the
    output projection's input: without recomputation a layer keeps what selective recomputation
    keeps, ``34 s b h / t`` (module docstring), and less than the unfused attention."""
    acts = {n: activations(graphs, n, t, sp, recompute, cost) for n in (2, 4)}
    per_layer = (acts[4][0] - acts[2][0]) / 2
    assert per_layer == pytest.approx(korthikanti(t, sp, recompute, fused=True), rel=0.03)
    if recompute == "none":
        assert per_layer < 0.9 * korthikanti(t, sp, recompute)
    for _, peak, bound, screen in acts.values():
        assert bound <= peak * 1.001 and screen <= peak * 1.001


# A LLaMA layer (RMSNorm, grouped-query attention with rotary embeddings, SwiGLU): hidden, heads,
# key/value heads, SwiGLU width
LH, LA, LKV, LF = 256, 8, 2, 640


@pytest.fixture(scope="module")
def llama_graphs():
    out = {}
    for layers in (2, 4):
        args = dict(layers=layers, hidden=LH, heads=LA, kv_heads=LKV, ffn_hidden=LF, seq=S, vocab=512)
        spec = ModelSpec("llama", tuple(sorted(args.items())))
        model, inputs = build_model(spec, batch=B)
        out[layers] = (spec, trace(model, inputs))
    return out


def megatron_core_llama_layer(t: int) -> float:
    """Bytes a LLaMA layer keeps under Megatron-Core with Transformer Engine, 16-bit, no
    recomputation (with sequence parallelism for t > 1, every term cut t ways): the attention norm's
    input and output (2 + 2 s b h), Q (2 s b h), K and V (2 x 2 s b h kv / a), O, which the output
    projection keeps as its input (2 s b h), the log-sum-exp (4 a s b), the MLP norm's input and output
    (2 + 2 s b h), the fused SwiGLU's input, fc1's two outputs (2 x 2 s b f), and fc2's input (2 s b f):
    the silu output is not kept (``SwiGLUFunction`` saves its input only)."""
    sb = S * B
    return (sb * LH * (12 + 4 * LKV / LA) + 6 * sb * LF + 4 * LA * sb) / t


@pytest.mark.parametrize("t, sp", [(1, False), (2, True)])
def test_swiglu_layer_under_megatron_core_keeps_the_fc1_output_not_the_gate(llama_graphs, t: int, sp: bool) -> None:
    """Megatron-Core's fused SwiGLU (``--software megatron``, ``fused_glu``) keeps fc1's output and
    computes silu again in its backward; PyTorch's autograd (``torch``) also keeps silu's output,
    ``2 s b f`` bytes more a layer. The Program, the explorer's bound and the screen agree."""
    acts = {n: activations(llama_graphs, n, t, sp, "none", FUSED) for n in (2, 4)}
    per_layer = (acts[4][0] - acts[2][0]) / 2
    assert per_layer == pytest.approx(megatron_core_llama_layer(t), rel=0.03)
    for _, peak, bound, screen in acts.values():
        assert bound <= peak * 1.001 and screen <= peak * 1.001
    if t == 1:
        eager = {n: activations(llama_graphs, n, t, sp, "none", TORCH) for n in (2, 4)}
        assert (eager[4][0] - eager[2][0]) / 2 - per_layer == pytest.approx(2 * S * B * LF, rel=0.01)


# A mixture-of-experts layer: experts, choices per token, expert width (capacity_factor = experts /
# top_k: every expert takes every token of a sequence, so the routing's shapes are exact)
ME, MK, MF = 4, 2, 128


@pytest.fixture(scope="module")
def moe_graphs():
    out = {}
    for layers in (2, 4):
        args = dict(
            layers=layers, hidden=LH, heads=LA, kv_heads=LKV, ffn_hidden=MF, experts=ME, top_k=MK, seq=S, vocab=512
        )
        spec = ModelSpec("moe", tuple(sorted(args.items()) + [("capacity_factor", ME / MK)]))
        model, inputs = build_model(spec, batch=B)
        out[layers] = (spec, trace(model, inputs))
    return out


def test_routing_weights_in_the_experts_keep_no_gathered_outputs(moe_graphs) -> None:
    """Megatron-Core since its memory-efficient token permutation (``--software megatron``,
    ``routing_weights_in_experts``) multiplies the routing weights into the experts' SwiGLU, whose
    backward computes their gradient from the input it keeps; the combine of earlier versions
    multiplied the gathered expert outputs by the weights and kept them, ``2 s b k h`` bytes a layer.
    The Program, the explorer's bound and the screen agree."""
    older = CostModel.load(
        "dgx-a100-80g", 1, software=dataclasses.replace(FUSED.software, routing_weights_in_experts=False)
    )
    gained = layer_bytes(moe_graphs, older) - layer_bytes(moe_graphs, FUSED)
    assert gained == pytest.approx(2 * S * B * MK * LH, rel=0.01)


def layer_bytes(graphs, cost: CostModel) -> float:
    """Bytes one layer keeps (no parallelism, no recomputation) under ``cost``, the explorer's
    bound and the screen's checked below the simulated peak on the way."""
    acts = {n: activations(graphs, n, 1, False, "none", cost) for n in (2, 4)}
    for _, peak, bound, screen in acts.values():
        assert bound <= peak * 1.001 and screen <= peak * 1.001
    return (acts[4][0] - acts[2][0]) / 2


HAI = CostModel.load("dgx-h100", 1, software="hai-llm", precision="fp8")


def test_swiglu_input_stored_in_fp8_under_hai_llm(llama_graphs, moe_graphs) -> None:
    """DeepSeek-V3's HAI-LLM (``--software hai-llm --precision fp8``: the precision's
    ``glu_input_bytes`` 1, Megatron-Core's ``activation_func_fp8_input_store``) keeps the fused
    SwiGLU's input, fc1's two outputs, as a one-byte cast: ``2 s b f`` bytes a dense layer less than
    Megatron-Core's FP8 training, which keeps them in 16 bits, and ``2 s b k f`` per expert layer
    (every expert takes every token here: ``E s b f`` elements of each of the two outputs). The
    Program, the explorer's bound and the screen agree."""
    assert HAI.precision.glu_input_bytes == 1 and FP8.precision.glu_input_bytes == 0
    kept_output = CostModel.load(
        "dgx-h100",
        1,
        software=dataclasses.replace(HAI.software, glu_output_recomputed=False, norm_output_recomputed=False),
        precision="fp8",
    )
    kept_output = dataclasses.replace(  # the attention's output as Megatron-Core keeps it (checked below)
        kept_output, precision=dataclasses.replace(kept_output.precision, attention_output_bytes=0.0)
    )
    for graphs, saved in ((llama_graphs, 2 * S * B * LF), (moe_graphs, 2 * ME * S * B * MF)):
        assert layer_bytes(graphs, FP8) - layer_bytes(graphs, kept_output) == pytest.approx(saved, rel=0.01)


def test_swiglu_output_recomputed_for_the_down_projection_under_hai_llm(llama_graphs, moe_graphs) -> None:
    """DeepSeek-V3's report (section 3.3.3) computes the SwiGLU's output again in the backward from
    its kept input (``hai-llm``'s ``glu_output_recomputed``): the down projection, fc2, keeps no FP8
    cast of its input, ``s b f`` bytes a dense layer less (one byte an element) and ``E s b f`` an
    expert layer. The Program, the explorer's bound and the screen agree."""
    assert HAI.software.glu_output_recomputed
    kept_output = CostModel.load(
        "dgx-h100", 1, software=dataclasses.replace(HAI.software, glu_output_recomputed=False), precision="fp8"
    )
    for graphs, saved in ((llama_graphs, S * B * LF), (moe_graphs, ME * S * B * MF)):
        assert layer_bytes(graphs, kept_output) - layer_bytes(graphs, HAI) == pytest.approx(saved, rel=0.01)


def test_norm_outputs_recomputed_under_hai_llm(llama_graphs, moe_graphs) -> None:
    """DeepSeek-V3's report (section 3.2.3) computes every RMSNorm again in the backward instead of
    keeping its output (``hai-llm``'s ``norm_output_recomputed``): the layers reading a norm's output
    (the QKV projections, the MLP's or the router's and experts' dispatch) keep no FP8 cast of it,
    ``2 s b h`` bytes a layer less (the attention's and the MLP's norm, one byte an element, one cast
    shared by the projections reading it); the norms keep their inputs as before. The Program, the
    explorer's bound and the screen agree."""
    assert HAI.software.norm_output_recomputed and not FP8.software.norm_output_recomputed
    kept_output = CostModel.load(
        "dgx-h100", 1, software=dataclasses.replace(HAI.software, norm_output_recomputed=False), precision="fp8"
    )
    for graphs in (llama_graphs, moe_graphs):
        assert layer_bytes(graphs, kept_output) - layer_bytes(graphs, HAI) == pytest.approx(2 * S * B * LH, rel=0.01)


def test_attention_output_cached_once_in_e5m6_under_hai_llm(llama_graphs, moe_graphs) -> None:
    """DeepSeek-V3's report (section 3.3.3) caches the inputs of the linear layer after the attention
    once, in a 12-bit E5M6 format, for that layer's backward and the attention's (``hai-llm``'s fp8
    ``attention_output_bytes`` 1.5): where Megatron-Core's FP8 training keeps the fused attention's
    16-bit output for its backward and the output projection's one-byte cast of it (3 bytes an
    element), HAI-LLM keeps 1.5, ``1.5 s b h`` bytes a layer less (the heads' outputs, h channels). The
    Program, the explorer's bound and the screen agree."""
    assert HAI.precision.attention_output_bytes == 1.5 and FP8.precision.attention_output_bytes == 0
    separate = dataclasses.replace(HAI, precision=dataclasses.replace(HAI.precision, attention_output_bytes=0.0))
    for graphs in (llama_graphs, moe_graphs):
        assert layer_bytes(graphs, separate) - layer_bytes(graphs, HAI) == pytest.approx(1.5 * S * B * LH, rel=0.01)
