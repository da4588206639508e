"""Pipeline schedules as data: per-stage lists of actions (pure functions)."""

from __future__ import annotations

from planlab.errors import ConfigError
from planlab.plan.plan import Action


def gpipe(stage: int, stages: int, microbatches: int) -> list[Action]:
    """All forwards, then all backwards."""
    return [Action(stage, "F", i) for i in range(microbatches)] + [Action(stage, "B", i) for i in range(microbatches)]


def one_f_one_b(stage: int, stages: int, microbatches: int) -> list[Action]:
    """1F1B (PipeDream-Flush): ``stages - stage - 1`` warm-up forwards, then one
    forward and one backward in turn, then the remaining backwards."""
    warmup = min(stages - stage - 1, microbatches)
    out = [Action(stage, "F", i) for i in range(warmup)]
    for i in range(microbatches - warmup):
        out += [Action(stage, "F", warmup + i), Action(stage, "B", i)]
    out += [Action(stage, "B", i) for i in range(microbatches - warmup, microbatches)]
    return out


def interleaved_1f1b(
    rank: int, ranks: int, microbatches: int, chunks: int, group: int = 0, paired: bool = False
) -> list[Action]:
    """Interleaved 1F1B: device ``rank`` holds ``chunks`` model chunks, stages ``rank, rank + ranks,
    ...``; micro-batches go through the chunks in groups of ``group`` (0: ``ranks``). Warm-up is
    ``2 (ranks - rank - 1) + (chunks - 1) group`` forwards, then one forward and one backward in
    turn. Needs ``microbatches`` divisible by ``group``.

    ``paired``: Megatron-Core's batch-level expert all-to-all overlap (``--overlap-moe-expert-parallel-comm``,
    core_r0.14.0 ``pipeline_parallel/schedules.py``: ``get_pp_rank_microbatches`` schedules one more
    warm-up forward "to ensure the forward and backward computations are independent in all 1f1b
    steps", and each steady-state step runs its forward and backward as one combined step,
    ``combined_1f1b_schedule_for_interleaved_pipelining``, the all-to-alls of each beside the
    computation of the other, "inspired by the DSv3 DualPipe implementation", its MoE README): each
    steady-state forward ``overlaps`` the backward after it (:mod:`planlab.simulator.pairs`).

    ``group`` is N of Llama 3's pipeline schedule (Dubey et al. 2024, section 3.3.2, Figure 6: "the
    number of contiguous micro-batches for the same stage's forward or backward", set flexibly, N = 5
    in its figure; Megatron-LM's depth-first schedule is N = ranks). PyTorch's
    ``ScheduleInterleaved1F1B`` (torch/distributed/pipelining/schedules.py, its "flex_pp" schedule) runs
    N = ``microbatches_per_round`` = M // max(1, M // ranks) with this warm-up (``_get_warmup_ops``:
    ``(n_local_stages - 1) * microbatches_per_round + 2 * (pp_group_size - 1 - rank)``), which is
    ``ranks`` whenever the micro-batches divide by it, and never fewer than ``ranks`` unless it is all
    of them (fewer micro-batches than stages): with several groups of fewer than ``ranks`` this order
    deadlocks (the first rank's warm-up waits for a forward the last rank runs only after a backward
    that waits for the first rank). N sets the chunks a device keeps in flight; ``ranks`` keeps the
    fewest of the orders that run."""
    group = group or ranks
    if group < 1 or microbatches % group:
        raise ConfigError(
            f"interleaved 1F1B needs the micro-batches ({microbatches}) to be a multiple of its group "
            f"of micro-batches ({group}{'' if group != ranks else ', the stages'})"
        )
    if group < ranks and group != microbatches:
        raise ConfigError(
            f"interleaved 1F1B with a group of {group} micro-batches, fewer than the {ranks} stages, deadlocks "
            f"over {microbatches // group} groups: take a group of at least {ranks} or all {microbatches}"
        )
    total = microbatches * chunks

    def unit(k: int, backward: bool) -> Action:
        chunk = (k // group) % chunks
        if backward:
            chunk = chunks - 1 - chunk
        mb = (k // (group * chunks)) * group + k % group
        return Action(chunk * ranks + rank, "B" if backward else "F", mb)

    warmup = min(total, 2 * (ranks - rank - 1) + (chunks - 1) * group + paired)
    out = [unit(k, False) for k in range(warmup)]
    for i in range(total - warmup):
        f = unit(warmup + i, False)
        out += [Action(f.stage, f.phase, f.microbatch, overlaps=True) if paired else f, unit(i, True)]
    out += [unit(k, True) for k in range(total - warmup, total)]
    return out


def zb_h1(stage: int, stages: int, microbatches: int) -> list[Action]:
    """Zero-bubble ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, Figure 3):
    the backward is split into ``I`` (input gradients, on the critical path) and ``W`` (weight
    gradients, deferrable). 1F1B's order with 1F1B's memory: ``stages - stage - 1`` warm-up
    forwards, then ``stage`` rounds of a forward and an ``I`` without ``W`` (stage ``s`` starts its
    ``W`` passes ``s`` micro-batches late), then ``F I W`` in turn, then ``I W``; the ``W`` passes
    still owed fill the cool-down bubble. Every stage holds at most ``stages`` micro-batches whose
    ``W`` has not run; with equal F, I and W times the bubble is a third of 1F1B's."""
    m = microbatches
    warmup = min(stages - stage - 1, m)
    out = [Action(stage, "F", k) for k in range(warmup)]
    f, i, w = warmup, 0, 0
    for _ in range(stage):  # W starts late on later stages
        if f == m:
            break
        out += [Action(stage, "F", f), Action(stage, "I", i)]
        f, i = f + 1, i + 1
    while f < m:
        out += [Action(stage, "F", f), Action(stage, "I", i), Action(stage, "W", w)]
        f, i, w = f + 1, i + 1, w + 1
    while i < m:
        out += [Action(stage, "I", i), Action(stage, "W", w)]
        i, w = i + 1, w + 1
    out += [Action(stage, "W", k) for k in range(w, m)]
    return out


SCHEDULES = {"1f1b": one_f_one_b, "gpipe": gpipe, "zb-h1": zb_h1}


def interlaced_1f1b(rank: int, ranks: int, microbatches: int) -> list[Action]:
    """nnScaler's interlaced pipeline (Lin et al., OSDI 2024): a pipeline of the layer stages
    ``1 .. ranks`` (rank ``r`` runs stage ``r + 1``) with two stages that every device runs
    interlaced into it: stage ``0`` (the embedding) and stage ``ranks + 1`` (the output layer and
    the loss), whose pieces on every device meet in collectives once per micro-batch.

    The schedule runs in cycles, each ended by the shared stages: in cycle ``j`` rank ``r`` runs
    the backward of micro-batch ``j - ranks + r`` and the forward of ``j + ranks - 1 - r`` (the
    last rank the forward first), then every device runs the output stage's forward and backward
    of micro-batch ``j``, the embedding's backward of ``j - ranks`` and its forward of
    ``j + ranks``. Each rank thus does one forward and one backward of the layers between two
    meetings of every device, as 1F1B's steady state does, so no rank waits at the output stage
    for a slower one; a message sent in one cycle is received in the next, so rank ``r`` holds
    ``2 (ranks - r) - 1`` micro-batches in flight, the last rank 2 (1F1B: ``ranks - r``): the
    price of meeting once per micro-batch. The last rank runs its forward first so that its
    outputs reach the devices of the rank before it ahead of its input gradients. Every device's
    list is a subsequence of one order in which each message is sent before it is received, and
    every pair of ranks receives its messages in the order they were sent (NCCL matches
    point-to-point messages in order), so the schedule cannot deadlock."""
    m = microbatches
    embed, head = 0, ranks + 1
    out = [Action(embed, "F", 0)] if m else []
    for j in range(1 - ranks, m + ranks):
        layers = [Action(rank + 1, "B", k) for k in [j - ranks + rank] if 0 <= k < m] + [
            Action(rank + 1, "F", k) for k in [j + ranks - 1 - rank] if 0 <= k < m
        ]
        out += layers[::-1] if rank == ranks - 1 else layers
        if 0 <= j < m:
            out += [Action(head, "F", j), Action(head, "B", j)]
        if 0 <= j - ranks < m:
            out.append(Action(embed, "B", j - ranks))
        if 0 < j + ranks < m:
            out.append(Action(embed, "F", j + ranks))
    return out


# Schedules for plans with operators on every device (Draft.spread): per rank, ranks, micro-batches.
SPREAD_SCHEDULES = {"interlaced": interlaced_1f1b}


def format_schedule(actions: list[Action]) -> str:
    """Text form, e.g. ``0F0 0F1 0B0 0B1``; :func:`parse_schedule` reads it back."""
    return " ".join(map(str, actions))


def parse_schedule(text: str) -> list[Action]:
    return [Action.parse(a) for a in text.split()]


# -- recycling (AlphaFold2): R passes of the trunk per micro-batch, the first R-1 without backward ------
# Pass r of device group ``rank`` is stage ``r * ranks + rank`` (the layout of interleaved virtual
# stages, one chunk per pass); only the last pass's stages have backward actions.


def recycled(rank: int, ranks: int, microbatches: int, passes: int, last=one_f_one_b) -> list[Action]:
    """The plain recycling schedule: every micro-batch's no-grad passes 0..R-2 run as whole forward
    sweeps, pass by pass (what a training loop that calls the pipeline R-1 times under
    ``torch.no_grad`` and then once for training does), then the last pass with ``last``'s schedule.
    With two device groups, group 1 sends group 0 both the recycled outputs (received in group 0's
    last-pass forwards) and the input gradients (received in its backwards) on one ordered channel,
    so group 0 runs the last pass's forwards first (GPipe's order) to receive them in the order sent."""
    shift = (passes - 1) * ranks
    out = [Action(r * ranks + rank, "F", k) for r in range(passes - 1) for k in range(microbatches)]
    order = gpipe if ranks == 2 and rank == 0 and passes > 1 else last
    return out + [Action(a.stage + shift, a.phase, a.microbatch) for a in order(rank, ranks, microbatches)]


def three_f_one_b(rank: int, ranks: int, microbatches: int, passes: int) -> list[Action]:
    """nnScaler's 3F1B (Lin et al., OSDI 2024) for ``passes`` recycling passes: the passes are the
    model chunks of Megatron-LM's interleaved 1F1B (micro-batches go through them in groups of
    ``ranks``), and the backward units of the no-grad passes are dropped. In the steady state each
    device runs R forwards per backward (3F1B for R = 3), and the forwards of later micro-batches'
    early passes fill the bubbles a pipeline of the last pass alone would have. Dropping every
    action of a kind that no kept action depends on keeps interleaved 1F1B's order of messages
    between each pair of devices, so the schedule cannot deadlock. Needs ``microbatches``
    divisible by ``ranks``; with one pass it is 1F1B."""
    if passes == 1:
        return one_f_one_b(rank, ranks, microbatches)
    last = (passes - 1) * ranks
    return [a for a in interleaved_1f1b(rank, ranks, microbatches, passes) if a.phase == "F" or a.stage >= last]
