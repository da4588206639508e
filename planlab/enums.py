"""``StrEnum``: enumerations whose members are strings and print as their value (Python 3.11's
``enum.StrEnum``; planlab supports Python 3.10)."""

from __future__ import annotations

from enum import Enum


class StrEnum(str, Enum):
    """An enumeration of strings whose ``str`` (and f-string form) is the member's value."""

    def __str__(self) -> str:
        return self.value
