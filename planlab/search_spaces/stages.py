"""Layers per pipeline stage: an even split, or Megatron-Core's uneven one.

Megatron-Core's ``--decoder-first-pipeline-num-layers`` and ``--decoder-last-pipeline-num-layers``
give the first and the last pipeline stage their own layer counts (usually fewer: the first stage
also runs the embedding, the last the output layer and the loss); the other stages share the
remaining layers evenly. Here the knobs ``first_stage_layers`` and ``last_stage_layers`` say the
same, 0 meaning "an even share" (Megatron's unset). Pure functions of integers.
"""

from __future__ import annotations

from dataclasses import dataclass

FIRST, LAST = "first_stage_layers", "last_stage_layers"


def layers_per_stage(layers: int, pp: int, first: int = 0, last: int = 0) -> tuple[int, ...] | None:
    """The layer count of each of the ``pp`` stages, or None when the counts do not add up or a
    stage would hold no layer. ``first`` / ``last`` (0: an even share) fix the first and last
    stage's counts; the stages not fixed share the rest evenly."""
    if pp < 1 or first < 0 or last < 0:
        return None
    if pp == 1:
        return (layers,) if first in (0, layers) and last in (0, layers) and layers >= 1 else None
    fixed = [first, last]
    rest_stages = pp - sum(1 for v in fixed if v)
    rest = layers - first - last
    if rest_stages == 0:
        share = 0
        if rest != 0:
            return None
    elif rest < rest_stages or rest % rest_stages:
        return None
    else:
        share = rest // rest_stages
    counts = [share] * pp
    if first:
        counts[0] = first
    if last:
        counts[-1] = last
    return tuple(counts) if min(counts) >= 1 else None


def uneven_problem(layers: int, pp: int, first: int, last: int) -> str | None:
    """None if ``first``/``last`` fit ``layers`` on ``pp`` stages, else a one-line message naming the
    knobs, their values and what would fit."""
    if layers_per_stage(layers, pp, first, last) is not None:
        return None
    given = ", ".join(f"{k}={v}" for k, v in ((FIRST, first), (LAST, last)) if v) or f"{FIRST}=0, {LAST}=0"
    rest_stages = pp - (first > 0) - (last > 0)
    rest = layers - first - last
    if pp > layers:
        why = f"pp={pp} stages cannot each hold one of the model's {layers} layers"
    elif rest_stages and rest < rest_stages:
        why = f"{given} leave{'s' if (first > 0) + (last > 0) == 1 else ''} {max(rest, 0)} of the {layers} layers for the other {rest_stages} stages: a stage would hold no layer"
    elif rest_stages:
        why = f"{given} leave {rest} of the {layers} layers, which the other {rest_stages} stages of pp={pp} do not share evenly"
    else:
        why = f"{given} add up to {first + last}, not the model's {layers} layers on pp={pp} stages"
    return f"{why}; {what_fits(layers, pp, first, last)}"


def what_fits(layers: int, pp: int, first: int, last: int) -> str:
    """The values that would fit: of ``last`` given ``first`` (or the reverse), else a balanced pair."""
    if pp > layers:
        return f"choose pp <= {layers}"
    if first and not last:
        fits = [v for v in range(layers + 1) if layers_per_stage(layers, pp, first, v)]
        if fits:
            return f"with {FIRST}={first}, {LAST} may be {_few(fits)}"
    if last and not first:
        fits = [v for v in range(layers + 1) if layers_per_stage(layers, pp, v, last)]
        if fits:
            return f"with {LAST}={last}, {FIRST} may be {_few(fits)}"
    pair = balanced_uneven(layers, pp)
    if pair is None:
        return f"pp={pp} divides the {layers} layers evenly: set {FIRST}=0, {LAST}=0"
    return f"for example {FIRST}={pair[0]}, {LAST}={pair[1]}"


def _few(values: list[int]) -> str:
    shown = ", ".join(map(str, values[:8]))
    return shown + (f" ... ({len(values)} values)" if len(values) > 8 else "")


def balanced_uneven(layers: int, pp: int) -> tuple[int, int] | None:
    """For ``pp`` stages that do not divide ``layers``: the first and last stages' counts that let
    the middle stages hold ``ceil(layers / pp)`` each and the ends no more (the last stage, which
    runs the output layer and the loss, the fewer of the two); None when ``pp`` divides the layers
    or no such split exists."""
    if pp < 2 or layers % pp == 0 or pp > layers:
        return None
    share = -(-layers // pp)
    ends = layers - (pp - 2) * share
    while ends < 2 and share > 1:
        share -= 1
        ends = layers - (pp - 2) * share
    if ends < 2:
        return None
    first, last = -(-ends // 2), ends // 2
    if first > share and pp > 2:
        return None
    return first, last


def explored_ends(layers: int, pps: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ``first_stage_layers`` and ``last_stage_layers`` values an exploration tries: 0 (even),
    and the balanced uneven split of each degree in ``pps`` that does not divide the layers."""
    pairs = [(pp, p) for pp, p in ((pp, balanced_uneven(layers, pp)) for pp in pps) if p is not None]
    # with two stages the last stage's count fixes the first's: (0, last) is the one plan, not also (first, 0)
    firsts = {f for pp, (f, _) in pairs if pp > 2}
    return (0,) + tuple(sorted(firsts)), (0,) + tuple(sorted({v for _, (_, v) in pairs}))


def chunk_layers(counts: tuple[int, ...], chunks: int) -> tuple[int, ...] | None:
    """Per stage of an interleaved schedule over ``chunks`` model chunks a device (stage
    ``c * pp + d`` is device ``d``'s chunk ``c``), its layer count, for the per-device ``counts``
    of uneven end stages; None when they do not split so. Every chunk holds ``q`` layers (a middle
    device's count over ``chunks``); the first device's first chunk and the last device's last
    chunk hold what their ends leave, 0 to ``q``: a chunk of 0 layers runs only the embedding (first)
    or the output layer and the loss (last). This is Llama 3's balanced interleaved pipeline (one
    layer fewer on the first and the last stage, the first chunk of the first stage holding only
    the embedding and the last chunk of the last only the output and the loss; Llama 3 paper,
    section 3.3.2) and Megatron-Core's ``--account-for-embedding-in-pipeline-split`` and
    ``--account-for-loss-in-pipeline-split`` with virtual pipeline stages."""
    pp = len(counts)
    if chunks == 1:
        return tuple(counts)
    if pp < 2 or chunks < 1:
        return None
    middle = set(counts[1:-1])
    if len(middle) > 1 or (middle and next(iter(middle)) % chunks):
        return None
    q = next(iter(middle)) // chunks if middle else -(-max(counts) // chunks)
    first, last = counts[0] - q * (chunks - 1), counts[-1] - q * (chunks - 1)
    if q < 1 or not (0 <= first <= q and 0 <= last <= q):
        return None
    out = [q] * (pp * chunks)
    out[0], out[-1] = first, last
    return tuple(out)


def layer_stages(layers: int, counts: tuple[int, ...]) -> tuple[int, ...]:
    """Per layer, its stage, for per-stage layer ``counts`` (in order)."""
    return tuple(s for s, n in enumerate(counts) for _ in range(n))


@dataclass(frozen=True)
class StageLayout:
    """Per pipeline stage (in order; with an interleaved schedule, per model chunk: stage ``s`` on
    device group ``s % groups``): its layer count (any counts that add up to the model's layers; an
    interleaved pipeline's first and last chunk may hold none, as in Llama 3's), how many of its
    layers recompute in the backward (the first ones of the stage: Megatron-LM's ``--recompute-method
    block --recompute-num-layers``, per stage), and per device group whether its devices keep the
    optimizer in host memory (ZeRO-Offload). The fine-grained space (planlab/search_spaces/fine.py)
    chooses one per plan; :func:`layout_problem` checks one."""

    layers: tuple[int, ...]
    recompute: tuple[int, ...] = ()  # empty: none
    offload: tuple[bool, ...] = ()  # per device group; empty: none
    proven: bool = True  # False: the solver stopped at its node limit, so a better layout may exist

    def recomputed(self, stage: int) -> int:
        return self.recompute[stage] if self.recompute else 0

    def offloads(self, group: int) -> bool:
        return bool(self.offload[group]) if self.offload else False

    def describe(self) -> str:
        """One line: ``layers 2/2 recompute 1/0 offload 1/0`` (stages in order)."""
        parts = [("layers", self.layers), ("recompute", self.recompute), ("offload", tuple(map(int, self.offload)))]
        line = " ".join(f"{name} {'/'.join(map(str, vals))}" for name, vals in parts if vals)
        return line if self.proven else line + " (solver's node limit: may not be the best)"


def layout_problem(layout: StageLayout, layers: int, pp: int, chunks: int = 1) -> str | None:
    """None if ``layout`` fits ``layers`` on ``pp`` stages (``pp / chunks`` device groups of
    ``chunks`` model chunks each), else one line naming the knob, its value and what fits."""
    counts = layout.layers
    if not isinstance(counts, tuple) or not all(isinstance(n, int) and not isinstance(n, bool) for n in counts):
        return f"stage_layers={counts!r}: expected a tuple of {pp} integers, one per stage"
    if len(counts) != pp:
        return f"stage_layers={counts}: {len(counts)} counts for pp={pp} stages; give {pp} counts"
    inner = counts[1:-1] if chunks > 1 else counts  # an interleaved pipeline's end chunks may hold none
    if min(inner + (1,)) < 1 or min(counts) < 0 or sum(counts) != layers:
        least = "at least 1 each (0 allowed on the first and last chunk)" if chunks > 1 else "of at least 1 each"
        return f"stage_layers={counts}: {pp} counts {least} that add up to the model's {layers} layers expected (these add up to {sum(counts)})"
    rc = layout.recompute
    if rc and (len(rc) != pp or not all(isinstance(k, int) and 0 <= k <= n for k, n in zip(rc, counts))):
        return f"stage_recompute={rc}: expected {pp} counts, each from 0 to its stage's layers {counts}"
    off, groups = layout.offload, pp // max(1, chunks)
    if off and (len(off) != groups or not all(isinstance(o, bool) for o in off)):
        return f"stage_offload={off}: expected {groups} booleans, one per device group"
    return None
