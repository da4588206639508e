"""Flow-level sharing of links: concurrent transfers on one link split its bandwidth.

Each transfer is a flow over a few links (the sender's outgoing port and the
receiver's incoming port: NVLink inside a node, the device's NIC share across
nodes). Rates follow max-min fairness (progressive filling) with every link's
capacity normalised to one: a flow alone on its links runs at full speed and
takes the time the cost model gives it; two flows on one link take twice as
long each. When a flow starts or ends, rates are recomputed for the flows that
share links with it, directly or through others, and only those are rescheduled.
"""

from __future__ import annotations

from typing import Callable

import simpy

_EPS = 1e-12


class _Flow:
    __slots__ = ("work_s", "links", "done", "rate", "since_s", "version")

    def __init__(self, work_s: float, links: tuple, done: Callable[[], None], now: float) -> None:
        self.work_s, self.links, self.done = work_s, links, done  # work_s: seconds left at full speed
        self.rate, self.since_s, self.version = 0.0, now, 0


class Network:
    """The links of a simulated cluster and the flows on them."""

    def __init__(self, env: simpy.Environment) -> None:
        self.env = env
        self.users: dict = {}  # link -> flows on it, in the order they started

    def transfer(self, work_s: float, links: tuple, done: Callable[[], None]) -> None:
        """Start a flow that takes ``work_s`` seconds alone on ``links``; ``done()`` is called when it ends."""
        if work_s <= 0:
            done()
            return
        flow = _Flow(work_s, links, done, self.env.now)
        shared = any(link in self.users for link in links)
        for link in links:
            self.users.setdefault(link, []).append(flow)
        if shared:
            self._rebalance(flow.links)
        else:  # alone on its links: full speed, nobody else changes
            flow.rate = 1.0
            self.env.timeout(work_s).callbacks.append(lambda _e: self._end(flow, 0))

    def _component(self, links: tuple) -> list[_Flow]:
        """Flows that share links with ``links``, directly or through other flows."""
        seen_links, seen, out, todo = set(), set(), [], list(links)
        while todo:
            link = todo.pop()
            if link in seen_links:
                continue
            seen_links.add(link)
            for f in self.users.get(link, ()):
                if id(f) not in seen:
                    seen.add(id(f))
                    out.append(f)
                    todo.extend(f.links)
        return out

    def _rebalance(self, links: tuple) -> None:
        now = self.env.now
        flows = self._component(links)
        for f in flows:  # bring every flow's progress up to now at its old rate
            f.work_s -= f.rate * (now - f.since_s)
            f.since_s = now
        # max-min fair rates by progressive filling, every link of capacity one
        capacity = {link: 1.0 for f in flows for link in f.links}
        left = {link: len(self.users[link]) for link in capacity}
        pending = {id(f): f for f in flows}
        while pending:
            share, bottleneck = min(((capacity[link] / n, link) for link, n in left.items() if n), key=lambda x: x[0])
            for f in self.users[bottleneck]:
                if id(f) in pending:
                    del pending[id(f)]
                    f.rate = share
                    for link in f.links:
                        capacity[link] -= share
                        left[link] -= 1
        for f in flows:
            f.version += 1
            version = f.version
            ev = self.env.timeout(max(f.work_s, 0.0) / f.rate)
            ev.callbacks.append(lambda _e, f=f, v=version: self._end(f, v))

    def _end(self, flow: _Flow, version: int) -> None:
        if version != flow.version:
            return  # its rate changed since: a later timer stands
        for link in flow.links:
            self.users[link].remove(flow)
            if not self.users[link]:
                del self.users[link]
        flow.done()
        rest = tuple(link for link in flow.links if link in self.users)
        if rest:
            self._rebalance(rest)
