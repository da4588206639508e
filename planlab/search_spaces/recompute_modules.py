"""Selective recomputation by module, as Megatron-Core's ``--recompute-modules`` names them.

With ``--recompute-granularity selective`` Megatron-Core recomputes the modules listed in
``recompute_modules`` (``core_attn`` by default; ``moe_act``, ``mla_up_proj``, ``mlp``,
``layernorm``, ``moe``, ``shared_experts``: ``megatron/core/transformer/transformer_config.py``).
planlab's ``recompute=selective`` is ``core_attn``; three more are knobs of the ``recompute`` space,
each a bool set only with ``--set`` (an exploration keeps them off):

- ``recompute_moe_act``: the experts' activation (SwiGLU's ``silu`` and product: the operators of a
  layer's ``experts`` module that are not its GEMMs), as ``moe_act`` and as DeepSeek-V3 does
  (report section 3.3.3: the SwiGLU's inputs are cached and its output recomputed). Megatron-Core
  (core_r0.14.0 ``moe/experts.py``) frees its output once the second GEMM has run and makes it again
  for that GEMM's backward: a group whose outputs are discarded too (under FP8 the GEMM keeps its
  input's FP8 cast, which stays);
- ``recompute_mlp``: the whole MLP of the layers without routed experts (the dense layers'
  ``feed_forward``), as ``mlp``;
- ``recompute_mla_up_proj``: multi-head latent attention's up-projections (the query and key/value
  latents' norms, up-projections, rotary embedding and concatenation: the operators of the
  ``attention`` module from the latents to the attention core), as ``mla_up_proj`` and DeepSeek-V3
  (section 3.2.3). Megatron-Core (core_r0.14.0 ``multi_latent_attention.py``) runs them under a
  ``CheckpointWithoutOutput`` and, once the attention core has read the queries, keys and values,
  frees them (``discard_output_and_register_recompute``) and makes them again before the core's
  backward; the core itself is not recomputed. With ``recompute=none`` they are a group of their
  own whose outputs are discarded too (``Plan.discard_outputs``: the core's backward reads the
  remade ones); with ``recompute=selective`` they join the layer's core group, which is recomputed
  anyway.

The layers are a model's ``blocks.<i>`` and, after them, its multi-token-prediction modules'
(``mtp.<k>``, :class:`planlab.models.deepseek.MultiTokenPrediction`): Megatron-Core builds those
with the decoder's layer spec and configuration, so the same modules recompute there.

``layernorm`` is not a knob: under FP8 the layers after a norm keep its output's FP8 cast
(:func:`planlab.plan.saved.cast_inputs`) and the norm keeps only its input, which its
recomputation would keep too, so it changes nothing planlab counts for Megatron-Core. DeepSeek's
HAI-LLM recomputes the norm and its cast for the layers after it (report section 3.2.3): the
software's ``norm_output_recomputed`` (:func:`planlab.plan.saved.recomputed_norm_outputs`).
"""

from __future__ import annotations

import re

from planlab.graph.ir import Graph

LAYER = re.compile(r"(^|\.)(blocks|mtp)\.(\d+)(\.|$)")  # inside layer ``blocks.<i>`` or module ``mtp.<k>``
EXPERTS = re.compile(r"\.experts$")
DENSE_MLP = re.compile(r"\.feed_forward(\.w[123])?$")
UP_PROJ = re.compile(r"\.attention(\.(q_norm|wq_b|kv_norm|wkv_b))?$")
MODULE_DOCS = {
    "recompute_moe_act": "routed experts (a layer's 'experts' module)",
    "recompute_mlp": "dense MLP (a layer's 'feed_forward' without routed experts)",
    "recompute_mla_up_proj": "latent attention (an 'attention' module with 'wq_b' and 'wkv_b')",
}
MODULE_KNOBS = tuple(MODULE_DOCS)
# the knobs whose groups discard their outputs when alone (Megatron-Core's CheckpointWithoutOutput:
# multi_latent_attention.py for mla_up_proj, moe/experts.py for moe_act, whose output fc2 reads)
DISCARDED = frozenset({"recompute_mla_up_proj", "recompute_moe_act"})


def discards(knob: str, mode: str) -> bool:
    """Whether knob ``knob``'s groups discard their outputs under ``recompute=mode``: the
    ``CheckpointWithoutOutput`` modules (:data:`DISCARDED`) in a group of their own (the
    up-projections join the attention core's group under ``selective``)."""
    return knob in DISCARDED and (mode == "none" or knob != "recompute_mla_up_proj")


def layer_number(g: Graph, module: str) -> int | None:
    """The layer an operator's ``module`` is in: ``i`` for ``blocks.<i>``, the decoder's layer
    count plus ``k`` for multi-token-prediction module ``mtp.<k>``; None outside the layers."""
    m = LAYER.search(module)
    if m is None:
        return None
    if m.group(2) == "blocks":
        return int(m.group(3))
    return decoder_layers(g) + int(m.group(3))


def decoder_layers(g: Graph) -> int:
    """The number of ``blocks.<i>`` layers (cached per graph)."""

    def count() -> int:
        return len({m.group(3) for op in g.operators if (m := LAYER.search(op.module)) and m.group(2) == "blocks"})

    return g.memo(("decoder_layers",), count)


def module_groups(g: Graph, knob: str, alone: bool = False) -> dict[str, int]:
    """Per operator the knob ``knob`` recomputes (cached per graph), its recompute group: for the
    up-projections the layer's attention group (its number + 1,
    :func:`~planlab.search_spaces.builtin.recompute_groups`) or, ``alone``, a group of their own;
    a group of their own per layer for the others."""
    return g.memo(("recompute_modules", knob, alone), lambda: _groups(g, knob, alone))


def _groups(g: Graph, knob: str, alone: bool) -> dict[str, int]:
    n = len(g.operators)
    routed = {layer_number(g, op.module) for op in g.operators if EXPERTS.search(op.module)}
    out: dict[str, int] = {}
    core_seen: set[str] = set()
    for op in g.operators:
        layer = layer_number(g, op.module)
        if layer is None:
            continue
        if knob == "recompute_moe_act" and EXPERTS.search(op.module) and op.kind != "matmul":
            out[op.name] = 2 * n + layer + 1
        elif knob == "recompute_mlp" and layer not in routed and DENSE_MLP.search(op.module):
            out[op.name] = 3 * n + layer + 1
        elif knob == "recompute_mla_up_proj" and _latent_attention(g, op.module):
            if op.kind == "attention":
                core_seen.add(op.module)
            elif op.module not in core_seen and UP_PROJ.search(op.module):
                out[op.name] = (4 * n if alone else 0) + layer + 1
    return out


def _latent_attention(g: Graph, module: str) -> bool:
    """Whether ``module`` is (inside) an attention with query and key/value latents (``wq_b``, ``wkv_b``)."""
    base = module.rsplit(".", 1)[0] if re.search(r"\.(q_norm|wq_b|kv_norm|wkv_b)$", module) else module
    return g.memo(("latent_attention", base), lambda: any(op.module == f"{base}.wkv_b" for op in g.operators))
