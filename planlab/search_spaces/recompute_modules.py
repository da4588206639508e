"""Selective recomputation by module, as Megatron-Core's ``--recompute-modules`` names them.

With ``--recompute-granularity selective`` Megatron-Core recomputes the modules listed in
``recompute_modules`` (``core_attn`` by default; ``moe_act``, ``mla_up_proj``, ``mlp``,
``layernorm``, ``moe``, ``shared_experts``: ``megatron/core/transformer/transformer_config.py``).
planlab's ``recompute=selective`` is ``core_attn``; three more are knobs of the ``recompute`` space,
each a bool set only with ``--set`` (an exploration keeps them off):

- ``recompute_moe_act``: the experts' activation (SwiGLU's ``silu`` and product: the operators of a
  layer's ``experts`` module that are not its GEMMs), as ``moe_act`` and as DeepSeek-V3 does
  (report section 3.3.3: the SwiGLU's inputs are cached and its output recomputed);
- ``recompute_mlp``: the whole MLP of the layers without routed experts (the dense layers'
  ``feed_forward``), as ``mlp``;
- ``recompute_mla_up_proj``: multi-head latent attention's up-projections (the query and key/value
  latents' norms, up-projections, rotary embedding and concatenation: the operators of the
  ``attention`` module from the latents to the attention core), as ``mla_up_proj`` and DeepSeek-V3
  (section 3.2.3). Megatron-Core frees the queries, keys and values after the attention core read
  them and makes them again before its backward; planlab recomputes them in one group with the
  attention core, so it needs ``recompute=selective`` (the core's forward runs again too, as
  ``selective`` prices it already).

``layernorm`` is not a knob: under FP8 the layers after a norm keep its output's FP8 cast
(:func:`planlab.plan.saved.cast_inputs`) and the norm keeps only its input, which its
recomputation would keep too, so it changes nothing planlab counts for Megatron-Core. DeepSeek's
HAI-LLM recomputes the norm and its cast for the layers after it (report section 3.2.3): the
software's ``norm_output_recomputed`` (:func:`planlab.plan.saved.recomputed_norm_outputs`).
"""

from __future__ import annotations

import re

from planlab.graph.ir import Graph

LAYER = re.compile(r"(^|\.)blocks\.(\d+)(\.|$)")  # an operator's module inside layer ``blocks.<i>``
EXPERTS = re.compile(r"\.experts$")
DENSE_MLP = re.compile(r"\.feed_forward(\.w[123])?$")
UP_PROJ = re.compile(r"\.attention(\.(q_norm|wq_b|kv_norm|wkv_b))?$")
MODULE_DOCS = {
    "recompute_moe_act": "routed experts (a layer's 'experts' module)",
    "recompute_mlp": "dense MLP (a layer's 'feed_forward' without routed experts)",
    "recompute_mla_up_proj": "latent attention (an 'attention' module with 'wq_b' and 'wkv_b')",
}
MODULE_KNOBS = tuple(MODULE_DOCS)


def module_groups(g: Graph, knob: str) -> dict[str, int]:
    """Per operator the knob ``knob`` recomputes (cached per graph), its recompute group: the
    layer's attention group (its number + 1, :func:`~planlab.search_spaces.builtin.recompute_groups`)
    for the up-projections, a group of their own per layer for the others."""
    return g.memo(("recompute_modules", knob), lambda: _groups(g, knob))


def _groups(g: Graph, knob: str) -> dict[str, int]:
    n = len(g.operators)
    routed = {m.group(2) for op in g.operators if EXPERTS.search(op.module) and (m := LAYER.search(op.module))}
    out: dict[str, int] = {}
    core_seen: set[str] = set()
    for op in g.operators:
        m = LAYER.search(op.module)
        if m is None:
            continue
        layer = m.group(2)
        if knob == "recompute_moe_act" and EXPERTS.search(op.module) and op.kind != "matmul":
            out[op.name] = 2 * n + int(layer) + 1
        elif knob == "recompute_mlp" and layer not in routed and DENSE_MLP.search(op.module):
            out[op.name] = 3 * n + int(layer) + 1
        elif knob == "recompute_mla_up_proj" and _latent_attention(g, op.module):
            if op.kind == "attention":
                core_seen.add(op.module)
            elif op.module not in core_seen and UP_PROJ.search(op.module):
                out[op.name] = int(layer) + 1
    return out


def _latent_attention(g: Graph, module: str) -> bool:
    """Whether ``module`` is (inside) an attention with query and key/value latents (``wq_b``, ``wkv_b``)."""
    base = module.rsplit(".", 1)[0] if re.search(r"\.(q_norm|wq_b|kv_norm|wkv_b)$", module) else module
    return g.memo(("latent_attention", base), lambda: any(op.module == f"{base}.wkv_b" for op in g.operators))
