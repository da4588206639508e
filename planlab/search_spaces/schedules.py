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
    """nnScaler's interlaced pipeline (Lin et al., OSDI 2024): 1F1B over the layer stages
    ``1 .. ranks`` (rank ``r`` runs stage ``r + 1``), with two stages that every device runs
    interlaced into it: stage ``0`` (the embedding) and stage ``ranks + 1`` (the output layer
    and the loss). Every device runs the shared stages' actions in the same order, each where
    the layers' pipeline needs it: the embedding's forward of micro-batch ``k`` just before rank
    0's forward of ``k``, the output layer's forward and backward of ``k`` once the last rank's
    forward of ``k`` is done, the embedding's backward of ``k`` after rank 0's backward of ``k``.

    The lists come from one global order in rounds (the shared actions that are due, else one
    layer action of every rank that can run), each device's list a subsequence of it, so no
    device waits on a message or collective that another still has ahead of it; and every pair
    of ranks receives its messages in the order they were sent (NCCL matches point-to-point
    messages in order; a rank takes one more warm-up forward than in 1F1B when that lets a
    message through)."""
    return list(_interlaced(ranks, microbatches)[rank])


def _interlaced(ranks: int, m: int) -> tuple[tuple[Action, ...], ...]:
    embed, head, last = 0, ranks + 1, ranks - 1
    chan: dict[tuple[int, int], list] = {(a, b): [] for a in range(ranks) for b in range(ranks)}
    out: list[list[Action]] = [[] for _ in range(ranks)]
    nf, nb = [0] * ranks, [0] * ranks  # each rank's forwards and backwards done
    nxt = {"embed F": 0, "head F": 0, "head B": 0, "embed B": 0}
    every = range(ranks)

    def can_take(pairs: list[tuple[int, int, tuple]]) -> bool:
        """Each message (sender, receiver, id) is next on its channel, in the order given."""
        pos: dict[tuple[int, int], int] = {}
        for a, b, msg in pairs:
            i = pos.get((a, b), 0)
            q = chan[(a, b)]
            if i >= len(q) or q[i] != msg:
                return False
            pos[(a, b)] = i + 1
        return True

    def take(pairs):
        for a, b, _ in pairs:
            chan[(a, b)].pop(0)

    def send(pairs):
        for a, b, msg in pairs:
            chan[(a, b)].append(msg)

    def layer(r: int):
        """Rank r's next layer action as (action, messages taken, messages sent), or None."""
        warm = min(ranks - r + 1, m)  # up to one more forward than 1F1B's warm-up, when it lets messages through
        f, b = nf[r], nb[r]
        options = []
        if b < m and b < f and (f - b >= min(ranks - r - 1, m) or f == m):
            k = b
            takes = [(a, r, ("HB", k)) for a in every] if r == last else [(r + 1, r, ("LB", k))]
            sends = [(0, x, ("EB", k)) for x in every] if r == 0 else [(r, r - 1, ("LB", k))]
            options.append((Action(r + 1, "B", k), takes, sends))
        if f < m and f - b < warm:
            k = f
            takes = [(a, 0, ("EF", k)) for a in every] if r == 0 else [(r - 1, r, ("LF", k))]
            sends = [(last, x, ("HF", k)) for x in every] if r == last else [(r, r + 1, ("LF", k))]
            options.append((Action(r + 1, "F", k), takes, sends))
        for opt in options:
            if can_take(opt[1]):
                return opt
        return None

    def shared():
        k = nxt["head B"]
        if k < nxt["head F"]:
            return Action(head, "B", k), [], [(x, last, ("HB", k)) for x in every]
        k = nxt["embed B"]
        pairs = [(0, x, ("EB", k)) for x in every]
        if k < m and can_take(pairs):
            return Action(embed, "B", k), pairs, []
        k = nxt["head F"]
        pairs = [(last, x, ("HF", k)) for x in every]
        if k < m and can_take(pairs):
            return Action(head, "F", k), pairs, []
        k = nxt["embed F"]
        if k < m and k == nf[0] and nf[0] - nb[0] < min(ranks + 1, m):  # rank 0 may run its forward next
            return Action(embed, "F", k), [], [(x, 0, ("EF", k)) for x in every]
        return None

    while nxt["embed B"] < m:
        got = shared()
        if got is not None:  # a shared action: one slot of every device's list
            a, takes, sends = got
            take(takes)
            send(sends)
            for lst in out:
                lst.append(a)
            nxt[("embed " if a.stage == embed else "head ") + a.phase] += 1
            continue
        # a round: every rank's next layer action whose messages are there, as the round began
        moves = [(r, got) for r in reversed(range(ranks)) for got in [layer(r)] if got is not None]
        if not moves:  # pragma: no cover - checked for every shape the spaces use by the tests
            raise RuntimeError(f"interlaced 1F1B stalls with {ranks} ranks and {m} micro-batches: {nf} {nb} {nxt} {chan} {out}")
        for r, (a, takes, _) in moves:  # receivers first: they drain the channels
            take(takes)
        for r, (a, _, sends) in moves:
            send(sends)
            out[r].append(a)
            if a.phase == "F":
                nf[r] += 1
            else:
                nb[r] += 1
    return tuple(tuple(lst) for lst in out)


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
