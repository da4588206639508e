"""Failures of a multi-process run: where each rank is, what went wrong, and one report.

Each rank keeps a small progress record in a memory-mapped file of the run's
directory: the step and action it is in and the task it runs (a precomputed
label written before every task). The record survives a hard kill, so the
launcher can name the task a killed rank was running. A rank that raises writes
a failure report (JSON) next to it and exits at once; its peers then fail in
their next collective or receive (the connection closes) or time out, and the
launcher stops the rest. :func:`diagnose` reads every report and record and
names the root cause: a rank that raised or was killed before one that timed
out, before one whose peer went away.

A watchdog thread per rank is the backstop for a wait that the process group's
own timeout does not end: with no progress for the timeout plus a grace period
it writes a report and ends the process.

Test-only fault injection: the environment variable ``PLANLAB_FAULT`` (read by
each worker) makes one rank fail at one task::

    PLANLAB_FAULT="rank=1,task=blocks_0_attn_q,kind=raise"   # or kind=kill (SIGKILL), kind=hang
    PLANLAB_FAULT="rank=1,task=blocks_0_attn_q,kind=raise,step=1,action=0B0"

``task`` is a task name of that rank's Program (as in ``planlab run``'s report);
``step`` (default 0) and ``action`` (default: the first action running that task)
pick the occurrence. ``task=save-checkpoint`` fails the rank right after it has written
its checkpoint file (:mod:`planlab.executor.checkpoint`).
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from planlab.errors import ConfigError, InjectedFault, RankFailure, TaskError, choices  # noqa: F401 (re-exported)
from planlab.plan.program import Task, TaskKind

FAULT_ENV = "PLANLAB_FAULT"
FAULT_KINDS = ("raise", "kill", "hang")

_ARMED, _ACTION, _TASK, _SIZE = slice(0, 1), slice(1, 129), slice(129, 385), 385


@dataclass(frozen=True)
class Fault:
    """A fault to inject on ``rank`` at ``task`` (see the module docstring)."""

    rank: int
    task: str
    kind: str
    step: int = 0
    action: str = ""

    def __str__(self) -> str:
        where = f"step {self.step}" + (f", action {self.action}" if self.action else "")
        return f"{self.kind} on rank {self.rank} at task {self.task} ({where})"

    @classmethod
    def parse(cls, text: str) -> "Fault":
        """Parse ``rank=R,task=NAME,kind=K[,step=S][,action=A]``; ConfigError naming what is wrong."""
        fields: dict[str, str] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, eq, value = part.partition("=")
            if not eq or key.strip() not in ("rank", "task", "kind", "step", "action"):
                raise ConfigError(f"{FAULT_ENV}: {part!r} is not one of rank=, task=, kind=, step=, action=")
            fields[key.strip()] = value.strip()
        missing = [k for k in ("rank", "task", "kind") if k not in fields]
        if missing:
            raise ConfigError(f"{FAULT_ENV}={text!r} lacks {choices(missing)}")
        if fields["kind"] not in FAULT_KINDS:
            raise ConfigError(f"{FAULT_ENV}: kind {fields['kind']!r} is not {choices(FAULT_KINDS)}")
        try:
            rank, step = int(fields["rank"]), int(fields.get("step", 0))
        except ValueError:
            raise ConfigError(f"{FAULT_ENV}: rank and step must be integers, got {text!r}") from None
        return cls(rank, fields["task"], fields["kind"], step, fields.get("action", ""))

    def trigger(self) -> None:
        """Fail as ``kind`` says: raise, kill this process with SIGKILL, or sleep until killed."""
        if self.kind == "raise":
            raise InjectedFault(f"fault injected by {FAULT_ENV}")
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        while True:  # hang
            time.sleep(3600)


def fault_from_env(rank: int, environ: Mapping[str, str] = os.environ) -> Fault | None:
    """The fault ``PLANLAB_FAULT`` asks of ``rank``, or None."""
    text = environ.get(FAULT_ENV, "").strip()
    if not text:
        return None
    fault = Fault.parse(text)
    return fault if fault.rank == rank else None


class Progress:
    """Where a rank is, in a small memory-mapped record (or in memory without ``path``).

    ``armed`` is True while the rank waits on others or runs tasks (the watchdog watches
    only then); :meth:`task` takes a label from :meth:`encode`, made once per task.
    """

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.path = Path(path) if path is not None else None
        if self.path is None:
            self.buf: mmap.mmap | bytearray = bytearray(_SIZE)
        else:
            with open(self.path, "w+b") as f:
                f.write(b"\0" * _SIZE)
                f.flush()
                self.buf = mmap.mmap(f.fileno(), _SIZE)

    @staticmethod
    def encode(label: str) -> bytes:
        """A task label padded to the record's task field."""
        raw = label.encode()[: _TASK.stop - _TASK.start]
        return raw + b"\0" * (_TASK.stop - _TASK.start - len(raw))

    def phase(self, text: str, *, armed: bool = True, task: str = "") -> None:
        """Enter a phase (``step 0, action 0F1``; ``setup``), clearing the task field."""
        raw = text.encode()[: _ACTION.stop - _ACTION.start]
        self.buf[_ACTION] = raw + b"\0" * (_ACTION.stop - _ACTION.start - len(raw))
        self.buf[_TASK] = self.encode(task)
        self.buf[_ARMED] = b"\1" if armed else b"\0"

    def task(self, label: bytes) -> None:
        self.buf[_TASK] = label

    def snapshot(self) -> bytes:
        return bytes(self.buf[:_SIZE])

    @property
    def armed(self) -> bool:
        return self.buf[0] == 1

    def where(self) -> str:
        return describe(self.snapshot())


def describe(record: bytes) -> str:
    """``step 0, action 0F1, task F:wte`` from a progress record."""
    phase = record[_ACTION].rstrip(b"\0").decode(errors="replace")
    task = record[_TASK].rstrip(b"\0").decode(errors="replace")
    return f"{phase}, task {task}" if task else phase or "start-up"


class Watchdog(threading.Thread):
    """Calls ``on_hang(seconds, where)`` once when an armed ``progress`` has not moved for ``limit_s``."""

    def __init__(self, progress: Progress, limit_s: float, on_hang: Callable[[float, str], None]) -> None:
        super().__init__(name="planlab-watchdog", daemon=True)
        self.progress, self.limit_s, self.on_hang = progress, limit_s, on_hang
        self.stopped = threading.Event()

    def run(self) -> None:
        last, since = self.progress.snapshot(), time.monotonic()
        while not self.stopped.wait(min(1.0, self.limit_s / 20)):
            now, snap = time.monotonic(), self.progress.snapshot()
            if snap != last or not self.progress.armed:
                last, since = snap, now
            elif now - since >= self.limit_s:
                self.on_hang(now - since, describe(snap))
                return

    def stop(self) -> None:
        self.stopped.set()


# -- reports -------------------------------------------------------------------


def waited_on(task: Task) -> str:
    """``group [0, 1]`` for a collective, ``peer 3`` for a send or receive, else ``""``."""
    if task.kind is TaskKind.COLLECTIVE:
        return f"group {list(task.group)}"
    if task.kind in (TaskKind.SEND, TaskKind.RECV):
        return f"peer {task.peer}"
    return ""


def classify(exc: BaseException) -> str:
    """``timeout`` (a wait ran out), ``peer`` (a peer went away) or ``error`` (anything else)."""
    if isinstance(exc, InjectedFault):
        return "error"
    text = str(exc).lower()
    if "timed out" in text or "timeout" in text:
        return "timeout"
    if any(
        w in text
        for w in (
            "connection closed",
            "connection reset",
            "broken pipe",
            "connection refused",
            "closed by peer",
            "socket closed",
            "end of file",
        )
    ):
        return "peer"
    import torch.distributed as dist

    return "peer" if isinstance(exc, dist.DistError) else "error"


def progress_path(run_dir: str | os.PathLike, rank: int) -> Path:
    return Path(run_dir) / f"rank{rank}.progress"


def write_report(
    run_dir: str | os.PathLike, rank: int, *, cause: str, where: str, error: str, waited_on: str = ""
) -> None:
    """Write rank ``rank``'s failure report (atomically) into ``run_dir``."""
    path = Path(run_dir) / f"rank{rank}.failure.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(
        json.dumps(
            dict(
                rank=rank, pid=os.getpid(), cause=cause, where=where, error=error, waited_on=waited_on, time=time.time()
            )
        )
    )
    os.replace(tmp, path)


_PRIORITY = {"error": 0, "killed": 0, "exited": 0, "timeout": 1, "peer": 2}


def diagnose(run_dir: str | os.PathLike, exitcodes: Mapping[int, int], world: int) -> RankFailure:
    """The root cause of a failed run from the reports and progress records in ``run_dir`` and the
    exit codes the launcher saw (``{rank: code}``, negative for a signal)."""
    found: dict[int, dict] = {}
    for p in Path(run_dir).glob("rank*.failure.json"):
        try:
            r = json.loads(p.read_text())
            found[int(r["rank"])] = r
        except (OSError, ValueError, KeyError):
            continue
    where = {r: _read_where(run_dir, r) for r in range(world)}
    for r, code in exitcodes.items():
        if r in found:
            continue
        if code is not None and code < 0:
            sig = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
            cause, error = "killed", f"killed by signal {sig}"
        else:
            cause, error = "exited", f"exited with status {code} without a report"
        found[r] = dict(rank=r, cause=cause, where=where.get(r, "start-up"), error=error, waited_on="", time=0.0)
    if not found:
        return RankFailure(
            f"the run failed (exit codes {dict(exitcodes)}) and no rank left a report",
            rank=-1,
            where="",
            error="",
            cause="exited",
        )
    root = min(found.values(), key=lambda r: (_PRIORITY.get(r["cause"], 3), r["time"], r["rank"]))
    rank = root["rank"]
    meanwhile = {r: w for r, w in where.items() if r != rank and r not in found}
    return RankFailure(
        failure_message(root, meanwhile), rank=rank, where=root["where"], error=root["error"], cause=root["cause"]
    )


def failure_message(report: Mapping, meanwhile: Mapping[int, str] | None = None) -> str:
    """One line for a rank's failure ``report`` (rank, cause, where, error, waited_on); for a
    timeout, ``meanwhile`` names where other ranks were."""
    rank = report["rank"]
    if report["cause"] == "killed":
        msg = f"rank {rank} was {report['error']} at {report['where']}"
    elif report["cause"] == "timeout":
        msg = f"rank {rank} timed out at {report['where']}"
        msg += f" waiting on {report['waited_on']}" if report["waited_on"] else ""
        msg += f": {report['error']}"
        others = [f"rank {r} at {w}" for r, w in (meanwhile or {}).items()]
        msg += f" (meanwhile {'; '.join(others)})" if others else ""
    else:
        msg = f"rank {rank} failed at {report['where']}: {report['error']}"
        msg += f" (waiting on {report['waited_on']})" if report["cause"] == "peer" and report["waited_on"] else ""
    return " ".join(msg.split())


def _read_where(run_dir: str | os.PathLike, rank: int) -> str:
    try:
        return describe(progress_path(run_dir, rank).read_bytes()[:_SIZE])
    except OSError:
        return "start-up"
