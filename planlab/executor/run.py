"""Running a plan: the per-rank worker and the local launcher (torchrun's elastic launch).

Failures (see :mod:`planlab.executor.failures`): a rank that raises writes a report
into the run's directory and exits at once; the launcher stops the other ranks and
:func:`launch_local` raises one :class:`~planlab.errors.ExecutionError` naming the
failing rank, its step, action and task, and the error. Collectives and receives
time out after ``timeout_s`` (the process groups' timeout), and a watchdog ends a
rank that makes no progress for longer than that.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record as record_errors

from planlab.errors import ConfigError
from planlab.executor.check import max_grad_error, reference_run
from planlab.executor.checkpoint import load_shards, read_manifest, save_shards, write_manifest
from planlab.executor.failures import (FAULT_ENV, Fault, Progress, TaskError, Watchdog, classify, diagnose,
                                       fault_from_env, progress_path, write_report)
from planlab.executor.interpreter import Interpreter
from planlab.models.registry import build_model
from planlab.plan.materialize import materialize, trace_plan_model
from planlab.plan.plan_file import plan_from_json, plan_to_json


@dataclass
class RunResult:
    """What one run measured. ``losses`` are per step; ``iter_times_s`` per step
    as seen by rank 0 (the slowest rank's time, after a barrier); ``timeline`` (with
    ``record``) every rank's task timings of the last step, as dicts of
    :class:`~planlab.executor.interpreter.TaskTiming`."""

    losses: list[float]
    iter_times_s: list[float]
    ref_losses: list[float] = field(default_factory=list)
    max_grad_error: float = float("nan")
    max_loss_error: float = float("nan")
    world_size: int = 1
    backend: str = "gloo"
    timeline: list = field(default_factory=list)

    @property
    def measured_iter_s(self) -> float:
        """Mean iteration time, the first (warm-up) step excluded when there are more."""
        t = self.iter_times_s[1:] if len(self.iter_times_s) > 1 else self.iter_times_s
        return sum(t) / len(t)

    def passed(self, *, loss_tol: float, grad_tol: float) -> bool:
        return self.max_loss_error <= loss_tol and self.max_grad_error <= grad_tol


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory in the process instead of returning it to the
    system (trim and mmap thresholds at 1 GiB). A training step frees and allocates the same
    buffers every step; memory given back is paid again as page faults in the next step
    (thousands per step for a small GPT). True when set; False where the C library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)) and bool(libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30))
    except (OSError, AttributeError):
        return False


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
PEER_LINGER_S = 2.0  # a rank whose peer went away waits this long before exiting


def watchdog_limit_s(timeout_s: float) -> float:
    """No progress for this long ends a rank: the timeout plus a grace period, so that the
    process group's own timeout (which names the collective) fires first."""
    return timeout_s + max(5.0, 0.1 * timeout_s)


@record_errors
def worker(plan_json: str, steps: int, lr: float, check: bool, seed: int, record: bool = False,
           timeout_s: float = 300.0, run_dir: str | None = None, save_dir: str | None = None,
           load_dir: str | None = None) -> dict:
    """Entry point of one rank: join the process group, run ``steps`` iterations, check numerics.

    ``load_dir``/``save_dir`` name checkpoint folders to start from / to write after the last
    step (see :mod:`planlab.executor.checkpoint`). With ``run_dir`` (set by :func:`launch_local`),
    a failure is written there as a report and the process exits at once with status 1;
    without it the exception propagates.
    """
    rank = int(os.environ.get("RANK", "0"))
    progress = Progress(progress_path(run_dir, rank) if run_dir else None)
    progress.phase("start-up", armed=False)
    waiting: list[str] = [""]  # the group or peer the current phase waits on, for the report

    def phase(text: str, on: str = "", armed: bool = True) -> None:
        progress.phase(text, armed=armed)
        waiting[0] = on

    def on_hang(seconds: float, where: str) -> None:
        error = f"no progress for {seconds:.0f} s (timeout {timeout_s:g} s)"
        if run_dir:
            write_report(run_dir, rank, cause="timeout", where=where, error=error, waited_on=waiting[0])
        else:
            print(f"planlab: rank {rank} timed out at {where}: {error}", file=sys.stderr, flush=True)
        os._exit(3)

    watchdog = Watchdog(progress, watchdog_limit_s(timeout_s), on_hang)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    try:
        if backend == "gloo":
            torch.set_num_threads(1)  # one process stands for one device: one core each, as the cpu spec assumes
            keep_freed_memory()
        fault = fault_from_env(rank)
        if not dist.is_initialized():
            dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
        watchdog.start()
        rank, world = dist.get_rank(), dist.get_world_size()
        everyone = f"group {list(range(world))}"
        device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}") if backend == "nccl" \
            else torch.device("cpu")
        plan = plan_from_json(plan_json)
        if world != plan.num_devices:
            raise ConfigError(f"the plan is for {plan.num_devices} devices; this launch has {world} processes")
        phase("setup: trace, materialize, build", armed=False)
        graph = trace_plan_model(plan)
        program = materialize(plan, graph)
        phase("setup: creating process groups", everyone)
        groups = {g: dist.new_group(list(g), timeout=timedelta(seconds=timeout_s)) for g in program.groups}
        phase("setup: building the model shards", armed=False)
        module, inputs = build_model(plan.model, batch=plan.global_batch, device="cpu", seed=seed)
        interp = Interpreter(program, graph, rank, module, inputs, groups, lr=lr, torch_device=device,
                             progress=progress, fault=fault)
        del module
        if load_dir:
            phase("setup: loading the checkpoint", armed=False)
            load_shards(interp, load_dir, plan.model.to_json())
        losses, times = [], []
        grad_err = 0.0
        ref = reference_run(plan.model, global_batch=plan.global_batch, steps=steps, lr=lr, seed=seed) \
            if check else None
        for step in range(steps):
            interp.record = record and step == steps - 1  # the last step's timeline only
            phase(f"step {step}, barrier before the step", everyone)
            dist.barrier()
            t0 = time.perf_counter()
            local = interp.run_iteration(capture_grads=check and step == 0)
            phase(f"step {step}, barrier after the step", everyone)
            dist.barrier()
            times.append(time.perf_counter() - t0)
            phase(f"step {step}, loss all-reduce", everyone)
            total = torch.tensor([local], dtype=torch.float64)
            dist.all_reduce(total)
            losses.append(float(total))
            if check and step == 0:
                boxes = dict(program.devices[rank].params)
                grad_err = max_grad_error(interp.captured_grads, boxes, ref)
        phase("end: gradient check and timelines", everyone)
        err = torch.tensor([grad_err], dtype=torch.float64)
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        timeline: list[dict] = []
        if record:  # every rank's timings of the last step, gathered on rank 0
            parts: list | None = [None] * world if rank == 0 else None
            dist.gather_object([asdict(t) for t in interp.timeline], parts, dst=0)
            timeline = [t for p in parts for t in p] if parts else []
        if save_dir:
            phase("end: saving the checkpoint", everyone)
            save_shards(interp, save_dir, rank)
            dist.barrier()
            if rank == 0:
                done = read_manifest(load_dir)["steps"] if load_dir else 0
                write_manifest(save_dir, model_json=plan.model.to_json(), world_size=world, steps=done + steps)
            dist.barrier()
        res = RunResult(losses, times, list(ref.losses) if ref else [], float(err),
                        max(abs(a - b) for a, b in zip(losses, ref.losses)) if ref else float("nan"),
                        world, backend, timeline)
        phase("end", armed=False)
        watchdog.stop()
        dist.destroy_process_group()
        return asdict(res)
    except BaseException as e:
        if run_dir is None:
            watchdog.stop()
            if dist.is_initialized():
                dist.destroy_process_group()
            raise
        _report_and_exit(run_dir, rank, progress, waiting[0], e)
        raise  # not reached


def _report_and_exit(run_dir: str, rank: int, progress: Progress, waiting: str, e: BaseException) -> None:
    """Write rank ``rank``'s failure report and end the process without tearing anything down
    (a teardown could wait on the peers that are failing too)."""
    cause = e.cause if isinstance(e, TaskError) else e
    waited_on = e.waited_on if isinstance(e, TaskError) else waiting
    text = re.sub(r"^\[[^\]]*:\d+\] ", "", " ".join(str(cause).split()))  # gloo's [file.cc:line] prefix
    error = f"{type(cause).__name__}: {text[:300]}{'...' if len(text) > 300 else ''}"
    kind = classify(cause)
    try:
        write_report(run_dir, rank, cause=kind, where=progress.where(), error=error, waited_on=waited_on)
        if kind == "peer":  # linger, so that the launcher sees the peer that failed first exit first
            time.sleep(PEER_LINGER_S)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _str(path: str | os.PathLike | None) -> str | None:
    return None if path is None else os.fspath(path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _quiet_launcher() -> Iterator[None]:
    """Silence torchelastic's own failure logs: :func:`launch_local` reports a failure once."""
    loggers = [logging.getLogger(n) for n in ("torch.distributed.elastic", "torch.multiprocessing")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _check_host_memory(plan, nproc: int, check: bool) -> None:
    """Refuse a launch whose processes cannot all build the model here: every rank builds the
    whole model in fp32 today (4 bytes a parameter) and, for the check, a single-process
    reference with gradients and Adam states (16 more)."""
    graph = trace_plan_model(plan)
    per_rank = graph.num_params * (4 + (16 if check else 0))
    need, have = per_rank * nproc, _available_bytes()
    if have is not None and need > have:
        raise ConfigError(f"running {plan.model} on {nproc} local processes needs about {need / 2**30:.1f} GiB "
                          f"({graph.num_params / 1e9:.2f}B parameters built by every rank); this machine has "
                          f"{have / 2**30:.1f} GiB available. Run a smaller model or fewer processes.")


def launch_local(plan, nproc: int, *, steps: int = 1, lr: float = 1e-3, check: bool = True, seed: int = 0,
                 record: bool = False, timeout_s: float = 300.0, run_id: str | None = None,
                 save_dir: str | os.PathLike | None = None, load_dir: str | os.PathLike | None = None) -> RunResult:
    """Run ``plan`` on ``nproc`` local processes with torchrun's launcher; rank 0's result.

    The launch is refused (ConfigError) before any process starts when ``nproc`` is not the
    plan's device count. A failed rank ends the run within about a second (a hang: within
    ``timeout_s``) with :class:`~planlab.executor.failures.RankFailure` (an ExecutionError)
    naming the failing rank, its task and the error. ``load_dir`` starts from a checkpoint
    (any plan of the same model; ``check`` must then be False, as the check starts from the
    seed), ``save_dir`` writes one after the last step.
    """
    if nproc != plan.num_devices:
        raise ConfigError(f"--nproc {nproc} differs from the plan's {plan.num_devices} devices")
    if not timeout_s > 0:
        raise ConfigError(f"timeout_s must be a positive number of seconds, got {timeout_s}")
    if load_dir is not None:
        if check:
            raise ConfigError("the numeric check runs one process from the seed; pass check=False to start "
                              f"from the checkpoint {load_dir}")
        read_manifest(load_dir, plan.model.to_json())  # a wrong folder or model fails here
    if os.environ.get(FAULT_ENV, "").strip():
        Fault.parse(os.environ[FAULT_ENV])  # a malformed fault fails here, not in every rank
    _check_host_memory(plan, nproc, check)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    run_id = run_id or f"planlab-{os.getpid()}-{time.time_ns()}"
    cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, rdzv_backend="c10d",
                       rdzv_endpoint=f"127.0.0.1:{_free_port()}", max_restarts=0, monitor_interval=0.05,
                       run_id=run_id)
    run_dir = tempfile.mkdtemp(prefix=f"{run_id}-")
    try:
        with _quiet_launcher():
            out = elastic_launch(cfg, worker)(plan_to_json(plan), steps, lr, check, seed, record, timeout_s,
                                              run_dir, _str(save_dir), _str(load_dir))
    except ChildFailedError as e:
        raise diagnose(run_dir, {r: f.exitcode for r, f in e.failures.items()}, nproc) from None
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return RunResult(**out[0])
