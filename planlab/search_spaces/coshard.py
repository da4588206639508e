"""The ``coshard`` space: nnScaler's co-sharding (Lin et al., OSDI 2024, "nnScaler").

An operator is split into more pieces than the devices that hold it: the tensor-parallel
dimension (attention heads, MLP hidden units) of every operator of a layer's attention or MLP
is split ``coshard`` times more than tensor parallelism splits it, and the ``coshard`` pieces of
a device run one after another, each recomputed in the backward, so that only one piece's
activations are alive at a time (:mod:`planlab.plan.coshard`). It trades a little more
computation (recomputation, smaller kernels) for much less activation memory, which lets a
plan use less tensor parallelism or no recomputation elsewhere; nnScaler reports its largest
wins on SwinV2 at large image sizes, whose attention over big windows holds most activations.

Written with the public Space API only; compose it with the others by product
(``megatron*coshard``, ``dp*tp*coshard``): coshard refines tensor parallelism's split.
"""

from __future__ import annotations

import re

from planlab.search_spaces.builtin import _BLOCK, tensor_parallel_dims
from planlab.search_spaces.space import Constraint, Context, Draft, Knob, Space

ATTENTION = re.compile(r"(^|\.)(attn|attention|self_attn)(\.|$)")
MLP = re.compile(r"(^|\.)(mlp|feed_forward|ff)(\.|$)")
PARTS = ("attention", "mlp", "both")


def _heads_ok(a: dict, c: Context) -> bool:
    """Tensor parallelism times coshard divides the heads (a space without tp: tp = 1)."""
    k, part = a.get("coshard"), a.get("coshard_blocks")
    if k is None or part == "mlp" or "tp" in a and a["tp"] is None:
        return True
    return c.heads % ((a.get("tp") or 1) * k) == 0


class Coshard(Space):
    """The tensor-parallel dimension of a layer's attention and/or MLP operators split
    ``coshard`` times more, the pieces of a device run one after another, each recomputed
    (``coshard=1``: off). ``coshard_blocks`` picks the attention, the MLP or both."""

    name = "coshard"
    order = 4  # after tp (2), whose split it refines, and recompute (3), which it overrides for its operators
    knobs = (
        Knob("coshard", lambda c: (1, 2, 4, 8), "pieces per device of each co-sharded operator"),
        Knob("coshard_blocks", lambda c: PARTS, "the layers' operators co-sharded: attention, mlp or both"),
    )
    constraints = (
        # one plan without coshard, not three that differ by a knob that does nothing
        Constraint(lambda a, c: a["coshard"] != 1 or a["coshard_blocks"] in (None, "attention"),
                   lambda a, c: f"coshard=1 co-shards nothing, so coshard_blocks={a['coshard_blocks']!r} has "
                                "no effect; use coshard_blocks='attention' or coshard > 1"),
        Constraint(_heads_ok, lambda a, c: f"tp={a.get('tp') or 1} x coshard={a['coshard']} does not divide the "
                                           f"model's {c.heads} attention heads"),
    )

    def apply(self, draft: Draft, values: dict) -> None:
        k = values.get("coshard") or 1
        if k == 1:
            return
        part = values.get("coshard_blocks") or "attention"
        g = draft.ctx.graph
        dims = tensor_parallel_dims(g)
        for op in g.operators:
            block = _BLOCK.search(op.module)
            if dims[op.name] is None or block is None:
                continue
            if ATTENTION.search(op.module):
                where = "attention"
            elif MLP.search(op.module):
                where = "mlp"
            else:
                continue
            if part in (where, "both"):
                draft.colocate[op.name] = (dims[op.name], k)
                draft.recompute[op.name] = int(block.group(2)) + 1  # recomputed piece by piece
