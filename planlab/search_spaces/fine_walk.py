"""The fine-grained space's pipeline walked action by action: a layout's iteration time in the
program's per-layer costs (planlab/search_spaces/fine_costs.py), in the order the plan runs.

The integer program (planlab/search_spaces/fine.py) prices a pipeline in closed form, ``(M - 1) T +
sum_s t_s`` for 1F1B and ``M T + (G - 1) C`` for interleaved 1F1B (Megatron-LM's model of that
schedule). With uneven chunks neither sees where a device waits: the interleaved order runs
micro-batches through a device's chunks in rounds of ``group`` (Megatron-LM: the pipeline's size), so
a chunk slower than its neighbours stalls the devices after it in every round, not once; and a
backward cannot start before the forward of the same micro-batch has crossed the whole pipeline.
:func:`walk_s` runs each device's actions (planlab/search_spaces/schedules.py, the lists the plan
itself runs) in order: a forward starts once its device is free and the previous stage's forward
of that micro-batch has arrived, a backward once the next stage's backward has; each device then
reduces its gradients and steps its optimizer (its sync), and the iteration ends with the last.

Per stage (model chunk) ``s`` of ``n_s`` layers, ``k_s`` recomputed, on a device that offloads or not:
    forward  f_s = share (e_s + n_s l)           backward  b_s = (1 - share)(e_s + n_s l) + k_s r
    a transfer between stages: half the stage's p2p_s each way (the activation in, its gradient back)
    sync_d = unit + sum over device d's chunks of n_s (sync or offloaded sync) + the extras' sync
(``e_s``: the first stage's embedding and the last's head and loss, and every stage's once-only
time, ZeRO-3's first unit's gathers; ``share``: the forward's part of
a layer's time, from the screen). What the walk leaves out, the simulator has: per-layer compute
priced at each piece's own shapes (the screen prices a kernel's efficiency at the whole
operator's), transfers overlapped with compute, and collectives that contend for links.
"""

from __future__ import annotations

from dataclasses import dataclass

from planlab.errors import ConfigError
from planlab.search_spaces.fine_costs import StageCosts
from planlab.search_spaces.schedules import SCHEDULES, interleaved_1f1b
from planlab.search_spaces.stages import StageLayout


def stage_times_s(c: StageCosts, layout: StageLayout) -> tuple[list[float], list[float]]:
    """Per stage (model chunk) of ``layout``, its forward's and its backward's seconds per micro-batch."""
    from planlab.search_spaces.fine import stage_extras

    S = len(layout.layers)
    fwd, bwd = [], []
    for s, n in enumerate(layout.layers):
        busy_s = stage_extras(c, s, S).time_s + n * c.layer_s
        fwd.append(c.forward_share * busy_s)
        bwd.append((1 - c.forward_share) * busy_s + layout.recomputed(s) * c.recompute_s)
    return fwd, bwd


def sync_times_s(c: StageCosts, layout: StageLayout, groups: int) -> list[float]:
    """Per device group, its gradient reduction and optimizer step after its last backward."""
    from planlab.search_spaces.fine import stage_extras

    S = len(layout.layers)
    out = []
    for d in range(groups):
        per_layer_s = c.offload_sync_s if layout.offloads(d) else c.sync_s
        mine = range(d, S, groups)
        out.append(c.unit_sync_s + sum(layout.layers[s] * per_layer_s + stage_extras(c, s, S).sync_s for s in mine))
    return out


@dataclass(frozen=True)
class Walk:
    """A walked pipeline: its iteration time, and the chain of actions that set it (the critical
    path), as counts: per stage its forwards and backwards on the chain, the transfers between
    stages on it, and the device whose sync ends the iteration. The same chain is there whatever
    the layout (the order does not depend on it), so its length, linear in the layout's layers,
    recomputed layers and offloading, bounds every layout's time from below."""

    time_s: float
    forwards: tuple[int, ...]
    backwards: tuple[int, ...]
    hops: int
    device: int


def orders_of(stages: int, microbatches: int, schedule: str, chunks: int, group: int) -> list:
    """Each device group's actions in the order it runs them (planlab/search_spaces/schedules.py)."""
    G = stages // chunks
    if chunks > 1:
        return [interleaved_1f1b(d, G, microbatches, chunks, group) for d in range(G)]
    if schedule in SCHEDULES and schedule != "zb-h1":
        return [SCHEDULES[schedule](d, G, microbatches) for d in range(G)]
    raise ConfigError(f"schedule {schedule!r}: the walk runs 1f1b, gpipe and interleaved pipelines only")


def walk(
    c: StageCosts, layout: StageLayout, microbatches: int, schedule: str = "1f1b", chunks: int = 1, group: int = 0
) -> Walk:
    """The longest of :func:`walk_paths`: the iteration's time and its critical path."""
    return max(walk_paths(c, layout, microbatches, schedule, chunks, group), key=lambda p: p.time_s)


def walk_paths(
    c: StageCosts, layout: StageLayout, microbatches: int, schedule: str = "1f1b", chunks: int = 1, group: int = 0
) -> tuple[Walk, ...]:
    """Per device group, the chain of actions that ends with its sync, ``layout`` (one stage per model chunk; ``chunks`` > 1: interleaved 1F1B with ``group``
    micro-batches a chunk in a row, 0 for the pipeline's size) walked action by action in the order
    the plan runs (module docstring). ConfigError in one line for a schedule that the walk does not
    know or whose order deadlocks."""
    S = len(layout.layers)
    G = S // chunks
    fwd, bwd = stage_times_s(c, layout)
    hop_s = c.p2p_s / 2 if G > 1 else 0.0
    orders = orders_of(S, microbatches, schedule, chunks, group)
    done: dict[tuple[int, str, int], float] = {}  # (stage, phase, micro-batch): when it ended
    # what it waited for last (the critical path's step back), and whether that was a transfer from another stage
    came: dict[tuple[int, str, int], tuple[tuple | None, bool]] = {}
    free = [0.0] * G  # when each device finishes what it has run so far
    last: list[tuple | None] = [None] * G  # each device's last action run
    at = [0] * G  # each device's next action
    left = sum(len(o) for o in orders)
    while left:
        moved = False
        for d in range(G):
            while at[d] < len(orders[d]):
                a = orders[d][at[d]]
                if a.phase == "F":
                    dep = (a.stage - 1, "F", a.microbatch) if a.stage > 0 else None
                    took = fwd[a.stage]
                else:
                    dep = (a.stage + 1, "B", a.microbatch) if a.stage < S - 1 else (a.stage, "F", a.microbatch)
                    took = bwd[a.stage]
                if dep is not None and dep not in done:
                    break
                ready = 0.0 if dep is None else done[dep] + (hop_s if dep[0] != a.stage else 0.0)
                key = (a.stage, a.phase, a.microbatch)
                waited = dep is not None and ready > free[d]
                came[key] = (dep, dep[0] != a.stage) if waited else (last[d], False)
                free[d] = max(free[d], ready) + took
                done[key] = free[d]
                last[d] = key
                at[d] += 1
                left -= 1
                moved = True
        if not moved:
            raise ConfigError(
                f"the {schedule} order of {S} stages on {G} devices deadlocks at {microbatches} micro-batches"
            )
    ends = [f + s for f, s in zip(free, sync_times_s(c, layout, G))]
    return tuple(_path(came, last[d], S, ends[d], d) for d in range(G))


def _path(came: dict, step: tuple | None, stages: int, time_s: float, device: int) -> Walk:
    """The chain that ends at ``step`` on ``device``, walked back through what each action waited for.
    Its hops are the transfers it waited for: a device's step from one of its chunks to the next
    (interleaved 1F1B) runs on the device and pays none."""
    forwards, backwards, hops = [0] * stages, [0] * stages, 0
    while step is not None:
        (forwards if step[1] == "F" else backwards)[step[0]] += 1
        step, crossed = came[step]
        hops += crossed
    return Walk(time_s, tuple(forwards), tuple(backwards), hops, device)


def walk_s(
    c: StageCosts, layout: StageLayout, microbatches: int, schedule: str = "1f1b", chunks: int = 1, group: int = 0
) -> float:
    """The iteration time of ``layout`` walked action by action (:func:`walk`)."""
    return walk(c, layout, microbatches, schedule, chunks, group).time_s
