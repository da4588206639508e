"""Ordering: each block's tasks in the order they run, and each device's schedule."""

from __future__ import annotations

import functools

from planlab.errors import InfeasiblePlan
from planlab.plan.passes.draft import Draft, by_block
from planlab.plan.plan import Action, Plan
from planlab.plan.program import Block


def order_blocks(d: Draft) -> Draft:
    """Write every block out as the list of its tasks in the order they run
    (:func:`~planlab.plan.passes.draft.run_order`): a forward block runs its operators' slots in
    topological order, a backward block in reverse, each slot part by part, and the update block
    part by part (:class:`~planlab.plan.passes.draft.Part`)."""
    blocks: dict[int, dict] = {}
    for (dev, key), keys in by_block(d.parts, "FBU").items():
        blocks.setdefault(dev, {})[key] = [t for k in keys for t in d.parts[k]]
    return d.replace(parts={}, blocks=blocks)


def schedule_of(plan: Plan, dev: int, blocks: dict, checked: dict) -> tuple[Action, ...]:
    """Device ``dev``'s schedule: the plan's, checked against its blocks, or by default every
    forward (stages ascending) for each micro-batch, then every backward (stages descending), then
    the update. ``checked`` remembers schedules found valid (many devices share one)."""
    m = plan.microbatches
    fs = tuple(sorted(s for s, ph in blocks if ph == "F"))
    bs = tuple(sorted((s for s, ph in blocks if ph == "B"), reverse=True))
    ws = tuple(sorted(s for s, ph in blocks if ph == "U"))
    given = plan.schedule[dev] if plan.schedule and dev < len(plan.schedule) and plan.schedule[dev] else None
    if given is None:
        return tuple(
            [Action(s, "F", k) for k in range(m) for s in fs]
            + [Action(s, "B", k) for k in range(m) for s in bs]
            + [Action(s, "U", 0) for s in ws]
        )
    split = tuple(sorted(s for s, ph in blocks if ph == "I"))
    key = (tuple((a.stage, a.phase, a.microbatch) for a in given), fs, bs, ws, m, split)
    posts = tuple((a.posts, a.overlaps) for a in given)
    if (key, posts) not in checked:  # many devices share one schedule
        check_schedule(dev, *key)
        if any(p or o for p, o in posts):
            check_posts(dev, tuple(given))
        checked[(key, posts)] = True
    return tuple(given)


def check_posts(dev: int, given: tuple[Action, ...]) -> None:
    """Refuse (InfeasiblePlan) a schedule whose action posts the receives (``Action.posts``) of an
    action that is not in the schedule, comes before it, or is posted twice, or pairs (``overlaps``)
    anything but a forward with a backward (``B`` or ``I``) that follows it."""
    at = {a.bare(): i for i, a in enumerate(given)}
    seen: set[Action] = set()
    for i, a in enumerate(given):
        for x in a.posts:
            x = x.bare()
            j = at.get(x)
            if j is None or j < i or x in seen:
                why = "is not in its schedule" if j is None else "runs before it" if j < i else "is posted twice"
                raise InfeasiblePlan(f"device {dev}'s action {a} posts the receives of {x}, which {why}")
            seen.add(x)
        if a.overlaps and (a.phase != "F" or i + 1 == len(given) or given[i + 1].phase not in "BI"):
            after = f"is followed by {given[i + 1]}" if i + 1 < len(given) else "is the last"
            raise InfeasiblePlan(
                f"device {dev}'s action {a} overlaps the next, but only a forward pairs with a backward that "
                f"follows it; it {after}"
            )


@functools.lru_cache(maxsize=256)  # a pure function of its arguments: plans explored share schedules
def check_schedule(dev: int, given: tuple, fs: tuple, bs: tuple, ws: tuple, m: int, split: tuple = ()) -> None:
    """Refuse (InfeasiblePlan) a schedule that names a block the device does not have, runs an
    action twice, runs a ``W`` before its ``I`` or misses an action."""
    need = (
        {(s, "F", k) for s in fs for k in range(m)}
        | {(s, "B", k) for s in bs for k in range(m)}
        | {(s, ph, k) for s in split for ph in "IW" for k in range(m)}
        | {(s, "U", 0) for s in ws}
    )
    seen = set()
    for a in given:
        if a not in need:
            raise InfeasiblePlan(
                f"device {dev}'s schedule has action {Action(*a)}, which names no block of that "
                f"device; expected actions like {', '.join(str(Action(*x)) for x in sorted(need)[:6])}"
            )
        if a in seen:
            raise InfeasiblePlan(f"device {dev}'s schedule runs action {Action(*a)} twice")
        if a[1] == "W" and (a[0], "I", a[2]) not in seen:  # W uses the graph its I kept
            raise InfeasiblePlan(f"device {dev}'s schedule runs {Action(*a)} before {Action(a[0], 'I', a[2])}")
        seen.add(a)
    if len(seen) != len(need):
        miss = sorted(need - seen)
        raise InfeasiblePlan(f"device {dev}'s schedule misses actions {', '.join(str(Action(*x)) for x in miss[:6])}")


def block_order(key: tuple[int, str]) -> tuple:
    """The canonical order of a device's blocks, which every valid schedule keeps per micro-batch:
    forward stages ascending, then backward stages descending (a stage's ``I`` before its ``W``),
    then the update."""
    stage, phase = key
    if phase == "F":
        return (0, stage, 0)
    if phase in ("B", "I", "W"):
        return (1, -stage, phase == "W")
    return (2, 0, 0)


def as_blocks(tasks_of: dict) -> dict:
    """Task lists by block key as :class:`~planlab.plan.program.Block` s."""
    return {key: Block(key[0], key[1], tuple(tasks)) for key, tasks in tasks_of.items()}
