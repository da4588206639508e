"""Rules on the primitives a space issues: which dimensions an operator may be split along
(op-trans), which devices it may be placed on (op-assign), which pipeline orders are allowed
(op-order).

A rule names operators by a regular expression matched (``re.search``) against the operator's
name and its module path, e.g. ``r"attn\\.(q|k|v)$"`` or ``"wte|lm_head"``. ``Draft.to_plan``
checks every primitive against the space's rules as it issues it and raises InfeasiblePlan
naming the operator, the dimension, device or order, and the rule; an exploration records that
as the plan's ``reason``. Spaces carry rules in their ``rules`` attribute, or gain them with
``space.allow_split(...)``, ``space.allow_devices(...)`` and ``space.allow_orders(...)``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Union

from planlab.errors import ConfigError, InfeasiblePlan, PlanlabError, choices
from planlab.graph.ir import Graph, Operator

if TYPE_CHECKING:
    from planlab.search_spaces.space import Context


def _compile(pattern: str) -> re.Pattern:
    if not isinstance(pattern, str) or not pattern:
        raise ConfigError(f"a rule's operator pattern must be a non-empty regular expression, got {pattern!r}")
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ConfigError(f"operator pattern {pattern!r} is not a regular expression: {e}") from None


@dataclass(frozen=True)
class SplitRule:
    """Operators matching ``pattern`` may be split (op-trans) along ``dims`` only (names of their
    signature's dimensions); ``dims=()`` keeps them whole. Replication is always allowed."""

    pattern: str
    dims: tuple[str, ...]

    def __post_init__(self) -> None:
        _compile(self.pattern)
        if isinstance(self.dims, str) or not all(isinstance(d, str) for d in self.dims):
            raise ConfigError(
                f"split rule {self.pattern!r}: dims must be a tuple of dimension names, got {self.dims!r}"
            )
        object.__setattr__(self, "dims", tuple(self.dims))

    def __str__(self) -> str:
        return f"split {self.pattern!r} along {', '.join(self.dims) if self.dims else 'nothing'}"


@dataclass(frozen=True)
class PlaceRule:
    """Operators matching ``pattern`` may be placed (op-assign) on ``devices`` only (a collection
    of device numbers, or a function of the Context returning one)."""

    pattern: str
    devices: tuple[int, ...] | Callable[["Context"], Iterable[int]]

    def __post_init__(self) -> None:
        _compile(self.pattern)
        if not callable(self.devices):
            devs = tuple(self.devices)
            if not all(isinstance(d, int) and not isinstance(d, bool) for d in devs):
                raise ConfigError(f"place rule {self.pattern!r}: devices must be integers, got {devs!r}")
            object.__setattr__(self, "devices", devs)

    def allowed(self, ctx: "Context", space: str) -> frozenset[int]:
        if not callable(self.devices):
            return frozenset(self.devices)
        try:
            return frozenset(int(d) for d in self.devices(ctx))
        except PlanlabError:
            raise
        except Exception as e:
            raise ConfigError(f"space {space!r}: the devices of rule {self} raised {type(e).__name__}: {e}") from e

    def __str__(self) -> str:
        devs = "a function of the context" if callable(self.devices) else _ranges(self.devices)
        return f"place {self.pattern!r} on {devs}"


@dataclass(frozen=True)
class OrderRule:
    """Pipeline orders (op-order) allowed, by schedule name (``1f1b``, ``gpipe``, ``interleaved``...)."""

    schedules: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.schedules or not all(isinstance(s, str) for s in self.schedules):
            raise ConfigError(f"an order rule needs schedule names, got {self.schedules!r}")

    def __str__(self) -> str:
        return f"orders {', '.join(self.schedules)}"


Rule = Union[SplitRule, PlaceRule, OrderRule]


def _ranges(devs: Iterable[int]) -> str:
    """``0-7, 16`` for a set of devices."""
    out, run = [], []
    for d in sorted(set(devs)):
        if run and d == run[-1] + 1:
            run.append(d)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [d]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return "devices " + ", ".join(out) if out else "no device"


def matching_ops(pattern: str, graph: Graph) -> frozenset[str]:
    """Names of the operators whose name or module matches ``pattern`` (cached per graph)."""

    def compute() -> frozenset[str]:
        rx = _compile(pattern)
        return frozenset(op.name for op in graph.operators if rx.search(op.name) or rx.search(op.module))

    return graph.memo(("matching_ops", pattern), compute)


@dataclass
class Checker:
    """The rules of one space, resolved against one graph, checked as primitives are issued."""

    rules: tuple[Rule, ...]
    ctx: "Context"
    space: str
    splits: list = field(default_factory=list)
    places: list = field(default_factory=list)
    orders: list = field(default_factory=list)

    def __post_init__(self) -> None:
        g = self.ctx.graph
        for r in self.rules:
            if isinstance(r, OrderRule):
                self.orders.append(r)
                continue
            names = matching_ops(r.pattern, g)
            if not names:
                raise ConfigError(
                    f"space {self.space!r}: rule {r} matches no operator of the model "
                    f"(operators are named like {g.operators[0].name!r}, modules like "
                    f"{next((o.module for o in g.operators if o.module), '')!r})"
                )
            if isinstance(r, SplitRule):
                self.splits.append((r, names))
            elif isinstance(r, PlaceRule):
                self.places.append((r, names, r.allowed(self.ctx, self.space)))
            else:
                raise ConfigError(f"space {self.space!r}: {r!r} is not a rule (SplitRule, PlaceRule or OrderRule)")

    def split(self, op: Operator, dim: str) -> None:
        for r, names in self.splits:
            if op.name in names and dim not in r.dims:
                raise InfeasiblePlan(
                    f"space {self.space!r}: op_trans({op.name!r}, {dim!r}) breaks the rule "
                    f"{r}: allowed {choices(r.dims) if r.dims else 'no split'}"
                )

    def place(self, op: Operator, devices: tuple[int, ...]) -> None:
        for r, names, allowed in self.places:
            if op.name in names:
                bad = [d for d in devices if d not in allowed]
                if bad:
                    raise InfeasiblePlan(
                        f"space {self.space!r}: op_assign({op.name!r}) on device {bad[0]} breaks the rule {r}"
                    )

    def order(self, schedule: str) -> None:
        for r in self.orders:
            if schedule not in r.schedules:
                raise InfeasiblePlan(
                    f"space {self.space!r}: op_order with schedule {schedule!r} breaks the rule "
                    f"{r}: allowed {choices(r.schedules)}"
                )
