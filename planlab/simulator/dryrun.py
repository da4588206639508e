"""The dry run: step every device through its tasks without timing to find deadlocks.

Sends never block (they are queued per channel, first in first out, as NCCL
and gloo match them); a receive waits for its channel's next message, which
must be the one it expects; a collective waits until every member of its
group has reached it, and all must have reached the same one.
"""

from __future__ import annotations

from collections import defaultdict, deque

from planlab.errors import DeadlockError
from planlab.plan.program import Program, TaskKind


def find_deadlock(program: Program, *, raise_error: bool = True) -> str | None:
    """None if every device finishes; otherwise a report naming each stuck device,
    its task and the peers it waits for, followed by the rank-by-step grid."""
    seqs = {dp.device: [(a, t) for a, t in dp.tasks_in_order()] for dp in program.devices}
    pos = {d: 0 for d in seqs}
    chan: dict[tuple[int, int], deque] = defaultdict(deque)
    problem = None
    while True:
        progress = False
        waiting_coll: dict[int, tuple] = {}
        for d, seq in seqs.items():
            while pos[d] < len(seq):
                a, t = seq[pos[d]]
                if t.kind is TaskKind.SEND:
                    chan[(d, t.peer)].append((t.tag, a.microbatch, t.name))
                elif t.kind is TaskKind.RECV:
                    q = chan[(t.peer, d)]
                    if not q:
                        break
                    tag, mb, name = q[0]
                    if (tag, mb) != (t.tag, a.microbatch):
                        problem = (
                            d,
                            pos[d],
                            f"device {d} expects {t} (micro-batch {a.microbatch}) from device "
                            f"{t.peer}, but the next message on that channel is {name} "
                            f"(micro-batch {mb}): the two devices order their transfers differently",
                        )
                        break
                    q.popleft()
                elif t.kind is TaskKind.COLLECTIVE and len(t.group) > 1:
                    break
                pos[d] += 1
                progress = True
            if problem:
                break
            if pos[d] < len(seq):
                a, t = seq[pos[d]]
                if t.kind is TaskKind.COLLECTIVE and len(t.group) > 1:
                    waiting_coll[d] = (a, t)
        if problem:
            break
        # collectives whose members are all waiting on the same one proceed together
        mismatch = None
        for d, (a, t) in list(waiting_coll.items()):
            if d not in waiting_coll:
                continue
            others = [waiting_coll.get(m) for m in t.group]
            if all(o is not None for o in others):
                mism = [
                    m
                    for m, o in zip(t.group, others)
                    if (o[1].collective, tuple(o[1].group), o[0].microbatch, o[1].name)
                    != (t.collective, tuple(t.group), a.microbatch, t.name)
                ]
                if mism:  # a problem unless another collective lets the members go on (checked below)
                    m = mism[0]
                    mismatch = mismatch or (
                        d,
                        pos[d],
                        f"device {d} is at {t} (action {a}) while device {m} of the "
                        f"same group is at {waiting_coll[m][1]} (action "
                        f"{waiting_coll[m][0]}): the group's members issue "
                        "collectives in different orders",
                    )
                    continue
                for m in t.group:
                    pos[m] += 1
                    waiting_coll.pop(m, None)
                progress = True
        if problem or all(pos[d] == len(s) for d, s in seqs.items()):
            break
        if not progress and mismatch:
            problem = mismatch
            break
        if not progress:
            lines = []
            for d, seq in seqs.items():
                if pos[d] < len(seq):
                    a, t = seq[pos[d]]
                    if t.kind is TaskKind.RECV:
                        lines.append(f"device {d} waits at {t} (action {a}) for device {t.peer}")
                    else:
                        missing = [m for m in t.group if m not in waiting_coll]
                        lines.append(f"device {d} waits at {t} (action {a}) for device(s) {missing}")
            d0 = next(d for d in seqs if pos[d] < len(seqs[d]))
            problem = (d0, pos[d0], "deadlock: " + "; ".join(lines))
            break
    if problem is None:
        return None
    d, step, msg = problem
    report = msg + "\n" + program.grid(mark=(d, step), limit=min(step + 3, 80))
    if raise_error:
        raise DeadlockError(report)
    return report
