"""What a search space is made of besides its ``apply``: the :class:`Context` a space looks at,
its typed knobs (:class:`Knob`) and the constraints over an assignment of them (:class:`Constraint`,
with :class:`KnobView`, through which a strict constraint reads the knobs).
:mod:`planlab.search_spaces.space` builds spaces from them and re-exports them.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

from planlab.errors import ConfigError, KnobNotSet, PlanlabError, UnknownKnob, choices
from planlab.graph.ir import Graph
from planlab.models.families import ModelConfig
from planlab.models.spec import ModelSpec


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
    # how the exploration prices the cluster (planlab.explore.Setup's): a space that prices plans itself
    # (the fine-grained space's integer program) loads the same cost model; None: the cluster's default
    profile: str | None = None
    software: str | None = None
    precision: str | None = None

    @functools.cached_property
    def config(self) -> ModelConfig:
        """The model's config, built once per context (constraints read it on every partial
        assignment of the grid: 325k ``ModelSpec.config()`` calls took 28 s enumerating 175B's)."""
        return self.model.config()

    @property
    def layers(self) -> int:
        return self.config.layers

    @property
    def heads(self) -> int:
        return self.config.heads


KINDS = ("int", "choice", "bool")
_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


@dataclass(frozen=True)
class _Values:
    """A knob's values that do not depend on the context."""

    values: tuple

    def __call__(self, ctx: Context | None) -> tuple:
        return self.values

    def __repr__(self) -> str:
        return repr(self.values)


def fmt_knobs(values: Mapping) -> str:
    """``tp=2, pp=4`` (``(none)`` when empty)."""
    return ", ".join(f"{k}={v}" for k, v in values.items()) or "(none)"


@dataclass(frozen=True)
class Knob:
    """A named, typed choice with its valid values (its range) in a context.

    ``kind`` is ``int``, ``choice`` or ``bool`` (``Knob.int``, ``Knob.choice``, ``Knob.bool``
    build each); ``values`` is a tuple or a function of the :class:`Context`; ``default`` is the
    value a plan has when the knob is not set (the knob is "off" there); ``explore`` lists the
    values an exploration tries when the knob is not set (None: every valid value), while
    ``--set`` may pick any valid value. ``pinned`` explores the default only. A plain
    ``Knob(name, values, doc, default)`` with a default is pinned, as before typed knobs.
    """

    name: str
    values: Callable[[Context], tuple[Any, ...]]
    doc: str = ""
    default: Any = None
    kind: str = ""
    pinned: bool | None = None
    explore: tuple | Callable[[Context], tuple] | None = None
    range: str = ""  # the range in words, for listings (values that depend on the context)

    def __post_init__(self) -> None:
        if not callable(self.values):
            object.__setattr__(self, "values", _Values(tuple(self.values)))
        if self.kind and self.kind not in KINDS:
            raise ConfigError(f"knob {self.name!r}: kind {self.kind!r}; choose {choices(KINDS)}")
        if self.pinned is None:
            object.__setattr__(self, "pinned", self.default is not None and self.explore is None)
        if self.pinned and self.default is None:
            raise ConfigError(f"knob {self.name!r} is pinned but has no default")

    def __str__(self) -> str:
        return self.name

    def range_of(self, ctx: Context | None, space: str = "") -> tuple:
        """The valid values in ``ctx``; a function that raises becomes a ConfigError."""
        try:
            return tuple(self.values(ctx))
        except PlanlabError:
            raise
        except Exception as e:
            where = f"space {space!r}: " if space else ""
            raise ConfigError(f"{where}the values of knob {self.name!r} raised {type(e).__name__}: {e}") from e

    def explored(self, ctx: Context, space: str = "") -> tuple:
        """The values an exploration tries when the knob is not set."""
        if self.pinned:
            return (self.default,)
        vals = self.range_of(ctx, space)
        if self.explore is None:
            return vals
        tried = self.explore(ctx) if callable(self.explore) else self.explore  # a function of the context
        return tuple(v for v in vals if v in tried)

    def describe_explore(self, ctx: Context | None = None) -> str:
        """The values an exploration tries, in words ('' when it tries every valid value)."""
        if self.explore is None:
            return ""
        if not callable(self.explore):
            return ", ".join(map(str, self.explore))
        if ctx is None:
            return self.explore.__doc__ or "values that depend on the model and cluster"
        return ", ".join(map(str, self.explore(ctx)))

    def describe_range(self, ctx: Context | None = None) -> str:
        """The range in words: the values in ``ctx``, or ``range``, or the static values."""
        if ctx is None and self.range:
            return self.range
        try:
            return ", ".join(map(str, self.range_of(ctx)))
        except (PlanlabError, AttributeError, TypeError):
            return self.range or "(depends on the model and cluster)"

    def kind_of(self, sample: Any = None) -> str:
        if self.kind:
            return self.kind
        if isinstance(sample, bool):
            return "bool"
        return "int" if isinstance(sample, int) else "choice"

    def coerce(self, value: Any, space: str = "", sample: Any = None) -> Any:
        """``value`` as this knob's type (``"true"`` for a bool, ``"4"`` or 4.0 for an int);
        ConfigError naming the space, the knob and the value if it is not of that type."""
        kind = self.kind_of(sample)
        where = f"space {space!r}: " if space else ""
        if kind == "bool":
            if isinstance(value, bool):
                return value
            if isinstance(value, (int, float)) and value in (0, 1):
                return bool(value)
            if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
                return value.strip().lower() in _TRUE
            raise ConfigError(f"{where}knob {self.name!r} takes true or false, got {value!r}")
        if kind == "int":
            if isinstance(value, bool):
                raise ConfigError(f"{where}knob {self.name!r} takes an integer, got {value!r}")
            if isinstance(value, int):
                return value
            if isinstance(value, float) and value.is_integer():
                return int(value)
            if isinstance(value, str) and value.strip().lstrip("-").isdigit():
                return int(value)
            raise ConfigError(f"{where}knob {self.name!r} takes an integer, got {value!r}")
        return value

    def check(self, value: Any, ctx: Context, space: str = "", valid: tuple | None = None) -> Any:
        """``value`` coerced to the knob's type; ConfigError naming the space, the knob, the
        value and the valid range if it is outside the range."""
        valid = self.range_of(ctx, space) if valid is None else valid
        value = self.coerce(value, space, valid[0] if valid else None)
        if value not in valid:
            where = f"space {space!r}: " if space else ""
            raise ConfigError(f"{where}knob {self.name!r} = {value!r} is outside its range: choose {choices(valid)}")
        return value

    # -- typed constructors (defined last: their names shadow the builtins in the class body)
    @classmethod
    def choice(
        cls,
        name: str,
        values,
        doc: str = "",
        *,
        default: Any = None,
        explore: tuple | None = None,
        pinned: bool = False,
        range: str = "",
    ) -> "Knob":
        """A knob that takes one of ``values`` (a tuple, or a function of the Context)."""
        return cls(name, values, doc, default, kind="choice", pinned=pinned, explore=explore, range=range)

    @classmethod
    def bool(
        cls, name: str, doc: str = "", *, default: Any = False, explore: tuple | None = None, pinned: bool = False
    ) -> "Knob":
        """A knob that is on or off."""
        return cls(name, (False, True), doc, default, kind="bool", pinned=pinned, explore=explore)

    @classmethod
    def int(cls, name: str, values, doc: str = "", **options) -> "Knob":
        """An integer knob whose valid values are ``values`` (a tuple, a range, or a function
        of the Context); ``options`` (``default``, ``explore``, ``pinned``, ``range``) as :meth:`choice`'s."""
        return dataclasses.replace(cls.choice(name, values, doc, **options), kind="int")


class KnobView(Mapping):
    """The knobs a where-constraint reads: ``k["tp"]``. Reading a knob not assigned yet defers
    the constraint; reading a knob the space does not have is a ConfigError."""

    def __init__(self, values: Mapping, space: str = "") -> None:
        self._values, self._space = values, space
        self.read: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        if name not in self._values:
            raise UnknownKnob(
                f"space {self._space!r}: a constraint reads knob {name!r}, which the space does not "
                f"have; its knobs are {choices(list(self._values))}"
            )
        v = self._values[name]
        if v is None:
            raise KnobNotSet(name)
        self.read[name] = v
        return v

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


@dataclass(frozen=True)
class Constraint:
    """A predicate on a knob assignment, and the message that explains a violation.

    ``check(assignment, ctx)`` sees the knobs not assigned yet as None (and must then say
    True), unless ``strict``: then it reads knobs through a :class:`KnobView` and a knob not
    assigned yet defers it. ``Constraint.where(lambda k: k["tp"] * k["pp"] <= 8, "tp*pp <= 8")``
    builds a strict one.
    """

    check: Callable[[dict, Context], bool]
    message: Callable[[dict, Context], str]
    strict: bool = False

    @classmethod
    def where(cls, predicate: Callable, text: str | Callable[[dict, Context], str]) -> "Constraint":
        """A constraint from ``predicate(knobs)`` or ``predicate(knobs, ctx)``; ``text`` says what
        it requires (``{tp}`` and the like are filled in with the knobs' values)."""
        try:
            n = len(inspect.signature(predicate).parameters)
        except (TypeError, ValueError):
            n = 1
        check = predicate if n >= 2 else (lambda a, c: predicate(a))
        if callable(text):
            return cls(check, text, strict=True)

        def message(a: Mapping, c: Context) -> str:
            if "{" in text:
                try:
                    return text.format_map({k: v for k, v in a.items() if v is not None})
                except (KeyError, ValueError, IndexError):
                    pass
            view = KnobView(a)
            try:
                check(view, c)  # to learn which knobs it reads
            except Exception:
                pass
            return f"constraint {text!r} does not hold for {fmt_knobs(view.read)}" if view.read else text

        return cls(check, message, strict=True)

    @classmethod
    def divides(cls, knob: str, whole: str, size: Callable[[Context], int | None]) -> "Constraint":
        """``knob`` divides ``size(ctx)`` (a knob not assigned yet, or a size of None, passes); the
        message says ``"<knob>=<value> does not divide <whole>"``, ``{n}`` in ``whole`` being the size."""
        return cls(
            lambda a, c: a[knob] is None or size(c) is None or size(c) % a[knob] == 0,
            lambda a, c: f"{knob}={a[knob]} does not divide " + whole.format(n=size(c)),
        )

    def holds(self, a: dict, ctx: Context, space: str = "") -> bool | None:
        """True or False, or None when it cannot be decided before more knobs are assigned."""
        if self.strict:
            try:
                return bool(self.check(KnobView(a, space), ctx))
            except KnobNotSet:
                return None
        try:
            return bool(self.check(a, ctx))
        except TypeError:  # it needs a knob that is not assigned yet (None)
            if any(v is None for v in a.values()):
                return None
            raise
