"""Running a plan: the per-rank worker and the local launcher (torchrun's elastic launch).

Each rank builds only its own pieces of the model (:mod:`planlab.executor.shards`), runs
``steps`` iterations of its Program (the first ``warmup`` left out of the timing), on the
model's synthetic example inputs or on the user's batches (:mod:`planlab.executor.data`),
optionally clipping the global gradient norm across shards (:mod:`planlab.executor.clip`),
and measures its peak memory (:mod:`planlab.executor.memory`). With the numeric check,
rank 0 then runs the single-process reference and compares losses and first-step gradients.

Failures (see :mod:`planlab.executor.failures`): a rank that raises writes a report
into the run's directory and exits at once; the launcher stops the other ranks and
:func:`launch_local` raises one :class:`~planlab.errors.ExecutionError` naming the
failing rank, its step, action and task, and the error. Collectives and receives
time out after ``timeout_s`` (the process groups' timeout), and a watchdog ends a
rank that makes no progress for longer than that. Started by torchrun or srun instead
(:mod:`planlab.executor.as_rank`), a failing rank prints that line itself and exits.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record as record_errors

from planlab.errors import ConfigError
from planlab.executor.check import max_grad_error, reference_run
from planlab.executor.checkpoint import (
    check_checkpoint,
    check_save_dir,
    load_shards,
    param_specs,
    read_manifest,
    save_checkpoint,
    staging_dir,
)
from planlab.executor.data import load_batches
from planlab.executor.failures import (
    FAULT_ENV,
    Fault,
    Progress,
    TaskError,
    Watchdog,
    classify,
    diagnose,
    failure_message,
    fault_from_env,
    progress_path,
    write_report,
)
from planlab.executor.interpreter import Interpreter
from planlab.executor.launch_env import check_launch
from planlab.executor.memory import PeakMemory
from planlab.executor.shards import build_shards, check_memory
from planlab.graph.ir import Graph
from planlab.models.init import build_skeleton
from planlab.plan.materialize import materialize, trace_plan_model
from planlab.plan.plan import Plan
from planlab.plan.plan_file import plan_from_json, plan_to_json
from planlab.plan.program import Program

CHECK_WAIT_S = 3600.0  # ranks wait this long (at least) for rank 0's single-process reference


@dataclass(frozen=True)
class RunConfig:
    """How to run a plan: ``steps`` iterations, the first ``warmup`` not timed; Adam's ``lr``;
    the numeric ``check`` against one process; weights drawn from ``seed``; the last step's
    task timeline ``record``-ed; collectives time out after ``timeout_s``; checkpoints to
    ``save_dir`` / from ``load_dir``; ``data`` (a ``torch.save`` file or
    ``package.module:function``, see :mod:`planlab.executor.data`; None: synthetic); the
    global gradient norm clipped to ``clip_grad_norm``; ``device`` the ranks run on (``cpu``
    or ``cuda``, as :func:`~planlab.executor.launch_env.check_launch` chose); ``log``: rank 0
    prints every step's loss."""

    steps: int = 1
    warmup: int = 0
    lr: float = 1e-3
    check: bool = True
    seed: int = 0
    record: bool = False
    timeout_s: float = 300.0
    save_dir: str | None = None
    load_dir: str | None = None
    data: str | None = None
    clip_grad_norm: float | None = None
    device: str = "cpu"
    log: bool = False

    def __str__(self) -> str:
        extra = [
            f"{self.warmup} warm-up" if self.warmup else "",
            f"clip {self.clip_grad_norm:g}" if self.clip_grad_norm is not None else "",
            f"data {self.data}" if self.data else "",
        ]
        return f"{self.steps} steps" + "".join(f", {e}" for e in extra if e)

    def validate(self) -> None:
        """ConfigError naming the first value out of range."""
        if self.steps < 1:
            raise ConfigError(f"steps must be at least 1, got {self.steps}")
        if not 0 <= self.warmup < self.steps:
            raise ConfigError(
                f"warm-up steps must be at least 0 and fewer than the {self.steps} steps, got {self.warmup}"
            )
        if not self.timeout_s > 0:
            raise ConfigError(f"timeout_s must be a positive number of seconds, got {self.timeout_s}")
        if self.clip_grad_norm is not None and not (self.clip_grad_norm > 0 and math.isfinite(self.clip_grad_norm)):
            raise ConfigError(f"the gradient norm to clip to must be a positive number, got {self.clip_grad_norm}")
        if self.load_dir is not None and self.check:
            raise ConfigError(
                "the numeric check runs one process from the seed; pass check=False to start "
                f"from the checkpoint {self.load_dir}"
            )


@dataclass
class RunResult:
    """What one run measured. ``losses`` are per step; ``iter_times_s`` per step
    as seen by rank 0 (the slowest rank's time, after a barrier); ``timeline`` (with
    ``record``) every rank's task timings of the last step, as dicts of
    :class:`~planlab.executor.interpreter.TaskTiming`; ``peak_mem_bytes`` and
    ``base_mem_bytes`` per rank (``mem_kind``: RSS or CUDA allocated; the base is what the
    process held before building its model); ``grad_norms`` per step with clipping."""

    losses: list[float]
    iter_times_s: list[float]
    ref_losses: list[float] = field(default_factory=list)
    max_grad_error: float = float("nan")
    max_loss_error: float = float("nan")
    world_size: int = 1
    backend: str = "gloo"
    timeline: list = field(default_factory=list)
    warmup: int = 0
    peak_mem_bytes: list[int] = field(default_factory=list)
    base_mem_bytes: list[int] = field(default_factory=list)
    mem_kind: str = "RSS"
    grad_norms: list[float] = field(default_factory=list)
    ref_grad_norms: list[float] = field(default_factory=list)

    @property
    def measured_iter_s(self) -> float:
        """Mean iteration time of the steps after the warm-up."""
        t = self.iter_times_s[self.warmup :] or self.iter_times_s
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
def worker(
    plan_json: str,
    cfg: RunConfig,
    run_dir: str | None = None,
    *,
    exit_on_failure: bool = False,
    setup: tuple | None = None,
) -> dict:
    """Entry point of one rank: join the process group, build this rank's pieces, run
    ``cfg.steps`` iterations, check numerics; returns :class:`RunResult` as a dict (rank 0's
    holds every rank's timeline and memory, and the check).

    With ``run_dir`` (set by :func:`launch_local`), a failure is written there as a report and
    the process exits at once with status 1; with ``exit_on_failure`` (a rank started by
    torchrun or srun) the rank prints the failure on one line and exits; otherwise the
    exception propagates. ``setup`` is ``(graph, program)`` when the caller made them.
    """
    rank = int(os.environ.get("RANK", "0"))
    progress = Progress(progress_path(run_dir, rank) if run_dir else None)
    progress.phase("start-up", armed=False)
    waiting: list[str] = [""]  # the group or peer the current phase waits on, for the report
    timeout_s = cfg.timeout_s

    def phase(text: str, on: str = "", armed: bool = True) -> None:
        progress.phase(text, armed=armed)
        waiting[0] = on

    def on_hang(seconds: float, where: str) -> None:
        error = f"no progress for {seconds:.0f} s (timeout {timeout_s:g} s)"
        if run_dir:
            write_report(run_dir, rank, cause="timeout", where=where, error=error, waited_on=waiting[0])
        else:
            report = dict(rank=rank, cause="timeout", where=where, error=error, waited_on=waiting[0])
            print(f"planlab: error: {failure_message(report)}", file=sys.stderr, flush=True)
        os._exit(3)

    watchdog = Watchdog(progress, watchdog_limit_s(timeout_s), on_hang)
    backend = "nccl" if cfg.device == "cuda" else "gloo"
    try:
        fault = fault_from_env(rank)
        device = _join(backend, timeout_s)
        watchdog.start()
        rank = dist.get_rank()
        ready = _set_up(plan_json, cfg, setup, device, phase, progress, fault)
        losses, times, norms = _train(ready, cfg, device, phase)
        res = _finish(ready, cfg, phase, losses, times, norms)
        phase("end", armed=False)
        watchdog.stop()
        dist.destroy_process_group()
        return asdict(res)
    except BaseException as e:
        if run_dir is None and not exit_on_failure:
            watchdog.stop()
            if dist.is_initialized():
                dist.destroy_process_group()
            raise
        _report_and_exit(run_dir, rank, progress, waiting[0], e)
        raise  # not reached


def _join(backend: str, timeout_s: float) -> torch.device:
    """Join the process group (``backend``: gloo or nccl); this rank's torch device."""
    if backend == "gloo":
        torch.set_num_threads(1)  # one process stands for one device: one core each, as the cpu spec assumes
        keep_freed_memory()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}") if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    return device


@dataclass(frozen=True)
class _Rank:
    """What a rank has made before its first step: the plan, graph and Program, its interpreter,
    the control group (None: the default group; gloo beside NCCL), the numeric check's group,
    its memory meter, the steps a loaded checkpoint had trained and the batches (None: the
    model's example inputs)."""

    plan: Plan
    graph: Graph
    program: Program
    interp: Interpreter
    ctl: Any
    slow: Any
    memory: PeakMemory
    loaded_steps: int
    batches: list | None


def _set_up(plan_json: str, cfg: RunConfig, setup, device: torch.device, phase, progress, fault) -> _Rank:
    """Trace and materialize (unless ``setup`` has them), make the process groups, build this
    rank's pieces and its interpreter, load the checkpoint and the batches."""
    timeout_s = cfg.timeout_s
    rank, world = dist.get_rank(), dist.get_world_size()
    everyone = f"group {list(range(world))}"
    plan = plan_from_json(plan_json)
    if world != plan.num_devices:
        raise ConfigError(f"the plan is for {plan.num_devices} devices; this launch has {world} processes")
    phase("setup: trace, materialize", armed=False)
    graph, program = setup if setup is not None else (trace_plan_model(plan), None)
    program = program if program is not None else materialize(plan, graph)
    phase("setup: creating process groups", everyone)
    groups = {g: dist.new_group(list(g), timeout=timedelta(seconds=timeout_s)) for g in program.groups}
    # control traffic (barriers, losses, timelines) on the CPU: the default group, or gloo beside NCCL
    nccl = device.type == "cuda"
    ctl = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)) if nccl else None
    slow = (
        dist.new_group(backend="gloo", timeout=timedelta(seconds=max(timeout_s, CHECK_WAIT_S))) if cfg.check else None
    )
    phase("setup: building this rank's pieces", armed=False)
    memory = PeakMemory(device)
    memory.reset()  # from here: the model's pieces, its training and nothing of the set-up
    skeleton, inputs = build_skeleton(plan.model, batch=plan.global_batch, seed=cfg.seed)
    shards = build_shards(program, rank, skeleton, seed=cfg.seed, empty=bool(cfg.load_dir))
    interp = Interpreter(
        program,
        graph,
        rank,
        skeleton,
        inputs,
        groups,
        lr=cfg.lr,
        torch_device=device,
        progress=progress,
        fault=fault,
        shards=shards,
        clip_grad_norm=cfg.clip_grad_norm,
        seed=cfg.seed,
    )
    del shards
    loaded_steps = 0
    if cfg.load_dir:
        phase("setup: loading the checkpoint", armed=False)
        loaded_steps = load_shards(interp, cfg.load_dir, plan.model.to_json())
        interp.first_step = loaded_steps  # random operators go on drawing the steps after the checkpoint's
    # a resumed run goes on with the batch after the last one the checkpoint's steps trained on
    batches = (
        load_batches(cfg.data, example=inputs, global_batch=plan.global_batch, steps=loaded_steps + cfg.steps)
        if cfg.data
        else None
    )
    return _Rank(plan, graph, program, interp, ctl, slow, memory, loaded_steps, batches)


def _train(r: _Rank, cfg: RunConfig, device: torch.device, phase) -> tuple[list, list, list]:
    """Run ``cfg.steps`` iterations between barriers: the losses (summed over ranks), the times
    and the gradient norms."""
    interp, ctl = r.interp, r.ctl
    rank, everyone = dist.get_rank(), f"group {list(range(dist.get_world_size()))}"
    losses, times, norms = [], [], []
    for step in range(cfg.steps):
        interp.record = cfg.record and step == cfg.steps - 1  # the last step's timeline only
        if r.batches:
            interp.set_inputs(r.batches[(r.loaded_steps + step) % len(r.batches)])
        phase(f"step {step}, barrier before the step", everyone)
        dist.barrier(group=ctl)
        t0 = time.perf_counter()
        local = interp.run_iteration(capture_grads=cfg.check and step == 0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        phase(f"step {step}, barrier after the step", everyone)
        dist.barrier(group=ctl)
        times.append(time.perf_counter() - t0)
        phase(f"step {step}, loss all-reduce", everyone)
        total = torch.tensor([local], dtype=torch.float64)
        dist.all_reduce(total, group=ctl)
        losses.append(float(total))
        norms.append(interp.grad_norm)
        if cfg.log and rank == 0:
            print(
                f"step {step}: loss {losses[-1]:.6f}"
                + (f", gradient norm {norms[-1]:.4g}" if cfg.clip_grad_norm is not None else "")
                + f", {times[-1] * 1e3:.1f} ms"
                + (" (warm-up)" if step < cfg.warmup else ""),
                flush=True,
            )
    return losses, times, norms


def _finish(r: _Rank, cfg: RunConfig, phase, losses: list, times: list, norms: list) -> RunResult:
    """Gather the timelines and peak memory on rank 0, check the numerics, save the checkpoint."""
    interp, plan = r.interp, r.plan
    rank, world = dist.get_rank(), dist.get_world_size()
    everyone = f"group {list(range(world))}"
    peak = r.memory.peak()
    phase("end: timelines and memory", everyone)
    parts: list | None = [None] * world if rank == 0 else None
    mine = ([asdict(t) for t in interp.timeline] if cfg.record else [], peak, r.memory.base)
    dist.gather_object(mine, parts, dst=0, group=r.ctl)
    res = RunResult(
        losses,
        times,
        world_size=world,
        backend="nccl" if r.memory.device.type == "cuda" else "gloo",
        warmup=cfg.warmup,
        mem_kind=r.memory.kind,
        grad_norms=norms if cfg.clip_grad_norm is not None else [],
    )
    if parts:
        res.timeline = [t for p in parts for t in p[0]]
        res.peak_mem_bytes, res.base_mem_bytes = [p[1] for p in parts], [p[2] for p in parts]
    if cfg.check:
        phase("end: numeric check (rank 0 runs one process)", armed=False)
        _check(res, interp, r.program, plan, cfg, r.batches, r.slow)
    if cfg.save_dir:
        phase("end: saving the checkpoint", everyone)
        save_checkpoint(
            interp,
            cfg.save_dir,
            rank=rank,
            world_size=world,
            group=r.ctl,
            model_json=plan.model.to_json(),
            steps=r.loaded_steps + cfg.steps,
            params=param_specs(r.graph),
            saved_by=plan.describe(),
        )
    return res


def _check(res: RunResult, interp: Interpreter, program, plan, cfg: RunConfig, batches, group) -> None:
    """Rank 0 runs the single-process reference and compares; the other ranks send it their
    first-step gradients one at a time (so rank 0 holds one rank's at once)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    grads = {p: g.cpu() for p, g in interp.captured_grads.items()}  # the reference runs on the CPU
    if rank != 0:
        dist.send_object_list([grads], dst=0, group=group)
        return
    ref = reference_run(
        plan.model,
        global_batch=plan.global_batch,
        steps=cfg.steps,
        lr=cfg.lr,
        seed=cfg.seed,
        batches=batches,
        clip_grad_norm=cfg.clip_grad_norm,
        graph=interp.graph,
    )
    err = max_grad_error(grads, dict(program.devices[0].params), ref)
    for r in range(1, world):
        got: list = [None]
        dist.recv_object_list(got, src=r, group=group)
        err = max(err, max_grad_error(got[0], dict(program.devices[r].params), ref))
    res.ref_losses, res.ref_grad_norms = list(ref.losses), list(ref.grad_norms)
    res.max_grad_error = err
    res.max_loss_error = max(abs(a - b) for a, b in zip(res.losses, ref.losses))


def _report_and_exit(run_dir: str | None, rank: int, progress: Progress, waiting: str, e: BaseException) -> None:
    """Write rank ``rank``'s failure report and end the process without tearing anything down
    (a teardown could wait on the peers that are failing too)."""
    cause = e.cause if isinstance(e, TaskError) else e
    waited_on = e.waited_on if isinstance(e, TaskError) else waiting
    text = re.sub(r"^\[[^\]]*:\d+\] ", "", " ".join(str(cause).split()))  # gloo's [file.cc:line] prefix
    error = f"{type(cause).__name__}: {text[:300]}{'...' if len(text) > 300 else ''}"
    kind = classify(cause)
    try:
        if run_dir is None:  # started by torchrun or srun: say it here, once per failing rank
            if isinstance(cause, ConfigError):
                print(f"planlab: error: {cause}", file=sys.stderr)
            elif kind == "peer":  # not the cause: one line that does not repeat the error
                on = f", waiting on {waited_on}" if waited_on else ""
                print(
                    f"planlab: rank {rank} stopped at {progress.where()}{on}: a peer failed or went away ({error})",
                    file=sys.stderr,
                )
            else:
                report = dict(rank=rank, cause=kind, where=progress.where(), error=error, waited_on=waited_on)
                print(f"planlab: error: {failure_message(report)}", file=sys.stderr)
        else:
            write_report(run_dir, rank, cause=kind, where=progress.where(), error=error, waited_on=waited_on)
        if kind == "peer":  # linger, so that the launcher sees the peer that failed first exit first
            time.sleep(PEER_LINGER_S)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _str(path: str | os.PathLike | None) -> str | None:
    return None if path is None else os.fspath(path)


def local_launch(nproc: int, run_id: str, run_dir: str):
    """torch's elastic ``LaunchConfig`` for ``nproc`` processes on this machine: one node, a c10d
    rendezvous on a free local port, no restart, the launcher's logs in ``run_dir``."""
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=0,
        monitor_interval=0.05,
        run_id=run_id,
        logs_specs=launcher_logs(run_dir),
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the rendezvous takes it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def quiet_launcher() -> Iterator[None]:
    """Silence torchelastic's own failure logs: :func:`launch_local` reports a failure once."""
    prefixes = ("torch.distributed.elastic", "torch.multiprocessing")
    names = [n for n in logging.Logger.manager.loggerDict if n.startswith(prefixes)]  # each sets its own level
    loggers = [logging.getLogger(n) for n in dict.fromkeys([*prefixes, *names])]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


def launch_local(
    plan,
    nproc: int,
    *,
    steps: int = 1,
    lr: float = 1e-3,
    check: bool = True,
    seed: int = 0,
    record: bool = False,
    timeout_s: float = 300.0,
    run_id: str | None = None,
    save_dir: str | os.PathLike | None = None,
    load_dir: str | os.PathLike | None = None,
    warmup: int = 0,
    data: str | os.PathLike | None = None,
    clip_grad_norm: float | None = None,
    allow_device_mismatch: bool = False,
    log: bool = False,
) -> RunResult:
    """Run ``plan`` on ``nproc`` local processes with torchrun's launcher; rank 0's result.

    The launch is refused (ConfigError) before any process starts when ``nproc`` is not the
    plan's device count, when the plan is for GPUs and this machine has too few (unless
    ``allow_device_mismatch``: then CPU processes check its numerics), or when the ranks'
    pieces (and the numeric check's reference) do not fit this machine's memory. A failed rank
    ends the run within about a second (a hang: within ``timeout_s``) with
    :class:`~planlab.executor.failures.RankFailure` (an ExecutionError) naming the failing
    rank, its task and the error. ``load_dir`` starts from a checkpoint (any plan of the same
    model; ``check`` must then be False, as the check starts from the seed), ``save_dir``
    writes one after the last step. See :class:`RunConfig` for the rest.
    """
    if nproc != plan.num_devices:
        raise ConfigError(f"--nproc {nproc} differs from the plan's {plan.num_devices} devices")
    cfg = RunConfig(
        steps=steps,
        warmup=warmup,
        lr=lr,
        check=check,
        seed=seed,
        record=record,
        timeout_s=timeout_s,
        save_dir=_str(save_dir),
        load_dir=_str(load_dir),
        data=_str(data),
        clip_grad_norm=clip_grad_norm,
        log=log,
    )
    cfg = check_local_launch(plan, nproc, cfg, allow_device_mismatch=allow_device_mismatch)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    run_id = run_id or f"planlab-{os.getpid()}-{time.time_ns()}"
    run_dir = tempfile.mkdtemp(prefix=f"{run_id}-")
    launch = local_launch(nproc, run_id, run_dir)
    try:
        with quiet_launcher():
            out = elastic_launch(launch, worker)(plan_to_json(plan), cfg, run_dir)
    except ChildFailedError as e:
        if save_dir is not None:  # a failed save leaves nothing half-written
            shutil.rmtree(staging_dir(save_dir), ignore_errors=True)
        raise diagnose(run_dir, {r: f.exitcode for r, f in e.failures.items()}, nproc) from None
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return RunResult(**out[0])


def check_local_launch(plan, nproc: int, cfg: RunConfig, *, allow_device_mismatch: bool = False) -> RunConfig:
    """Refuse (ConfigError and the like) a launch of ``plan`` on ``nproc`` local processes before any
    starts: ``cfg`` out of range, a device mismatch, a wrong checkpoint, a malformed fault, pieces
    that do not fit (:func:`prepare`). Returns ``cfg`` with the device the ranks use. Shared by
    :func:`launch_local` and :class:`planlab.executor.pool.RankPool`."""
    cfg.validate()
    cfg = replace(
        cfg, device=check_launch(plan, nproc, cuda_devices=nproc, allow_device_mismatch=allow_device_mismatch)
    )
    if cfg.load_dir is not None:
        read_manifest(cfg.load_dir, plan.model.to_json())  # a wrong folder or model fails here
    if os.environ.get(FAULT_ENV, "").strip():
        Fault.parse(os.environ[FAULT_ENV])  # a malformed fault fails here, not in every rank
    prepare(plan, cfg, range(nproc))
    return cfg


def launcher_logs(run_dir: str):
    """torch elastic's per-launch log folder, inside ``run_dir`` (which the caller removes):
    left to itself the launcher makes a ``/tmp/torchelastic_*`` folder per launch and never
    removes it."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    return DefaultLogsSpecs(log_dir=os.path.join(run_dir, "launcher"))


def prepare(plan, cfg: RunConfig, ranks, *, reference_here: bool = True) -> tuple:
    """Checks made before any model is built, for the ``ranks`` on this machine: the user's data
    matches the model's inputs, the ranks' pieces (and, with the check and
    ``reference_here``, rank 0's single-process reference) fit its memory, the checkpoint to
    load is whole and of this model, the folder to save to can take one. Returns
    ``(graph, program)``."""
    graph = trace_plan_model(plan)
    program = materialize(plan, graph)
    if cfg.data:
        _, inputs = build_skeleton(plan.model, batch=plan.global_batch, seed=cfg.seed)
        load_batches(cfg.data, example=inputs, global_batch=plan.global_batch, steps=cfg.steps)
    check_memory(
        plan, program, ranks, device=cfg.device, num_params=graph.num_params, reference=cfg.check and reference_here
    )
    if cfg.load_dir:  # a partial, damaged or foreign checkpoint fails here, naming the file and tensor
        check_checkpoint(cfg.load_dir, param_specs(graph), plan.model.to_json())
    if cfg.save_dir:
        check_save_dir(cfg.save_dir)
    return graph, program
