"""Progress of a long command's phases (trace, screen, simulate, plot) on stderr: tqdm's bars on a
terminal, else a line every few seconds (a log file or a batch job's output has no use for bars)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

LINE_INTERVAL_S = 5.0  # seconds between two lines of one phase when stderr is not a terminal


class Lines:
    """A phase's progress as plain lines, ``screen: 1200/4716 plans, 5 s``, at most one every
    ``interval_s`` seconds, and a last one when the phase ends."""

    def __init__(self, total: int, desc: str, unit: str, file: TextIO, interval_s: float = LINE_INTERVAL_S) -> None:
        self.total, self.desc, self.unit, self.file, self.interval_s = total, desc, unit, file, interval_s
        self.n = 0
        self.start_s = self.last_s = time.monotonic()

    def _line(self, end: str = "") -> None:
        elapsed = time.monotonic() - self.start_s
        print(f"{self.desc}: {self.n}/{self.total} {self.unit}s, {elapsed:.1f} s{end}", file=self.file, flush=True)

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.last_s >= self.interval_s:
            self.last_s = now
            self._line()

    def close(self) -> None:
        self._line(", done")


class Silent:
    """No progress shown."""

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress(total: int, desc: str, *, show: bool, unit: str = "plan", file: TextIO | None = None):
    """A progress display with ``update(n)`` and ``close()``: tqdm on a terminal, :class:`Lines`
    elsewhere, nothing unless ``show``."""
    file = file if file is not None else sys.stderr
    if not show:
        return Silent()
    if file.isatty():
        from tqdm import tqdm

        return tqdm(total=total, unit=unit, desc=desc, file=file, leave=False)
    return Lines(total, desc, unit, file)


def note(text: str, *, show: bool, file: TextIO | None = None) -> None:
    """One line for a phase without a count (``trace: gpt3-175b at batch 1536, 0.1 s``)."""
    if show:
        print(text, file=file if file is not None else sys.stderr, flush=True)
