"""Search spaces: typed knobs, constraints, and a builder that applies the primitives.

A :class:`Space` names knobs with their candidate values (which may depend on
the model and cluster, through a :class:`Context`), constraints over an
assignment of the knobs, and ``apply`` which records on a :class:`Draft` how
operators are split, staged and ordered. ``Draft.to_plan`` then issues the
primitives (op-trans, op-assign, op-order) through a PlanBuilder. Spaces
compose with ``*`` (product: both apply to the same plan).
"""

from __future__ import annotations

import abc
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from planlab.errors import ConfigError, InfeasiblePlan, choices
from planlab.graph.ir import Graph
from planlab.models.registry import ModelSpec
from planlab.plan.plan import Action, Plan, PlanBuilder
from planlab.search_spaces.schedules import SCHEDULES, interleaved_1f1b


@dataclass(frozen=True)
class Context:
    """What a space may look at: the traced graph, the model and the cluster."""

    graph: Graph
    model: ModelSpec
    global_batch: int
    cluster: str
    nodes: int
    num_devices: int
    devices_per_node: int

    @property
    def layers(self) -> int:
        return self.model.config().layers

    @property
    def heads(self) -> int:
        return self.model.config().heads


@dataclass(frozen=True)
class Knob:
    """A named choice with its candidate values in a context. A knob with a ``default`` is
    explored at that value only, unless ``--set`` picks another of its values."""

    name: str
    values: Callable[[Context], tuple[Any, ...]]
    doc: str = ""
    default: Any = None

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Constraint:
    """A predicate on a knob assignment, and the message that explains a violation."""

    check: Callable[[dict, Context], bool]
    message: Callable[[dict, Context], str]


@dataclass
class Draft:
    """A plan under construction: mesh axes, per-operator split dims and stages, the schedule."""

    ctx: Context
    axes: list[tuple[str, int]] = field(default_factory=list)
    dims: dict[str, list[str | None]] = field(default_factory=dict)
    stages: dict[str, int] = field(default_factory=dict)
    num_stages: int = 1
    chunks: int = 1  # stages per device group (virtual pipeline stages)
    microbatches: int = 1
    schedule: str = "1f1b"
    recompute: dict[str, int] = field(default_factory=dict)
    zero: int = 0
    colocate: dict[str, tuple[str, int]] = field(default_factory=dict)  # op -> (dim, k): coshard

    def add_axis(self, name: str, size: int, dim_of: Callable[[Any], str | None]) -> None:
        """Add a mesh axis of ``size`` devices; ``dim_of(op)`` names the dimension each
        operator splits along it (None: replicated)."""
        self.axes.append((name, size))
        for op in self.ctx.graph.operators:
            self.dims.setdefault(op.name, []).append(dim_of(op) if size > 1 else None)

    def to_plan(self, *, space: str, knobs: dict) -> Plan:
        """Issue op-trans, op-assign and op-order for this draft."""
        g = self.ctx.graph
        per_stage = math.prod(s for _, s in self.axes)
        groups = self.num_stages // self.chunks  # device groups; stage s runs on group s % groups
        if per_stage * groups != self.ctx.num_devices:
            raise InfeasiblePlan(f"{space}: {per_stage} devices per stage x {groups} pipeline ranks "
                                 f"!= {self.ctx.num_devices} devices")
        b = PlanBuilder(g, model=self.ctx.model, global_batch=self.ctx.global_batch, cluster=self.ctx.cluster,
                        nodes=self.ctx.nodes, num_devices=self.ctx.num_devices, space=space, knobs=knobs)
        b.microbatch(self.microbatches)
        b.zero(self.zero)
        group_devices = [tuple(range(r * per_stage, (r + 1) * per_stage)) for r in range(groups)]
        for op in g.operators:
            dims = self.dims.get(op.name, [None] * len(self.axes))
            for dim, (_, size) in zip(dims, self.axes):
                b.op_trans(op.name, dim, size)
            s = self.stages.get(op.name, 0)
            devices = group_devices[s % groups]
            if op.name in self.colocate:  # each piece split k times more, the k pieces on its device
                dim, k = self.colocate[op.name]
                b.op_trans(op.name, dim, k)
                devices = tuple(d for d in devices for _ in range(k))
            b.op_assign(op.name, devices, stage=s)
            if self.recompute.get(op.name):
                b.recompute(op.name, self.recompute[op.name])
        if self.num_stages > 1:
            for r in range(groups):
                if self.chunks > 1:
                    actions = interleaved_1f1b(r, groups, self.microbatches, self.chunks)
                else:
                    actions = SCHEDULES[self.schedule](r, groups, self.microbatches)
                actions = tuple(actions) + (Action(r, "U", 0),)
                for d in group_devices[r]:
                    b.op_order(d, actions)
        return b.build()


class Space(abc.ABC):
    """A search space: knobs, constraints, and ``apply`` (one assignment -> draft edits)."""

    name = "space"
    knobs: tuple[Knob, ...] = ()
    constraints: tuple[Constraint, ...] = ()
    order = 0  # product applies parts by ascending order (stages before mesh axes)

    @abc.abstractmethod
    def apply(self, draft: Draft, values: dict) -> None:
        """Record this space's choices for ``values`` on ``draft``."""

    def parts(self) -> tuple["Space", ...]:
        return (self,)

    def __mul__(self, other: "Space") -> "Space":
        return Product(self.parts() + other.parts())

    def all_knobs(self) -> tuple[Knob, ...]:
        seen: dict[str, Knob] = {}
        for p in self.parts():
            for k in p.knobs:
                seen.setdefault(k.name, k)
        return tuple(seen.values())

    def all_constraints(self) -> tuple[Constraint, ...]:
        return tuple(c for p in self.parts() for c in p.constraints)

    def assignments(self, ctx: Context, fixed: dict | None = None) -> Iterator[dict]:
        """Every knob assignment that satisfies the constraints (``fixed`` knobs pinned)."""
        fixed = dict(fixed or {})
        knobs = self.all_knobs()
        names = [k.name for k in knobs]
        unknown = [k for k in fixed if k not in names]
        if unknown:
            raise ConfigError(f"space {self.name!r} has no knob {unknown[0]!r}; its knobs are {choices(names)}")
        ranges = []
        for k in knobs:
            vals = tuple(k.values(ctx))
            if k.name in fixed:
                v = fixed[k.name]
                if v not in vals:
                    raise ConfigError(f"{k.name}={v} is not valid here: {self._why(k, v, ctx, fixed)}")
                vals = (v,)
            elif k.default is not None:
                vals = (k.default,)
            ranges.append(vals)
        for combo in itertools.product(*ranges):
            a = dict(zip(names, combo))
            if all(c.check(a, ctx) for c in self.all_constraints()):
                yield a

    def _why(self, knob: Knob, value, ctx: Context, fixed: dict) -> str:
        msg = self.explain(ctx, {**fixed, knob.name: value})
        return msg or f"choose {choices(knob.values(ctx))}"

    def explain(self, ctx: Context, fixed: dict) -> str:
        """The first constraint that the ``fixed`` knobs alone violate ('' if none does)."""
        probe = {k.name: fixed.get(k.name) for k in self.all_knobs()}
        for c in self.all_constraints():
            try:
                if not c.check(probe, ctx):
                    return c.message(probe, ctx)
            except TypeError:  # the constraint needs a knob that is not fixed
                continue
        return ""

    def build(self, ctx: Context, values: dict) -> Plan:
        """The plan of one assignment; ConfigError if it breaks one of the space's constraints."""
        probe = {k.name: values.get(k.name, k.default) for k in self.all_knobs()}
        for c in self.all_constraints():
            try:
                ok = c.check(probe, ctx)
            except TypeError:  # the constraint needs a knob that is not set
                continue
            if not ok:
                raise ConfigError(f"space {self.name!r}: {c.message(probe, ctx)}")
        draft = Draft(ctx)
        for p in sorted(self.parts(), key=lambda s: s.order):
            p.apply(draft, values)
        return draft.to_plan(space=self.name, knobs=values)

    def describe(self) -> str:
        return f"{self.name}: knobs {', '.join(k.name for k in self.all_knobs())}"


class Product(Space):
    """Spaces applied together to one plan; knobs are the union of theirs."""

    def __init__(self, spaces: tuple[Space, ...], name: str | None = None) -> None:
        self._parts = spaces
        self.name = name or "*".join(s.name for s in spaces)

    def parts(self) -> tuple[Space, ...]:
        return self._parts

    def apply(self, draft: Draft, values: dict) -> None:
        for p in sorted(self._parts, key=lambda s: s.order):
            p.apply(draft, values)
