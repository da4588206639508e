"""The ``coshard`` space: nnScaler's co-sharding (Lin et al., OSDI 2024, "nnScaler").

An operator is split into more pieces than the devices that hold it: the tensor-parallel
dimension (attention heads, MLP hidden units) of every operator of a layer's attention or MLP
is split ``coshard`` times more than tensor parallelism splits it, and the ``coshard`` pieces of
a device run one after another, each recomputed in the backward, so that only one piece's
activations are alive at a time (:mod:`planlab.plan.coshard`). It trades a little more
computation (recomputation, smaller kernels) for much less activation memory, which lets a
plan use less tensor parallelism or no recomputation elsewhere; nnScaler reports its largest
wins on SwinV2 at large image sizes, whose attention over big windows holds most activations.

Written with the public Space API only and registered as ``coshard``; compose it with the others
by product (``megatron*coshard``, ``dp*tp*coshard``): coshard refines tensor parallelism's split.
"""

from __future__ import annotations

import re

from planlab.graph.ir import Graph
from planlab.search_spaces.builtin import LAYER_MODULE, tensor_parallel_dims
from planlab.search_spaces.registry import register_space
from planlab.search_spaces.space import Constraint, Context, Draft, Knob, Space

# The attentions and MLPs of GPT/LLaMA/T5/Swin, and the Evoformer's (AlphaFold2: MSA row and column
# attention, triangle attention around the starting and ending node; the MSA and pair transitions).
ATTENTION = re.compile(r"(^|\.)(attn|attention|self_attn|msa_att_row|msa_att_col|tri_att_start|tri_att_end)(\.|$)")
MLP = re.compile(r"(^|\.)(mlp|feed_forward|ff|msa_transition|pair_transition)(\.|$)")
PARTS = ("attention", "mlp", "both")
OUTPUTS = ("keep", "recompute")
REMADE_PERCENTS = (25, 50, 75, 100)


def _outputs_differ(k) -> bool:
    """coshard_outputs='recompute' only where a layer's recomputation could make them again:
    with coshard > 1 and recompute=full (a space without recompute: never)."""
    if k["coshard_outputs"] != "recompute":
        return True
    return k["coshard"] != 1 and "recompute" in list(k) and k["recompute"] == "full"


def _share_differs(k) -> bool:
    """coshard_remade_percent below 100 only where the results are remade at all."""
    return k["coshard_remade_percent"] == 100 or k["coshard_outputs"] == "recompute"


def remade(layer: int, percent: int) -> bool:
    """Whether ``layer`` remakes its co-sharded results, with ``percent`` of the layers doing so:
    layers i with i mod 4 < percent / 25, spread evenly over the layers (and so over a pipeline's
    stages)."""
    return layer % 4 < percent // 25


def _heads_ok(k, c: Context) -> bool:
    """Tensor parallelism times coshard divides the heads (a space without tp: tp = 1). Reads the
    knobs through the space's view: one not assigned yet defers the check."""
    if k["coshard"] == 1 or k["coshard_blocks"] == "mlp":
        return True
    tp = k["tp"] if "tp" in list(k) else 1
    return c.heads % (tp * k["coshard"]) == 0


def _recompute_differs(k) -> bool:
    """recompute=selective is not the same plan as recompute=none (a space without recompute: true)."""
    if k["coshard"] == 1 or k["coshard_blocks"] == "mlp" or "recompute" not in list(k):
        return True
    return k["recompute"] != "selective"


class Coshard(Space):
    """The tensor-parallel dimension of a layer's attention and/or MLP operators split
    ``coshard`` times more, the pieces of a device run one after another, each recomputed
    (``coshard=1``: off). ``coshard_blocks`` picks the attention, the MLP or both."""

    name = "coshard"
    order = 4  # after tp (2), whose split it refines, and recompute (3), which it overrides for its operators
    knobs = (
        Knob.int(
            "coshard",
            lambda c: (1, 2, 4, 8),
            "pieces per device of each co-sharded operator",
            default=1,
            range="1, 2, 4 or 8",
        ),
        Knob.choice(
            "coshard_blocks",
            lambda c: PARTS,
            "the layers' operators co-sharded: attention, mlp or both",
            default="attention",
        ),
        Knob.choice(
            "coshard_outputs",
            lambda c: OUTPUTS,
            "with recompute=full, the co-sharded operators' results "
            "kept from the forward for the layer's recomputation (keep) or made again in it, chunk by "
            "chunk (recompute: less memory, one more forward of those operators)",
            default="keep",
        ),
        Knob.int(
            "coshard_remade_percent",
            lambda c: REMADE_PERCENTS,
            "with coshard_outputs=recompute, the share "
            "of the layers that remake their co-sharded results (the others keep them): as many as memory "
            "needs",
            default=100,
            range="25, 50, 75 or 100",
        ),
    )
    constraints = (
        # one plan without coshard, not three that differ by a knob that does nothing
        Constraint.where(
            lambda k: k["coshard"] != 1 or k["coshard_blocks"] == "attention",
            lambda a, c: (
                f"coshard=1 co-shards nothing, so coshard_blocks={a['coshard_blocks']!r} has "
                "no effect; use coshard_blocks='attention' or coshard > 1"
            ),
        ),
        Constraint.where(
            _heads_ok,
            lambda a, c: (
                f"tp={a.get('tp') or 1} x coshard={a['coshard']} does not divide the model's {c.heads} attention heads"
            ),
        ),
        # co-sharded attention is recomputed piece by piece already: selective recompute (the attention
        # core) would add nothing, and give a second row of the same plan
        Constraint.where(
            _recompute_differs,
            lambda a, c: (
                f"coshard={a['coshard']} of the {a['coshard_blocks']} recomputes the attention "
                "piece by piece already, so recompute='selective' adds nothing; use 'none' "
                "or 'full'"
            ),
        ),
        Constraint.where(
            _outputs_differ,
            lambda a, c: (
                f"coshard_outputs='recompute' makes the co-sharded results again in the "
                f"layer's recomputation, which needs coshard > 1 and recompute='full' (got "
                f"coshard={a['coshard']}, recompute={a.get('recompute')!r}); use 'keep'"
            ),
        ),
        Constraint.where(
            _share_differs,
            lambda a, c: (
                f"coshard_remade_percent={a['coshard_remade_percent']} says how many layers "
                "remake their co-sharded results, which needs coshard_outputs='recompute' "
                f"(got {a['coshard_outputs']!r}); use 100"
            ),
        ),
    )

    def apply(self, draft: Draft, values: dict) -> None:
        k = values.get("coshard") or 1
        if k == 1:
            return
        part = values.get("coshard_blocks") or "attention"
        # a recompute group of the layer's own (nested in its full recomputation) or of the pieces' own
        nested = values.get("coshard_outputs") == "recompute"
        percent = values.get("coshard_remade_percent") or 100
        colocate, recompute = cosharded(draft.ctx.graph, part, k, nested, percent)
        draft.colocate.update(colocate)
        draft.recompute.update(recompute)  # recomputed piece by piece


def _targets(g: Graph) -> tuple[tuple[str, str, str, int], ...]:
    """Every operator coshard can split, in graph order: ``(name, tensor-parallel dimension,
    'attention' or 'mlp', layer)``."""
    dims = tensor_parallel_dims(g)
    out = []
    for op in g.operators:
        block = LAYER_MODULE.search(op.module)
        if dims[op.name] is None or block is None:
            continue
        if ATTENTION.search(op.module):
            out.append((op.name, dims[op.name], "attention", int(block.group(2))))
        elif MLP.search(op.module):
            out.append((op.name, dims[op.name], "mlp", int(block.group(2))))
    return tuple(out)


def cosharded(
    g: Graph, part: str, k: int, nested: bool, percent: int
) -> tuple[dict[str, tuple[str, int]], dict[str, int]]:
    """What coshard ``k`` of ``part`` adds to a draft: the operators co-located ``(dim, k)`` and their
    recompute groups (a layer's own, or, with ``nested``, nested in the layer's full recomputation
    for the ``percent`` of layers that remake their results), in graph order. Computed once per
    graph and knobs; the caller copies them into its draft."""

    def compute():
        colocate, recompute = {}, {}
        own = len(g.operators)
        for name, dim, where, layer in g.memo(("coshard_targets",), lambda: _targets(g)):
            if part in (where, "both"):
                colocate[name] = (dim, k)
                recompute[name] = (0 if nested and remade(layer, percent) else own) + layer + 1
        return colocate, recompute

    return g.memo(("cosharded", part, k, nested, percent), compute)


register_space("coshard", Coshard)
