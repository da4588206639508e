"""The dry run: step every device through its tasks without timing to find deadlocks.

Sends never block (they are queued per channel, first in first out, as NCCL
and gloo match them); a receive takes its channel's next message when it is
issued, which must be the one it expects: where its action runs, or ahead of
it where an action posts it (``Action.posts``), the device then waiting for
the message only where the receive's action reads it. A collective waits
until every member of its group has reached it, and all must have reached the
same one.
"""

from __future__ import annotations

from collections import defaultdict

from planlab.errors import DeadlockError
from planlab.plan.program import Program, Step, TaskKind


def find_deadlock(program: Program, *, raise_error: bool = True) -> str | None:
    """None if every device finishes; otherwise a report naming each stuck device,
    its task and the peers it waits for, followed by the rank-by-step grid."""
    run = _DryRun(program)
    problem = run.run()
    if problem is None:
        return None
    d, step, msg = problem
    report = msg + "\n" + program.grid(mark=(d, step), limit=min(step + 3, 80))
    if raise_error:
        raise DeadlockError(report)
    return report


def _waits_on_group(t) -> bool:
    return t.kind is TaskKind.COLLECTIVE and len(t.group) > 1


class _DryRun:
    """Every device's tasks in order, where each device is, and the messages on each channel."""

    def __init__(self, program: Program) -> None:
        self.seqs = {dp.device: list(dp.steps()) for dp in program.devices}
        self.pos = {d: 0 for d in self.seqs}
        self.chan: dict[tuple[int, int], list] = defaultdict(list)  # messages sent, in order
        self.taken: dict[tuple[int, int], int] = defaultdict(int)  # receives issued on each channel
        self.slot: dict[tuple[int, int], int] = {}  # (device, step) of a posted receive's wait: its message

    def run(self) -> tuple[int, int, str] | None:
        """Step until every device is done (None) or none can move: ``(device, step, message)``."""
        while True:
            progress, waiting, problem = self._advance()
            if problem:
                return problem
            moved, mismatch = self._meet(waiting)
            if all(self.pos[d] == len(s) for d, s in self.seqs.items()):
                return None
            if progress or moved:
                continue
            return mismatch or self._stuck(waiting)

    def _advance(self) -> tuple[bool, dict, tuple | None]:
        """Move every device until it waits for a message or a collective; returns whether any
        moved, the devices waiting at a collective, and a message out of order."""
        progress, waiting = False, {}
        for d, seq in self.seqs.items():
            while self.pos[d] < len(seq):
                a, t, how = seq[self.pos[d]]
                if t.kind is TaskKind.SEND:
                    self.chan[(d, t.peer)].append((t.tag, a.microbatch, t.name))
                elif t.kind is TaskKind.RECV:
                    ch, key = (t.peer, d), (d, a.bare(), t.name, t.tag)
                    if how is Step.POST:  # takes its place on the channel now, waited for later
                        self.slot[key] = self.taken[ch]
                        self.taken[ch] += 1
                    else:
                        at = self.slot[key] if how is Step.WAIT else self.taken[ch]
                        if at >= len(self.chan[ch]):
                            break
                        tag, mb, name = self.chan[ch][at]
                        if (tag, mb) != (t.tag, a.microbatch):
                            return progress, waiting, self._out_of_order(d, a, t, mb, name)
                        self.taken[ch] += how is Step.RUN
                        self.slot.pop(key, None)
                elif _waits_on_group(t):
                    break
                self.pos[d] += 1
                progress = True
            if self.pos[d] < len(seq) and _waits_on_group(seq[self.pos[d]][1]):
                waiting[d] = seq[self.pos[d]][:2]
        return progress, waiting, None

    def _out_of_order(self, d: int, a, t, mb: int, name: str) -> tuple[int, int, str]:
        """A receive whose message on its channel is another's."""
        return (
            d,
            self.pos[d],
            f"device {d} expects {t} (micro-batch {a.microbatch}) from device "
            f"{t.peer}, but its message on that channel is {name} "
            f"(micro-batch {mb}): the two devices order their transfers differently",
        )

    def _meet(self, waiting: dict) -> tuple[bool, tuple | None]:
        """Collectives whose members all wait at the same one proceed together; returns whether
        any did, and the first group whose members wait at different ones."""
        moved, mismatch = False, None
        for d, (a, t) in list(waiting.items()):
            if d not in waiting:
                continue
            others = [waiting.get(m) for m in t.group]
            if not all(o is not None for o in others):
                continue
            mism = [
                m
                for m, o in zip(t.group, others)
                if (o[1].collective, tuple(o[1].group), o[0].microbatch, o[1].name)
                != (t.collective, tuple(t.group), a.microbatch, t.name)
            ]
            if mism:  # a problem unless another collective lets the members go on (checked by the caller)
                m = mism[0]
                mismatch = mismatch or (
                    d,
                    self.pos[d],
                    f"device {d} is at {t} (action {a}) while device {m} of the "
                    f"same group is at {waiting[m][1]} (action "
                    f"{waiting[m][0]}): the group's members issue "
                    "collectives in different orders",
                )
                continue
            for m in t.group:
                self.pos[m] += 1
                waiting.pop(m, None)
            moved = True
        return moved, mismatch

    def _stuck(self, waiting: dict) -> tuple[int, int, str]:
        """Nobody can move: each stuck device and what it waits for."""
        lines = []
        for d, seq in self.seqs.items():
            if self.pos[d] < len(seq):
                a, t, _ = seq[self.pos[d]]
                if t.kind is TaskKind.RECV:
                    lines.append(f"device {d} waits at {t} (action {a}) for device {t.peer}")
                else:
                    missing = [m for m in t.group if m not in waiting]
                    lines.append(f"device {d} waits at {t} (action {a}) for device(s) {missing}")
        d0 = next(d for d in self.seqs if self.pos[d] < len(self.seqs[d]))
        return d0, self.pos[d0], "deadlock: " + "; ".join(lines)
