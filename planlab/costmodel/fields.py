"""Typed access to the JSON objects of spec files (hardware, software), with errors that name
the file, the field and the expected form; and the plausible range of each unit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from planlab.errors import ConfigError, choices

# Plausible ranges per unit (low exclusive unless noted, high inclusive): a value outside is
# almost surely written in another unit.
_RANGE = {
    "GB": (0.0, 1e4, "gigabytes (1e9 bytes) of device memory"),
    "GBps": (0.0, 1e5, "GB/s (1e9 bytes per second, one direction)"),
    "Gbps": (0.0, 1e5, "Gbit/s per adapter"),
    "tflops": (0.0, 1e5, "TFLOP/s (1e12 flop per second)"),
    "us": (0.0, 1e6, "microseconds"),
}


def read_json(path: Path, what: str = "cluster spec file") -> Any:
    """The JSON of ``path``; ConfigError naming the file (as a ``what``) when it is missing or malformed."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{what} {str(path)!r} not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{what} {str(path)!r}: cannot read JSON: {exc}") from None


class Fields:
    """Typed access to one JSON object; errors name the file and the field path."""

    def __init__(self, obj: Any, where: str, prefix: str = "", what: str = "cluster spec file") -> None:
        if not isinstance(obj, dict):
            at = f"field {prefix.rstrip('.')!r}" if prefix else "the top level"
            raise ConfigError(f"{what} {where!r}: {at} must be a JSON object, got {obj!r}")
        self.obj, self.where, self.prefix, self.what = obj, where, prefix, what

    def error(self, key: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.what} {self.where!r}: field {self.prefix + key!r} {problem}")

    def get(self, key: str) -> Any:
        if key not in self.obj:
            raise self.error(key, "is missing")
        return self.obj[key]

    def only(self, allowed: set[str]) -> None:
        """Refuse fields not in ``allowed`` (``_``-prefixed comments are fine): a unit typo
        (``memory_GiB``) must not pass silently."""
        extra = sorted(k for k in self.obj if k not in allowed and not str(k).startswith("_"))
        if extra:
            raise self.error(extra[0], f"is not a known field; expected one of {choices(sorted(allowed))}")

    def number(
        self, key: str, *, low: float = 0.0, strict: bool = True, high: float | None = None, unit: str = ""
    ) -> float:
        """A number in (low, high] (strict) or [low, high]; ``unit`` names the expected form."""
        val = self.get(key)
        form = f" ({unit})" if unit else ""
        if isinstance(val, bool) or not isinstance(val, (int, float)):
            raise self.error(key, f"must be a number{form}, got {val!r}")
        if val < low or (strict and val == low) or (high is not None and val > high):
            rng = (
                f"{'>' if strict else '>='} {low:g}"
                if high is None
                else f"in {'(' if strict else '['}{low:g}, {high:g}]"
            )
            raise self.error(key, f"must be {rng}{form}, got {val!r}")
        return float(val)

    def unit(self, key: str, unit: str, *, strict: bool = True) -> float:
        """A number whose unit is the field name's suffix, within that unit's plausible range."""
        low, high, form = _RANGE[unit]
        return self.number(key, low=low, strict=strict, high=high, unit=form)

    def integer(self, key: str) -> int:
        """An integer >= 1."""
        val = self.get(key)
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise self.error(key, f"must be an integer >= 1, got {val!r}")
        return val

    def text(self, key: str) -> str:
        val = self.get(key)
        if not isinstance(val, str) or not val:
            raise self.error(key, f"must be a non-empty string, got {val!r}")
        return val

    def sub(self, key: str) -> Fields:
        return Fields(self.get(key), self.where, f"{self.prefix}{key}.", self.what)
