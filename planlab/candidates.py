"""Simulating an exploration's candidates: in this process, in ``--jobs`` forked workers, or as Ray
tasks on a cluster (``--ray``); each finished row is journaled to ``--out`` at once, so that
``--resume`` continues an exploration that was interrupted.

The journal, ``OUT/simulations.jsonl``, is JSON lines: a header naming the exploration (model,
cluster, batch, space, pinned knobs, candidates, and the digests of planlab's source and of the
cluster and profile files), then one line per simulated candidate, ``{"values": knobs, "row":
result}``, appended and flushed as it finishes. A resumed exploration reads the rows whose header
matches its own (a last line cut by the interruption is ignored) and simulates only the others:
simulation is deterministic and floats round-trip through JSON exactly, so it ends with the rows
an uninterrupted run gives.
"""

from __future__ import annotations

import hashlib
import json
import math
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Hashable

from planlab.errors import ConfigError, InfeasiblePlan

if TYPE_CHECKING:
    from planlab.plan.plan import Plan
    from planlab.plan.program import Program
    from planlab.drawing import Drawing
    from planlab.search_spaces.space import Context, Space
    from planlab.simulator.result import SimResult

JOURNAL = "simulations.jsonl"
JOURNAL_FORMAT = "planlab-simulations"
JOURNAL_VERSION = 1
ROW_KEYS = ("iter_time_s", "peak_mem_gib", "tflops_per_gpu", "mfu", "feasible", "reason")
PLAN_KEY = "plan"  # a simulated row's built Plan, when it fits (taken off the row by the parent)
SIMULATED_KEY = "simulation"  # ... and its Simulated, when it ran in this process (taken off likewise)


@dataclass(frozen=True)
class Simulated:
    """A plan simulated in this process: its Program and its SimResult (with or without its
    timeline), what the outputs draw without materializing it again."""

    program: Program
    result: SimResult


class BestPlans:
    """The Plans of the fastest feasible rows simulated so far (all of them on a tie), by row index,
    and their Simulated where they ran in this process: the parent keeps the best plan as the
    workers built it (and, in a serial run, its Program and simulation), and no other."""

    def __init__(self) -> None:
        self.time_s = math.inf
        self.plans: dict[int, Plan] = {}
        self.simulated: dict[int, Simulated] = {}

    def offer(self, i: int, result: dict) -> dict:
        """``result`` without its Plan and Simulated, kept if its row is the fastest feasible one yet."""
        result = dict(result)
        plan, sim = result.pop(PLAN_KEY, None), result.pop(SIMULATED_KEY, None)
        t = result.get("iter_time_s", math.nan)
        if plan is not None and result.get("feasible") and t <= self.time_s:
            if t < self.time_s:
                self.time_s, self.plans, self.simulated = t, {}, {}
            self.plans[i] = plan
            if sim is not None:
                self.simulated[i] = sim
        return result


def _file_sha256(path: str | None) -> str | None:
    """The digest of a spec or profile file's contents (None for a built-in name)."""
    if path is None or not os.path.isfile(path):
        return None
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def exploration_header(
    *, model: dict, cluster: str, nodes: int, global_batch: int, space: str, fixed: dict, profile, candidates
) -> dict:
    """What an exploration's rows depend on; a journal resumes only under the same header."""
    from planlab import __version__
    from planlab.models.trace_cache import source_digest

    return {
        "format": JOURNAL_FORMAT,
        "version": JOURNAL_VERSION,
        "model": model,
        "cluster": cluster,
        "cluster_sha256": _file_sha256(cluster),
        "nodes": nodes,
        "global_batch": global_batch,
        "space": space,
        "fixed": {k: fixed[k] for k in sorted(fixed)},
        "profile_sha256": _file_sha256(profile),
        "candidates": candidates,
        "planlab_version": __version__,
        "planlab_source_sha256": source_digest(),
    }


def _key(values: dict) -> str:
    return json.dumps(values, sort_keys=True)


class Journal:
    """``OUT/simulations.jsonl``, written as rows finish (one line each, flushed to disk)."""

    def __init__(self, out: Path, header: dict, *, resume: bool) -> None:
        self.path = out / JOURNAL
        self.done: dict[str, dict] = {}  # knob values (as _key) -> row
        kept = self._read(header) if resume else []
        out.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(JOURNAL + ".tmp")
        with open(tmp, "w") as f:  # the header and the whole lines kept, then appended to
            f.write("".join(line + "\n" for line in [json.dumps(header), *kept]))
        os.replace(tmp, self.path)
        self.file = open(self.path, "a")

    def _read(self, header: dict) -> list[str]:
        """The rows of a journal of this exploration into ``done``; its whole lines."""
        try:
            lines = self.path.read_text().splitlines()
        except FileNotFoundError:
            return []
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--resume: cannot read {self.path}: {e}") from None
        try:
            first = json.loads(lines[0]) if lines else None
        except json.JSONDecodeError:
            first = None
        if first != header:
            what = "" if not isinstance(first, dict) else _difference(first, header)
            raise ConfigError(
                f"--resume: {self.path} is not a journal of this exploration{what}; "
                "run without --resume to start it again"
            )
        kept = []
        for line in lines[1:]:
            try:
                rec = json.loads(line)
                values, row = rec["values"], rec["row"]
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # the line being written when the run was interrupted
            if isinstance(values, dict) and isinstance(row, dict) and set(row) == set(ROW_KEYS):
                self.done[_key(values)] = row
                kept.append(line)
        return kept

    def record(self, values: dict, row: dict) -> None:
        self.file.write(json.dumps({"values": values, "row": {k: row[k] for k in ROW_KEYS}}) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())

    def row_of(self, values: dict) -> dict | None:
        return self.done.get(_key(values))

    def close(self) -> None:
        self.file.close()


def _difference(old: dict, new: dict) -> str:
    keys = [k for k in new if old.get(k) != new[k]]
    return f" (it differs in {', '.join(keys)})" if keys else ""


@dataclass
class Pending:
    """A candidate submitted to a runner: its index and the runner's handle; or a batch of
    candidates (``batch``: their indices, ``index`` the first), simulated one after another in one
    worker, whose handle gives all their rows."""

    index: int
    handle: Any
    batch: tuple[int, ...] = ()

    def holds(self, i: int) -> bool:
        return i == self.index or i in self.batch


class SerialRunner:
    """Candidates simulated one after another in this process."""

    def __init__(self, fn: Callable[[tuple[int, dict]], tuple[int, dict]]) -> None:
        self.fn = fn
        self.slots = 1

    def submit(self, i: int, values: dict, best_s: float = math.inf) -> Pending:
        return Pending(i, self.fn((i, values)))

    def draw_async(self, values: dict) -> None:
        """None: the parent draws the best plan from the Simulated it kept (see :class:`Draws`)."""
        return None

    def wait(self, pending: list[Pending], timeout_s: float) -> list[tuple[int, dict]]:
        return [p.handle for p in pending]

    def cancel(self, pending: list[Pending]) -> None:
        pass


def init_worker() -> None:
    """A worker dies on SIGTERM (``Pool.terminate``) whatever handler its parent had installed (a
    forked worker inherits them: torch's elastic launcher, say), and leaves Ctrl-C to its parent."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def drafted_before_fork(sp: Space, ctx: Context, fixed: dict | None, jobs: int) -> list[dict] | None:
    """The assignments of ``sp``, each drafted here in order, when workers will screen them and a
    draft of ``sp`` may depend on the drafts before it (:meth:`Space.ordered_drafts`: the fine
    space's pruning): the forked workers then find each outcome in the graph's memo, as one job
    would have made it. None otherwise (the workers screen while the parent enumerates)."""
    if jobs <= 1 or not sp.ordered_drafts():
        return None
    assignments = list(sp.assignments(ctx, fixed))
    for values in assignments:
        try:
            sp.draft(ctx, values)
        except InfeasiblePlan:  # refused by the space's apply: the screen records why
            pass
    return assignments


class Workers:
    """``jobs`` processes (no pool for one job) that share this process's state (forked), or, where
    forking is not available, set it up again (spawned, running ``spawned``: an initializer that
    calls :func:`init_worker`, and its arguments; no pool when None)."""

    def __init__(self, jobs: int, spawned: tuple[Callable, tuple] | None) -> None:
        self.pool = None
        self.jobs = jobs
        if jobs <= 1:
            return
        if "fork" in mp.get_all_start_methods() and sys.platform.startswith("linux"):
            self.pool = mp.get_context("fork").Pool(jobs, initializer=init_worker)
        elif spawned is not None:
            self.pool = mp.get_context("spawn").Pool(jobs, initializer=spawned[0], initargs=spawned[1])

    def cpu_s(self) -> float:
        """The CPU seconds (user and system) this process's worker processes have used so far, read
        from ``/proc``: 0 without a pool, NaN where ``/proc`` cannot be read."""
        if self.pool is None:
            return 0.0
        total = 0
        for proc in mp.active_children():
            try:
                fields = Path(f"/proc/{proc.pid}/stat").read_text().rpartition(")")[2].split()
            except OSError:
                return math.nan
            total += int(fields[11]) + int(fields[12])  # utime and stime, in clock ticks (proc(5))
        return total / os.sysconf("SC_CLK_TCK")

    def close(self, *, kill: bool = False) -> None:
        if self.pool is not None:
            if kill:
                self.pool.terminate()
            else:
                self.pool.close()
            self.pool.join()
            self.pool = None


class PoolRunner:
    """Candidates simulated in a multiprocessing pool (``--jobs``), two in flight per worker;
    ``draw_fn`` draws one assignment's timeline in a worker (:meth:`draw`); ``batch_fn`` simulates
    a batch of candidates in one worker (:meth:`submit_batch`)."""

    def __init__(
        self, pool, jobs: int, fn: Callable, draw_fn: Callable, on_cancel: Callable[[], None], batch_fn: Callable
    ) -> None:
        self.pool, self.fn, self.draw_fn, self.on_cancel, self.batch_fn = pool, fn, draw_fn, on_cancel, batch_fn
        self.slots, self.cancelled = 2 * jobs, False

    def submit(self, i: int, values: dict, best_s: float = math.inf) -> Pending:
        """``best_s``: the fastest feasible time yet; only a row as fast comes back with its Plan."""
        return Pending(i, self.pool.apply_async(self.fn, ((i, values, best_s),)))

    def submit_batch(self, batch: list[int], values: list[dict], best_s: float = math.inf) -> Pending:
        """Candidates ``batch`` (assignments ``values``) simulated one after another in one worker,
        which then builds what they share once (twins: :func:`simulate_candidates`)."""
        return Pending(batch[0], self.pool.apply_async(self.batch_fn, ((batch, values, best_s),)), tuple(batch))

    def draw_async(self, values: dict):
        """A task drawing one row's timeline (:class:`Draws`); None once the budget cancelled the pool."""
        return None if self.cancelled else self.pool.apply_async(self.draw_fn, (values,))

    def drawn(self, handle) -> Drawing | None:
        return None if self.cancelled else handle.get()

    def wait(self, pending: list[Pending], timeout_s: float) -> list[tuple[int, dict]]:
        pending[0].handle.wait(timeout_s)
        done = [p for p in pending if p.handle.ready()]
        return [row for p in done for row in (p.handle.get() if p.batch else [p.handle.get()])]

    def cancel(self, pending: list[Pending]) -> None:
        self.cancelled = True
        self.on_cancel()


class Draws:
    """The best row's :class:`~planlab.drawing.Drawing`, drawn in a worker or a Ray task: started
    for the fastest row yet once every candidate is submitted (while the last ones finish), and
    again at the end only when the final best is another row. None where the runner draws nothing
    (in this process: the parent keeps the Simulated)."""

    def __init__(self, runner, assignments: list[dict]) -> None:
        self.runner, self.assignments = runner, assignments
        self.started: dict[int, Any] = {}

    def start(self, i: int) -> None:
        if i not in self.started:
            handle = self.runner.draw_async(self.assignments[i])
            if handle is not None:
                self.started[i] = handle

    def get(self, i: int) -> Drawing | None:
        self.start(i)
        return self.runner.drawn(self.started[i]) if i in self.started else None


def simulate_candidates(
    order: list[int],
    assignments: list[dict],
    runner,
    *,
    store: Callable[[int, dict], None],
    late: Callable[[], bool],
    deadline: float | None,
    fastest: Callable[[], float] = lambda: math.inf,
    drained: Callable[[], None] = lambda: None,
    twins: Callable[[dict], Hashable] | None = None,
) -> None:
    """Submit ``order`` (fastest estimate first) to ``runner``, at most ``runner.slots`` in flight,
    and ``store`` each row as it finishes, until done or ``late()``; the rows finished as the
    budget ran out are kept, the others cancelled. ``fastest()``: the fastest feasible time stored
    yet, given with each submission (a slower row cannot be the best: its Plan stays where it was built).
    ``drained()``: called once, when the last candidate has been submitted. ``twins``: a key of an
    assignment; where the runner takes batches (``submit_batch``), candidates with the same key are
    submitted together, at the place of the first of them (a worker builds what they share once)."""
    pending: list[Pending] = []
    queue = _batches(order, assignments, twins if hasattr(runner, "submit_batch") else None)
    while queue or pending:
        while queue and len(pending) < runner.slots and not late():
            batch = queue.pop(0)
            if len(batch) == 1:
                pending.append(runner.submit(batch[0], assignments[batch[0]], fastest()))
            else:
                pending.append(runner.submit_batch(batch, [assignments[i] for i in batch], fastest()))
            if not queue:
                drained()
        if not pending or late():
            break
        timeout = 0.05 if deadline is None else max(0.0, min(0.05, deadline - time.perf_counter()))
        for i, row in runner.wait(pending, timeout):
            pending = [p for p in pending if not p.holds(i)]
            store(i, row)
    if pending:
        for i, row in runner.wait(pending, 0.0):
            pending = [p for p in pending if not p.holds(i)]
            store(i, row)
    if pending:
        runner.cancel(pending)


def _batches(order: list[int], assignments: list[dict], twins: Callable[[dict], Hashable] | None) -> list[list[int]]:
    """``order`` in batches: the candidates of one ``twins`` key together, where the first of them is
    (each alone without ``twins``)."""
    if twins is None:
        return [[i] for i in order]
    by_key: dict[Hashable, list[int]] = {}
    for i in order:
        by_key.setdefault(twins(assignments[i]), []).append(i)
    return list(by_key.values())


CONNECT_TIMEOUT_S = 10.0  # how long a Ray address may take to accept a connection


def _check_reachable(address: str | None) -> None:
    """A ``host:port`` (or ``ray://host:port``) Ray address that does not accept a connection is
    refused at once (Ray itself keeps retrying for minutes)."""
    if not address or address == "auto":
        return
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return  # a form Ray reads itself
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise ConfigError(f"--ray {address}: cannot start or reach Ray: nothing answers there ({e})") from None


class RayRunner:
    """Candidates simulated as Ray tasks: on the cluster at ``address``, or on a local Ray
    instance (``address`` None: the one ``RAY_ADDRESS`` names, or a new one). The context, the
    cost model and the space go to Ray's object store once; each task builds and simulates one
    plan with :func:`planlab.explore.simulate_candidate`. Ray workers need planlab installed."""

    def __init__(self, address: str | None, task_fn: Callable, draw_fn: Callable, shared: tuple) -> None:
        try:
            import ray
        except ImportError:
            raise ConfigError("--ray needs Ray: pip install 'planlab[ray]'") from None
        self.ray = ray
        self.started = not ray.is_initialized()
        if self.started:
            _check_reachable(address)
            try:
                ray.init(address=address, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise ConfigError(f"--ray {address or ''}: cannot start or reach Ray: {e}".replace("  ", " ")) from None
        self.task, self.draw_task = ray.remote(task_fn), ray.remote(draw_fn)
        self.shared = tuple(ray.put(x) for x in shared)
        self.slots = 2 * max(1, int(ray.cluster_resources().get("CPU", 1)))

    def submit(self, i: int, values: dict, best_s: float = math.inf) -> Pending:
        return Pending(i, self.task.remote(*self.shared, i, values, best_s))

    def draw_async(self, values: dict):
        """A task drawing one row's timeline (:class:`Draws`)."""
        return self.draw_task.remote(*self.shared, values)

    def drawn(self, handle) -> Drawing:
        return self.ray.get(handle)

    def wait(self, pending: list[Pending], timeout_s: float) -> list[tuple[int, dict]]:
        refs = [p.handle for p in pending]
        ready, _ = self.ray.wait(refs, num_returns=1, timeout=timeout_s)
        if ready:
            ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0)
        return self.ray.get(ready)

    def cancel(self, pending: list[Pending]) -> None:
        for p in pending:
            self.ray.cancel(p.handle, force=True)

    def close(self) -> None:
        if self.started:
            self.ray.shutdown()
