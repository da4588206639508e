"""The interleaved schedule's own knobs of the ``pp`` space: the micro-batches a model chunk runs in a
row (``pipeline_group``, Llama 3's N) and the paired forward and backward steps of Megatron-Core's
expert all-to-all overlap (``expert_overlap``), with the constraints that keep their plans runnable
(planlab/search_spaces/schedules.py ``interleaved_1f1b``)."""

from __future__ import annotations

from planlab.search_spaces.space import Constraint, Knob, divisors


def interleaved_knobs() -> tuple[Knob, Knob]:
    """``pipeline_group`` and ``expert_overlap``, both pinned at their defaults."""
    return (
        Knob.int(
            "pipeline_group",
            lambda c: (0,) + tuple(divisors(c.global_batch)),  # N divides the micro-batches, which divide the batch
            "interleaved schedule: micro-batches each model chunk runs in a row (Llama 3's N; 0: pp)",
            default=0,
            pinned=True,
            range="0 (pp, Megatron-LM's depth-first order) or a divisor of the micro-batches",
        ),
        Knob.bool(
            "expert_overlap",
            "interleaved schedule: run each steady-state forward beside the next backward, the expert "
            "all-to-alls of each hidden behind the other's computation (Megatron-Core's "
            "--overlap-moe-expert-parallel-comm, planlab/search_spaces/schedules.py interleaved_1f1b)",
            pinned=True,
        ),
    )


def interleaved_constraints() -> tuple[Constraint, ...]:
    """The micro-batches divide by the group (or ``pp``); a group of fewer micro-batches than ``pp``
    only when it is all of them (other orders deadlock); both knobs only with ``schedule=interleaved``."""
    return (
        Constraint(
            lambda a, c: (
                a["schedule"] != "interleaved"
                or a["pp"] is None
                or a.get("microbatch") is None
                or a.get("dp") is None
                or (c.global_batch // (a["dp"] * a["microbatch"])) % (a.get("pipeline_group") or a["pp"]) == 0
            ),
            lambda a, c: (
                f"the interleaved schedule needs the number of micro-batches "
                f"({c.global_batch // (a['dp'] * a['microbatch'])}) to divide by "
                + (f"pipeline_group={a['pipeline_group']}" if a.get("pipeline_group") else f"pp={a['pp']}")
            ),
        ),
        Constraint(
            lambda a, c: (
                not a.get("pipeline_group")
                or a["pp"] is None
                or a["pipeline_group"] >= a["pp"]
                or a.get("microbatch") is None
                or a.get("dp") is None
                or a["pipeline_group"] == c.global_batch // (a["dp"] * a["microbatch"])
            ),
            lambda a, c: (
                f"pipeline_group={a['pipeline_group']} is fewer than pp={a['pp']} but not all the micro-batches: "
                "the interleaved order deadlocks (planlab/search_spaces/schedules.py interleaved_1f1b)"
            ),
        ),
        Constraint(
            lambda a, c: not a.get("expert_overlap") or a.get("schedule") in (None, "interleaved"),
            lambda a, c: (
                f"expert_overlap pairs the forwards and backwards of schedule=interleaved (Megatron-Core "
                f"needs virtual pipeline stages for it), not schedule={a['schedule']}"
            ),
        ),
        Constraint(
            lambda a, c: not a.get("pipeline_group") or a.get("schedule") in (None, "interleaved"),
            lambda a, c: (
                f"pipeline_group={a['pipeline_group']} orders the chunks of schedule=interleaved, "
                f"not schedule={a['schedule']}"
            ),
        ),
    )
