"""Progress of a long command's phases (trace, screen, simulate, plot) on stderr: tqdm's bars on a
terminal, else a line every few seconds (a log file or a batch job's output has no use for bars).
A phase shorter than the interval prints nothing, so a quick command, or one that stops at bad
input, keeps stderr to its own lines."""

from __future__ import annotations

import sys
import time
from itertools import pairwise
from typing import Callable, TextIO

LINE_INTERVAL_S = 5.0  # seconds between two lines of one phase when stderr is not a terminal


class Lines:
    """A phase's progress as plain lines, ``screen: 1200/4716 plans, 5 s``, one every
    ``interval_s`` seconds (default :data:`LINE_INTERVAL_S`), and a last one when a phase that
    printed any ends."""

    def __init__(self, total: int, desc: str, unit: str, file: TextIO, interval_s: float | None = None) -> None:
        self.total, self.desc, self.unit, self.file = total, desc, unit, file
        self.interval_s = LINE_INTERVAL_S if interval_s is None else interval_s
        self.n, self.printed = 0, False
        self.start_s = self.last_s = time.monotonic()

    def _line(self, end: str = "") -> None:
        elapsed = time.monotonic() - self.start_s
        print(f"{self.desc}: {self.n}/{self.total} {self.unit}s, {elapsed:.1f} s{end}", file=self.file, flush=True)
        self.printed = True

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.last_s >= self.interval_s:
            self.last_s = now
            self._line()

    def close(self) -> None:
        if self.printed or time.monotonic() - self.start_s >= self.interval_s:
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


def note(text: str, elapsed_s: float, *, show: bool, file: TextIO | None = None) -> None:
    """One line for a phase without a count that took ``elapsed_s`` (``trace: gpt3-175b at batch
    1536, 4.1 s``), if it took at least :data:`LINE_INTERVAL_S`."""
    if show and elapsed_s >= LINE_INTERVAL_S:
        print(f"{text}, {elapsed_s:.1f} s", file=file if file is not None else sys.stderr, flush=True)


class PhaseClock:
    """The wall and CPU seconds of a command's phases: ``mark()`` at the end of each, with the CPU
    seconds of its worker processes (``workers_cpu_s``, a running total) where they take part."""

    def __init__(self) -> None:
        self.wall, self.cpu = [time.perf_counter()], [time.process_time()]

    def mark(self, workers_cpu_s: Callable[[], float] = lambda: 0.0) -> float:
        """The end of a phase (and the start of the next); returns the wall clock's reading."""
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time() + workers_cpu_s())
        return self.wall[-1]

    def seconds(self, names: tuple[str, ...], *, cpu: bool = False) -> dict[str, float]:
        """Each phase's seconds by its name, in order (wall, or with ``cpu`` CPU)."""
        marks = self.cpu if cpu else self.wall
        return dict(zip(names, (b - a for a, b in pairwise(marks))))
