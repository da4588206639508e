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


def interleaved_1f1b(rank: int, ranks: int, microbatches: int, chunks: int) -> list[Action]:
    """Megatron-LM's interleaved 1F1B: device ``rank`` holds ``chunks`` model chunks, stages
    ``rank, rank + ranks, ...``; micro-batches go through the chunks in groups of ``ranks``.
    Warm-up is ``2 (ranks - rank - 1) + (chunks - 1) ranks`` forwards, then one forward and
    one backward in turn. Needs ``microbatches`` divisible by ``ranks``."""
    if microbatches % ranks:
        raise ValueError(f"interleaved 1F1B needs the {microbatches} micro-batches to divide by the {ranks} stages")
    total = microbatches * chunks

    def unit(k: int, backward: bool) -> Action:
        chunk = (k // ranks) % chunks
        if backward:
            chunk = chunks - 1 - chunk
        mb = (k // (ranks * chunks)) * ranks + k % ranks
        return Action(chunk * ranks + rank, "B" if backward else "F", mb)

    warmup = min(total, 2 * (ranks - rank - 1) + (chunks - 1) * ranks)
    out = [unit(k, False) for k in range(warmup)]
    for i in range(total - warmup):
        out += [unit(warmup + i, False), unit(i, True)]
    out += [unit(k, True) for k in range(total - warmup, total)]
    return out


SCHEDULES = {"1f1b": one_f_one_b, "gpipe": gpipe}


def format_schedule(actions: list[Action]) -> str:
    """Text form, e.g. ``0F0 0F1 0B0 0B1``; :func:`parse_schedule` reads it back."""
    return " ".join(map(str, actions))


def parse_schedule(text: str) -> list[Action]:
    return [Action.parse(a) for a in text.split()]
