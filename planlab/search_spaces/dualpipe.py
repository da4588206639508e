"""DualPipe's own order (DeepSeek-V3 technical report, section 3.2.1; the ``step`` of the
``deepseek-ai/DualPipe`` repository), written as planlab actions with the receives it posts ahead.

Rank ``r`` of ``p`` (even) holds two model chunks: stage ``r`` of the copy whose micro-batches go
down the ranks and stage ``p - 1 - r`` of the copy whose micro-batches come up. The ranks of the
first half call "phase 0" the copy going down, those of the second half the copy coming up, so
every rank starts with the copy whose first stage is nearer. Each direction takes ``m`` half
micro-batches (``m >= p``). A step runs eight parts, with ``n = p / 2`` and ``h = min(r, p - 1 - r)``:

1. ``2 (n - h - 1)`` forwards of phase 0;
2. ``h + 1`` pairs of a forward of phase 0 and one of phase 1;
3. ``n - h - 1`` rounds of a backward of phase 1 (its weight gradients deferred, zero-bubble),
   a deferred weight-gradient computation and a forward of phase 1;
4. ``m - p + h + 1`` rounds of a forward of phase 0 with a backward of phase 1, then a forward of
   phase 1 with a backward of phase 0 (the overlapped pairs);
5. ``n - h - 1`` rounds of a backward of phase 1, then a forward of phase 1 with a backward of phase 0;
6. ``h + 1`` backwards of phase 1 and phase 0, the second half of them deferring their weight gradients;
7. ``n - h - 1`` rounds of a deferred weight-gradient computation and a backward of phase 0
   (deferring its own);
8. the ``h + 1`` deferred weight-gradient computations left.

A backward is an ``I`` action; its ``W`` follows at once unless deferred (then the deferred ones
run first in, first out). The forward of a pair (parts 4 and 5) ``overlaps`` the backward's ``I``
after it (:mod:`planlab.simulator.pairs` runs the two together, each one's communication beside
the other's computation), as DualPipe's ``overlapped_forward_backward`` does; the middle ranks'
first pair of part 4 is not overlapped, as in DualPipe. DualPipe issues its point-to-point operations in batches
(``batch_isend_irecv``) and posts some receives one computation ahead (part 2 posts the next phase-0
input before the phase-1 forward, part 3 the phase-1 input before the weight-gradient
computation, a pair posts the backward's gradient before its forward): each action here carries,
as ``Action.posts``, the receives DualPipe issues between the previous computation and it, in the
order it issues them, wherever those include another action's. Messages between two ranks are
then matched in the order both post them, and the order runs without deadlock on any even number
of ranks (NCCL matches point-to-point messages in order), with at most ``p + 1`` half
micro-batches' chunks in flight on a rank (report Table 2).
"""

from __future__ import annotations

from collections import deque

from planlab.errors import ConfigError
from planlab.plan.plan import Action


class _Order:
    """One rank's computations and receives, as DualPipe issues them."""

    def __init__(self, rank: int, ranks: int) -> None:
        self.r, self.p = rank, ranks
        self.second = int(rank >= ranks // 2)
        self.f, self.b, self.rf, self.rb = [0, 0], [0, 0], [0, 0], [0, 0]
        self.deferred: deque[Action] = deque()
        self.events: list[tuple[bool, Action]] = []  # (a computation?, action)

    def _copy(self, phase: int) -> int:
        return phase ^ self.second  # 0: the copy going down, 1: the copy coming up

    def _stage(self, copy: int) -> int:
        return self.r if copy == 0 else self.p - 1 - self.r

    def _first(self, copy: int) -> bool:  # the copy's first stage: its forward receives nothing
        return self.r == (0 if copy == 0 else self.p - 1)

    def _last(self, copy: int) -> bool:  # the copy's last stage: its backward starts at the loss
        return self.r == (self.p - 1 if copy == 0 else 0)

    def recv_f(self, phase: int) -> None:
        c = self._copy(phase)
        if not self._first(c):
            self.events.append((False, Action(self._stage(c), "F", self.rf[c])))
            self.rf[c] += 1

    def recv_b(self, phase: int) -> None:
        c = self._copy(phase)
        if not self._last(c):
            self.events.append((False, Action(self._stage(c), "I", self.rb[c])))
            self.rb[c] += 1

    def forward(self, phase: int, recv: bool = True, overlaps: bool = False) -> None:
        c = self._copy(phase)
        if recv:
            self.recv_f(phase)
        self.events.append((True, Action(self._stage(c), "F", self.f[c], overlaps=overlaps)))
        self.f[c] += 1

    def backward(self, phase: int, defer: bool = False, recv: bool = True) -> None:
        c = self._copy(phase)
        if recv:
            self.recv_b(phase)
        k, s = self.b[c], self._stage(c)
        self.b[c] += 1
        self.events.append((True, Action(s, "I", k)))
        if defer:
            self.deferred.append(Action(s, "W", k))
        else:
            self.events.append((True, Action(s, "W", k)))

    def weight(self) -> None:
        self.events.append((True, self.deferred.popleft()))

    def pair(self, phase0: int, phase1: int, recv0: bool = True) -> None:
        """A forward of ``phase0`` with a backward of ``phase1``: both receives posted, then both run
        overlapped (the forward ``overlaps`` the backward's ``I``; its ``W`` follows)."""
        if recv0:
            self.recv_f(phase0)
        self.recv_b(phase1)
        self.forward(phase0, recv=False, overlaps=True)
        self.backward(phase1, recv=False)

    def actions(self) -> list[Action]:
        """The computations in order, each posting the receives issued since the one before when
        they are not just its own."""
        out, window = [], []
        for computes, a in self.events:
            if not computes:
                window.append(a)
                continue
            posts = tuple(window) if window and window != [a.bare()] else ()
            out.append(Action(a.stage, a.phase, a.microbatch, posts, a.overlaps))
            window = []
        return out


def _parts(o: _Order, n: int, h: int, m: int) -> None:
    """Parts 1 to 8 of the module's docstring on rank order ``o``."""
    middle = h == n - 1
    for _ in range(2 * (n - h - 1)):
        o.forward(0)
    o.recv_f(0)
    for _ in range(h + 1):
        o.forward(0, recv=False)
        o.recv_f(0)
        o.forward(1)
    for _ in range(n - h - 1):
        o.backward(1, defer=True)
        o.recv_f(1)
        o.weight()
        o.forward(1, recv=False)
    for i in range(m - 2 * n + h + 1):
        if i == 0 and middle:  # DualPipe does not overlap these two on the middle ranks
            o.forward(0, recv=False)
            o.backward(1)
        else:
            o.pair(0, 1, recv0=i > 0)
        o.pair(1, 0)
    for _ in range(n - h - 1):
        o.backward(1)
        o.pair(1, 0)
    defer = False
    for i in range(h + 1):
        defer = defer or (i == (h + 1) // 2 and h % 2 == 1)
        o.backward(1, defer=defer)
        defer = defer or (i == (h + 1) // 2 and h % 2 == 0)
        o.backward(0, defer=defer)
    for _ in range(n - h - 1):
        o.weight()
        o.backward(0, defer=True)
    for _ in range(h + 1):
        o.weight()


def published(rank: int, ranks: int, microbatches: int) -> list[Action]:
    """DualPipe's order on ``rank`` of ``ranks`` (even) for ``microbatches`` half micro-batches
    each way (at least ``ranks``): actions name the model stage (``rank`` going down,
    ``ranks - 1 - rank`` coming up), ``F``, ``I`` and ``W``, with the receives posted ahead."""
    if ranks % 2 or microbatches < ranks:
        raise ConfigError(
            f"DualPipe's order needs an even number of ranks and at least as many micro-batches, "
            f"got {ranks} ranks and {microbatches} micro-batches"
        )
    o = _Order(rank, ranks)
    _parts(o, ranks // 2, min(rank, ranks - 1 - rank), microbatches)
    return o.actions()
