"""Pipeline schedules as data: per-stage lists of actions (pure functions)."""

from __future__ import annotations

from planlab.plan.plan import Action


def gpipe(stage: int, stages: int, microbatches: int) -> list[Action]:
    """All forwards, then all backwards."""
    return [Action(stage, "F", i) for i in range(microbatches)] + \
        [Action(stage, "B", i) for i in range(microbatches)]


def one_f_one_b(stage: int, stages: int, microbatches: int) -> list[Action]:
    """1F1B (PipeDream-Flush): ``stages - stage - 1`` warm-up forwards, then one
    forward and one backward in turn, then the remaining backwards."""
    warmup = min(stages - stage - 1, microbatches)
    out = [Action(stage, "F", i) for i in range(warmup)]
    for i in range(microbatches - warmup):
        out += [Action(stage, "F", warmup + i), Action(stage, "B", i)]
    out += [Action(stage, "B", i) for i in range(microbatches - warmup, microbatches)]
    return out


SCHEDULES = {"1f1b": one_f_one_b, "gpipe": gpipe}


def format_schedule(actions: list[Action]) -> str:
    """Text form, e.g. ``0F0 0F1 0B0 0B1``; :func:`parse_schedule` reads it back."""
    return " ".join(map(str, actions))


def parse_schedule(text: str) -> list[Action]:
    return [Action.parse(a) for a in text.split()]
