"""Composing spaces: product (``a * b``), union (``a | b``) and restriction
(``a.restrict(tp=(1, 2))``, ``a.where(predicate, text)``, ``a.allow_split(...)``).

A product applies its parts to one plan; its knobs are the union of theirs. A union holds
the plans of either of its alternatives: each assignment it yields carries the reserved key
``space`` naming the alternative it came from (an exploration's ``space`` column), and a
product with a union distributes over it: ``(a | b) * c == a*c | b*c``. A restriction is its
base space with fewer values for some knobs, extra constraints, or extra rules on the
primitives.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Iterator, Mapping

from planlab.errors import ConfigError, UnknownKnob, choices
from planlab.search_spaces.space import (
    Constraint,
    Context,
    Draft,
    Knob,
    Product,
    Space,
    apply_part,
    fmt_knobs,
)

SPACE_KEY = "space"  # the reserved key naming a union's alternative in its assignments


def product(a: Space, b: Space) -> Space:
    """``a * b``; over unions it distributes."""
    left, right = a.alternatives(), b.alternatives()
    if len(left) == 1 and len(right) == 1:
        return Product((a, b))
    return Union(tuple(product(x, y) for x in left for y in right))


def _as_values(name: str, v: Any) -> tuple:
    if isinstance(v, (tuple, list, set, frozenset, range)):
        return tuple(v)
    return (v,)


class Restricted(Space):
    """``base`` with fewer values for some knobs, extra constraints and extra rules."""

    def __init__(
        self,
        base: Space,
        *,
        values: Mapping[str, Any] | None = None,
        constraints: Iterable[Constraint] = (),
        rules: Iterable = (),
        name: str | None = None,
    ) -> None:
        if len(base.alternatives()) > 1:
            raise ConfigError(f"restrict the alternatives of union {base.name!r} through the union itself")
        self.base = base
        self.name = name or base.name
        self.order = base.order
        self.__doc__ = type(base).__doc__
        names = [k.name for k in base.all_knobs()]
        self._values: dict[str, tuple] = {}
        for k, v in (values or {}).items():
            if k not in names:
                raise ConfigError(f"space {base.name!r} has no knob {k!r} to restrict; its knobs are {choices(names)}")
            vals = _as_values(k, v)
            if not vals:
                raise ConfigError(f"space {base.name!r}: restrict({k}=()) leaves knob {k!r} no value")
            self._values[k] = vals
        self._constraints = tuple(constraints)
        self._rules = tuple(rules)

    def ordered_drafts(self) -> bool:
        return self.base.ordered_drafts()

    def sets_layouts(self) -> bool:
        return self.base.sets_layouts()

    def all_knobs(self) -> tuple[Knob, ...]:
        return tuple(self._narrow(k) if k.name in self._values else k for k in self.base.all_knobs())

    def _narrow(self, knob: Knob) -> Knob:
        allowed, space = self._values[knob.name], self.name

        def values(ctx: Context) -> tuple:
            valid = knob.range_of(ctx, space)
            chosen = [knob.check(v, ctx, space, valid) for v in allowed]  # each must be in the base's range
            return tuple(v for v in valid if v in chosen)

        default = knob.default if knob.default in allowed else (allowed[0] if len(allowed) == 1 else None)
        return dataclasses.replace(
            knob, values=values, default=default, pinned=False, explore=None, range=", ".join(map(str, allowed))
        )

    def all_constraints(self) -> tuple[Constraint, ...]:
        return tuple(dict.fromkeys(self.base.all_constraints() + self._constraints))

    def all_rules(self) -> tuple:
        return tuple(dict.fromkeys(self.base.all_rules() + self._rules))

    def apply(self, draft: Draft, values: dict) -> None:
        apply_part(self.base, draft, values)


def _lenient(c: Constraint) -> Constraint:
    """``c`` passing on the alternatives that lack a knob it reads."""

    def check(a, ctx) -> bool:
        try:
            return c.check(a, ctx)
        except UnknownKnob:
            return True

    return dataclasses.replace(c, check=check)


class Union(Space):
    """The plans of any of ``spaces`` (each under its own knobs and constraints)."""

    def __init__(self, spaces: Iterable[Space], name: str | None = None) -> None:
        alts: list[Space] = []
        for s in spaces:
            alts.extend(s.alternatives())
        seen: dict[str, int] = {}
        for s in alts:
            seen[s.name] = seen.get(s.name, 0) + 1
        dup = [n for n, c in seen.items() if c > 1]
        if dup:
            raise ConfigError(f"the union names space {dup[0]!r} twice; rename one with .named(...)")
        self._alts = tuple(alts)
        self.name = name or "|".join(s.name for s in self._alts)

    def alternatives(self) -> tuple[Space, ...]:
        return self._alts

    def ordered_drafts(self) -> bool:
        return any(s.ordered_drafts() for s in self._alts)

    def sets_layouts(self) -> bool:
        return any(s.sets_layouts() for s in self._alts)

    def all_knobs(self) -> tuple[Knob, ...]:
        seen: dict[str, Knob] = {}
        for s in self._alts:
            for k in s.all_knobs():
                seen.setdefault(k.name, k)
        return tuple(seen.values())

    def all_constraints(self) -> tuple[Constraint, ...]:
        return ()  # each alternative checks its own

    def all_rules(self) -> tuple:
        return ()

    def alternative(self, name: str) -> Space:
        for s in self._alts:
            if s.name == name:
                return s
        raise ConfigError(f"union {self.name!r} has no space {name!r}; choose {choices([s.name for s in self._alts])}")

    def pick(self, values: Mapping) -> tuple[Space, dict]:
        """The alternative an assignment belongs to (by its ``space`` key, else the first whose
        knobs cover it) and the assignment without the key."""
        rest = {k: v for k, v in values.items() if k != SPACE_KEY}
        if SPACE_KEY in values:
            return self.alternative(values[SPACE_KEY]), rest
        for s in self._alts:
            names = {k.name for k in s.all_knobs()}
            if set(rest) <= names:
                return s, rest
        raise ConfigError(f"no space of union {self.name!r} has all of the knobs {fmt_knobs(rest)}")

    def apply(self, draft: Draft, values: dict) -> None:
        s, rest = self.pick(values)
        apply_part(s, draft, rest)

    def assignments(self, ctx: Context, fixed: dict | None = None) -> Iterator[dict]:
        fixed = dict(fixed or {})
        names = [k.name for k in self.all_knobs()]
        unknown = [k for k in fixed if k not in names]
        if unknown:
            raise ConfigError(f"space {self.name!r} has no knob {unknown[0]!r}; its knobs are {choices(names)}")
        for s in self._alts:
            have = {k.name for k in s.all_knobs()}
            if any(k not in have for k in fixed):
                continue  # fixed knobs select the alternatives that have them
            for a in s.assignments(ctx, fixed):
                yield {SPACE_KEY: s.name, **a}

    def explain(self, ctx: Context, fixed: dict) -> str:
        out = []
        for s in self._alts:
            have = {k.name for k in s.all_knobs()}
            missing = [k for k in fixed if k not in have]
            if missing:
                out.append(f"{s.name} has no knob {missing[0]!r}")
            elif not any(True for _ in s.assignments(ctx, fixed)):
                out.append(
                    f"{s.name}: {s.explain(ctx, s.coerced(ctx, fixed)) or 'its constraints leave no assignment'}"
                )
        return "; ".join(out)

    def check_values(self, ctx: Context, values: Mapping) -> dict:
        s, rest = self.pick(values)
        return {SPACE_KEY: s.name, **s.check_values(ctx, rest)}

    def draft(self, ctx: Context, values: dict) -> Draft:
        s, rest = self.pick(values)
        return s.draft(ctx, rest)

    def build(self, ctx: Context, values: dict):
        s, rest = self.pick(values)
        return s.build(ctx, rest)

    def restrict(self, **values: Iterable) -> Space:
        names = {k.name for k in self.all_knobs()}
        unknown = [k for k in values if k not in names]
        if unknown:
            raise ConfigError(
                f"space {self.name!r} has no knob {unknown[0]!r} to restrict; its knobs are {choices(sorted(names))}"
            )
        alts = []
        for s in self._alts:
            have = {k.name for k in s.all_knobs()}
            mine = {k: v for k, v in values.items() if k in have}
            alts.append(s.restrict(**mine) if mine else s)
        return Union(alts, name=self.name)

    def where(self, predicate: Callable, text: str) -> Space:
        c = _lenient(Constraint.where(predicate, text))
        return Union([Restricted(s, constraints=(c,)) for s in self._alts], name=self.name)

    def allow_split(self, pattern: str, dims: Iterable[str]) -> Space:
        return Union([s.allow_split(pattern, dims) for s in self._alts], name=self.name)

    def allow_devices(self, pattern: str, devices) -> Space:
        return Union([s.allow_devices(pattern, devices) for s in self._alts], name=self.name)

    def allow_orders(self, *schedules: str) -> Space:
        return Union([s.allow_orders(*schedules) for s in self._alts], name=self.name)

    def named(self, name: str) -> Space:
        return Union(self._alts, name=name)
