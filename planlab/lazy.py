"""Packages whose public names are imported on first use, so that ``import planlab`` (and with it
``planlab simulate``) does not import torch, pandas or matplotlib before it needs them.

The names load through the module ``__getattr__`` hook of PEP 562, as SPEC 1 (scientific
Python's lazy loading) describes. A name that is also a submodule (``planlab.explore`` is a
function defined in ``planlab/explore.py``) stays the function when the submodule is imported:
the import system binds a loaded submodule on its package, and the package puts the function of
that name in its place, as the eager ``from planlab.explore import explore`` did.
"""

from __future__ import annotations

import importlib
import sys
import types


class LazyPackage(types.ModuleType):
    """A package module whose ``_lazy`` maps public names to the modules that define them."""

    def __getattr__(self, name: str):
        where = self.__dict__.get("_lazy", {}).get(name)
        if where is None:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where), name)
        super().__setattr__(name, value)
        return value

    def __setattr__(self, name: str, value) -> None:
        where = self.__dict__.get("_lazy", {}).get(name)
        if isinstance(value, types.ModuleType) and value.__name__ == where:
            value = getattr(value, name)  # the submodule of the same name: keep its function here
        super().__setattr__(name, value)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self.__dict__.get("_lazy", {})))


def make_lazy(package: str, names: dict[str, str]) -> None:
    """Turn the (already imported) ``package`` into a :class:`LazyPackage` serving ``names``
    (public name -> the module that defines it)."""
    module = sys.modules[package]
    module.__dict__["_lazy"] = dict(names)
    module.__class__ = LazyPackage
