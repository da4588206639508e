"""The registry of named spaces and the ``--space`` syntax.

Register a space with one line in any module of ``planlab/search_spaces/`` (every module of the
package is imported the first time a name is looked up or the spaces are listed), or in your own
code before exploring::

    register_space("zero3", lambda: DataParallel().restrict(zero=3).named("zero3"))

``parse_space`` reads ``--space``: a registered name, ``package.module:attribute`` (a Space, a
Space subclass, or a function returning a Space), a product ``a*b`` and a union ``a|b``
(``*`` binds tighter than ``|``).
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from typing import Callable

from planlab.errors import ConfigError, PlanlabError, choices
from planlab.search_spaces.space import Space

SPACES: dict[str, Callable[[], Space]] = {}


def register_space(name: str, factory: Callable[[], Space], *, replace: bool = False) -> None:
    """Make ``factory()`` (a Space class or a function returning a Space) available as ``name``."""
    if not isinstance(name, str) or not name or any(c in name for c in "*|: "):
        raise ConfigError(f"space name {name!r}: use a non-empty name without '*', '|', ':' or spaces")
    if not callable(factory):
        raise ConfigError(
            f"space {name!r}: register a Space class or a function returning a Space, not a {type(factory).__name__}"
        )
    if name in SPACES and SPACES[name] is not factory and not replace:
        raise ConfigError(f"space {name!r} is registered already; pass replace=True to replace it")
    SPACES[name] = factory


@functools.cache
def _discover() -> None:
    """Import every module of planlab.search_spaces once (cached), so that their registrations run."""
    import planlab.search_spaces as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{pkg.__name__}.{info.name}")


def space_names() -> list[str]:
    """Every registered space's name, built-in ones first."""
    _discover()
    return list(SPACES)


def make_space(name: str) -> Space:
    """The registered space ``name``."""
    if name not in SPACES:
        _discover()
    if name not in SPACES:
        raise ConfigError(
            f"unknown space {name!r}; choose {choices(list(SPACES))}, a product like 'dp*tp', "
            "a union like 'megatron|zero3', or package.module:space"
        )
    sp = _call(SPACES[name], name)
    return sp


def _call(factory: Callable, what: str) -> Space:
    try:
        obj = factory()
    except PlanlabError:
        raise
    except Exception as e:
        raise ConfigError(f"space {what!r} raised {type(e).__name__} while being made: {e}") from e
    if not isinstance(obj, Space):
        raise ConfigError(f"space {what!r} is a {type(obj).__name__}, not a planlab Space")
    return obj


def load_user_space(spec: str) -> Space:
    """``package.module:attribute``: a Space, a Space subclass, or a function returning a Space."""
    mod, _, attr = spec.partition(":")
    if not mod or not attr:
        raise ConfigError(f"space {spec!r}: expected package.module:attribute")
    try:
        obj = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"cannot load space {spec!r}: {type(e).__name__}: {e}") from None
    except Exception as e:
        raise ConfigError(f"cannot load space {spec!r}: importing {mod} raised {type(e).__name__}: {e}") from e
    if isinstance(obj, Space):
        return obj
    if isinstance(obj, type) and not issubclass(obj, Space):
        raise ConfigError(f"{spec!r} is the class {obj.__name__}, not a planlab Space")
    if callable(obj):
        return _call(obj, spec)
    raise ConfigError(f"{spec!r} is a {type(obj).__name__}, not a planlab Space")


def parse_space(spec: str) -> Space:
    """A Space from the ``--space`` syntax: ``name``, ``package.module:space``, ``a*b``, ``a|b``."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"--space needs a space name, got {spec!r}")
    spec = spec.strip()
    if "|" in spec:
        from planlab.search_spaces.compose import Union

        return Union([parse_space(p) for p in _split(spec, "|")], name=spec)
    if "*" in spec:
        parts = [parse_space(p) for p in _split(spec, "*")]
        out = parts[0]
        for p in parts[1:]:
            out = out * p
        if len(out.alternatives()) == 1:
            out.name = spec
        return out
    if ":" in spec:
        return load_user_space(spec)
    return make_space(spec)


def _split(spec: str, sep: str) -> list[str]:
    parts = [p.strip() for p in spec.split(sep)]
    if any(not p for p in parts):
        raise ConfigError(f"space {spec!r}: an empty name around {sep!r}")
    return parts
