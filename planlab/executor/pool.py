"""Ranks started once that run plan after plan: for runs of many small plans (the random-plan fuzz),
where starting the processes (importing torch and planlab: 2.5 s of CPU each) costs more than a
plan's steps.

A :class:`RankPool` of ``world_size`` ranks is spawned with ``torch.multiprocessing`` at its first
plan. Each plan goes to every rank as picklable data (the plan's JSON, the :class:`RunConfig`, a
folder for failure reports and a free port); each rank traces the model itself and runs the same
:func:`~planlab.executor.run.worker` that :func:`~planlab.executor.run.launch_local`'s processes
run (``planlab run``'s path), after the same checks (:func:`~planlab.executor.run.check_local_launch`).

Every plan gets a fresh process group on a fresh port: the worker joins one and destroys it at its
end, as under ``planlab run``, so no communicator, group count or half-finished collective of one
plan reaches the next; the rendezvous costs milliseconds. A rank that fails writes its report and
exits (as under ``planlab run``); a rank that makes no progress is ended by its watchdog; a plan
with no result after ``plan_timeout_s`` has its ranks killed. Any of these ends the plan with the
:class:`~planlab.errors.RankFailure` that ``launch_local`` would raise, and the pool starts again at
the next plan.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from multiprocessing.connection import wait

from planlab.errors import ConfigError, RankFailure
from planlab.executor.failures import diagnose
from planlab.executor.run import PEER_LINGER_S, RunConfig, RunResult, check_local_launch, free_port, worker
from planlab.plan.plan_file import plan_to_json

PEER_GRACE_S = PEER_LINGER_S + 5.0  # after a rank exits, the others this long to report and exit


def serve(rank: int, world_size: int, conn) -> None:
    """A pool rank's loop: receive ``(plan_json, cfg, run_dir, port)``, run the worker, send rank 0's
    result (other ranks send an empty dict); None or a closed pipe ends it."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
    )
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        plan_json, cfg, run_dir, port = task
        os.environ["MASTER_PORT"] = str(port)
        out = worker(plan_json, cfg, run_dir)  # a failure writes its report into run_dir and exits
        conn.send(out if rank == 0 else {})


class RankPool:
    """``world_size`` local ranks (spawned at the first plan) that run plan after plan; see the module
    docstring. Use as a context manager, or call :meth:`close`."""

    def __init__(self, world_size: int, *, plan_timeout_s: float = 900.0) -> None:
        if world_size < 1:
            raise ConfigError(f"a pool needs at least 1 rank, got {world_size}")
        self.world_size, self.plan_timeout_s = world_size, plan_timeout_s
        self.procs: list = []
        self.conns: list = []
        self.starts = 0  # how many times the ranks were started

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        """Spawn the ranks (they import torch and planlab, then wait for plans)."""
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=serve, args=(rank, self.world_size, child), daemon=True, name=f"planlab-rank{rank}")
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        self.starts += 1

    def close(self) -> None:
        """End the ranks: ask them to stop, then kill those that do not within a few seconds."""
        for c in self.conns:
            try:
                c.send(None)
            except OSError:
                pass
        self._end(grace_s=5.0)

    def _end(self, grace_s: float) -> dict[int, int]:
        """Wait up to ``grace_s`` for the ranks to exit and kill the rest; the exit codes of those that
        exited by themselves."""
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        codes = {r: p.exitcode for r, p in enumerate(self.procs) if not p.is_alive()}
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()
        for c in self.conns:
            c.close()
        self.procs, self.conns = [], []
        return codes

    def cpu_s(self) -> float:
        """CPU seconds of the running ranks so far (from /proc; 0 where there is none). Ranks that
        ended count in ``resource.getrusage(RUSAGE_CHILDREN)`` instead."""
        tick = os.sysconf("SC_CLK_TCK")
        total = 0.0
        for p in self.procs:
            try:
                fields = open(f"/proc/{p.pid}/stat").read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime (proc(5), from field 3)
        return total

    def run(self, plan, cfg: RunConfig) -> RunResult:
        """Run ``plan`` on the pool's ranks (checked first as :func:`launch_local` checks it); rank 0's
        result. A failed, hung or dead rank raises :class:`RankFailure` and restarts the pool."""
        cfg = check_local_launch(plan, self.world_size, cfg)
        if not self.procs:
            self.start()
        run_dir = tempfile.mkdtemp(prefix=f"planlab-pool-{os.getpid()}-")
        try:
            task = (plan_to_json(plan), cfg, run_dir, free_port())
            for c in self.conns:
                c.send(task)
            return self._collect(run_dir)
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)

    def _collect(self, run_dir: str) -> RunResult:
        """Every rank's answer, or the failure: once a rank exits (its report in ``run_dir``) the others
        have ``PEER_GRACE_S`` to exit with theirs; no answer within the plan timeout kills them all."""
        pending = dict(enumerate(self.conns))
        out: dict = {}
        deadline = time.monotonic() + self.plan_timeout_s
        while pending:
            ready = wait(list(pending.values()), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self._end(grace_s=0.0)
                raise RankFailure(
                    f"ranks {sorted(pending)} gave no result within {self.plan_timeout_s:g} s; they were killed",
                    rank=min(pending),
                    where="",
                    error="",
                    cause="timeout",
                )
            for r, c in list(pending.items()):
                if c not in ready:
                    continue
                try:
                    out[r] = c.recv()
                except (EOFError, OSError):  # the rank exited: its failure
                    codes = self._end(grace_s=PEER_GRACE_S)
                    raise diagnose(run_dir, {k: v for k, v in codes.items() if v != 0}, self.world_size) from None
                del pending[r]
        return RunResult(**out[0])
