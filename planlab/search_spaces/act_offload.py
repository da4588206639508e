"""The ``act_offload`` space: activation offloading (Megatron-Core's activation offloading, torch's
``save_on_cpu``) as a knob, composable with the others (``megatron*act_offload``).

``offload_activations`` is the share, in per cent, of each pipeline stage's transformer layers whose
saved activations go to host memory after their forward and come back before their backward
(:mod:`planlab.plan.passes.act_offload`): the stage's first layers, whose backward comes last, so
that the copies have the most compute to hide under. A recomputed layer keeps nothing to offload.
Priced on the cluster's host link (PCIe generation and lanes) and checked against its host memory;
a cluster without a host side refuses it in one line when the plan is simulated, as ZeRO-Offload.
"""

from __future__ import annotations

import math

from planlab.graph.ir import Graph
from planlab.search_spaces.builtin import LAYER_MODULE
from planlab.search_spaces.knobs import Constraint, Knob
from planlab.search_spaces.registry import register_space
from planlab.search_spaces.space import Draft, Space

SHARES_PCT = (0, 25, 50, 75, 100)  # the knob's values: per cent of each stage's layers


def layer_of(g: Graph) -> dict[str, int]:
    """Per operator inside a transformer layer (``blocks.<i>``), the layer's number (cached per graph)."""

    def compute() -> dict[str, int]:
        out = {}
        for op in g.operators:
            m = LAYER_MODULE.search(op.module)
            if m:
                out[op.name] = int(m.group(2))
        return out

    return g.memo(("layer_of",), compute)


def offloaded_layers(layers: list[int], share_pct: int) -> list[int]:
    """The first ``share_pct`` per cent of a stage's ``layers`` (at least one when the share is not 0)."""
    n = 0 if share_pct == 0 else max(1, math.floor(len(layers) * share_pct / 100 + 0.5))
    return sorted(layers)[:n]


class ActivationOffload(Space):
    """Activation offloading to host memory: ``offload_activations`` per cent of each stage's layers
    keep their saved activations on the host (see the module docstring)."""

    name = "act_offload"
    order = 5
    knobs = (
        Knob.int(
            "offload_activations",
            SHARES_PCT,
            "per cent of each stage's layers whose saved activations live in host memory",
            default=0,
            explore=(0, 50, 100),
        ),
    )

    constraints = (
        Constraint(
            lambda a, c: not a.get("offload_activations") or a.get("recompute") != "full",
            lambda a, c: (
                f"offload_activations={a.get('offload_activations')} with recompute='full': a recomputed layer keeps "
                "nothing to offload (the same plan as offload_activations=0); use recompute 'none' or 'selective'"
            ),
        ),
    )

    def apply(self, draft: Draft, values: dict) -> None:
        share = int(values.get("offload_activations") or 0)
        if not share:
            return
        layer = layer_of(draft.ctx.graph)
        per_stage: dict[int, set[int]] = {}
        for op, i in layer.items():
            per_stage.setdefault(draft.stages.get(op, 0), set()).add(i)
        chosen = {i for layers in per_stage.values() for i in offloaded_layers(list(layers), share)}
        draft.offload_acts = {op: i + 1 for op, i in layer.items() if i in chosen}


register_space("act_offload", ActivationOffload)
