"""AlphaFold2's recycling in pipelines, and the ``3f1b`` space (nnScaler, Lin et al., OSDI 2024).

A recycling model (``--model alphafold2 --model-arg recycles=3``, :mod:`planlab.models.evoformer`)
runs its trunk R times per example with the same weights; the outputs of each pass reach the next
through ``detach``, so passes 0..R-2 need no backward. A pipeline stages pass r's layers as stage
``r * pp + layer // (layers / pp)`` on device group ``layer // (layers / pp)``: the passes are model
chunks, as virtual stages are in interleaved 1F1B. With one stage per device group instead, 1F1B would
deadlock (the first stage's pass-1 forward waits for the last stage's pass-0 output).

Every pipelined space handles such a model: ``pp`` (and ``megatron``) run the plain schedule
(:func:`planlab.search_spaces.schedules.recycled`: the no-grad passes as whole forward sweeps, then the
last pass with the chosen schedule), so the hand-made baseline pays the recycling forwards too; ``3f1b``
interleaves them (:func:`planlab.search_spaces.schedules.three_f_one_b`).
"""

from __future__ import annotations

from planlab.search_spaces.builtin import (  # noqa: F401 (recycling_stages re-exported)
    DataParallel,
    Recompute,
    TensorParallel,
    divisors,
    recycling_stages,
    stage_recycling,
)
from planlab.search_spaces.recycling_passes import num_passes, passes_of, recycling_actions  # noqa: F401 (re-exported)
from planlab.search_spaces.registry import register_space
from planlab.search_spaces.space import Constraint, Context, Draft, Knob, Product, Space


def _passes(c: Context) -> int:
    return num_passes(c.graph)


class ThreeF1BPipeline(Space):
    """The layers of every recycling pass in ``pp`` stages, run with nnScaler's 3F1B schedule."""

    name = "3f1b-pp"
    order = 0
    knobs = (
        Knob.int(
            "pp",
            lambda c: tuple(d for d in divisors(c.num_devices) if d > 1 and c.layers % d == 0),
            "pipeline-parallel degree (device groups)",
            default=2,
            range="divisors above 1 of the device count that divide the layers",
        ),
    )
    constraints = (
        Constraint(
            lambda a, c: _passes(c) > 1,
            lambda a, c: (
                f"3f1b pipelines recycling passes, but the model {c.model} runs its trunk once: "
                "give it recycles > 1 (--model-arg recycles=3)"
            ),
        ),
        Constraint(
            lambda a, c: a["pp"] is None or (a["pp"] > 1 and c.num_devices % a["pp"] == 0),
            lambda a, c: f"pp={a['pp']}: 3f1b needs pp > 1 dividing the {c.num_devices} devices",
        ),
        Constraint.divides("pp", "the model's {n} layers", lambda c: c.layers),
        Constraint(
            lambda a, c: (
                a["pp"] is None
                or a.get("microbatch") is None
                or a.get("dp") is None
                or (c.global_batch // (a["dp"] * a["microbatch"])) % a["pp"] == 0
            ),
            lambda a, c: (
                f"3f1b runs micro-batches in groups of pp={a['pp']}: the "
                f"{c.global_batch // (a['dp'] * a['microbatch'])} micro-batches "
                f"(global batch {c.global_batch} / dp={a['dp']} / microbatch={a['microbatch']}) "
                "do not divide by it"
            ),
        ),
    )

    def apply(self, draft: Draft, values: dict) -> None:
        stage_recycling(draft, values.get("pp") or 2, "3f1b")


class ThreeF1B(Product):
    """nnScaler's 3F1B for AlphaFold2's recycling: a pipeline of every recycling pass with the
    no-grad forwards interleaved into 1F1B, x data x tensor parallelism x recomputation."""

    def __init__(self) -> None:
        super().__init__((ThreeF1BPipeline(), DataParallel(), TensorParallel(), Recompute()), name="3f1b")


register_space("3f1b", ThreeF1B)
