"""Running a plan: the per-rank worker and the local launcher (torchrun's elastic launch)."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from torch.distributed.elastic.multiprocessing.errors import record

from planlab.errors import ConfigError, ExecutionError
from planlab.executor.check import max_grad_error, reference_run
from planlab.executor.interpreter import Interpreter
from planlab.models.registry import build_model
from planlab.plan.materialize import materialize, trace_plan_model
from planlab.plan.plan_file import plan_from_json, plan_to_json


@dataclass
class RunResult:
    """What one run measured. ``losses`` are per step; ``iter_times_s`` per step
    as seen by rank 0 (the slowest rank's time, after a barrier)."""

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


@record
def worker(plan_json: str, steps: int, lr: float, check: bool, seed: int, record: bool = False) -> dict:
    """Entry point of one rank: join the process group, run ``steps`` iterations, check numerics."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "gloo":
        torch.set_num_threads(1)  # one process stands for one device: one core each, as the cpu spec assumes
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}") if backend == "nccl" \
            else torch.device("cpu")
        plan = plan_from_json(plan_json)
        if world != plan.num_devices:
            raise ConfigError(f"the plan is for {plan.num_devices} devices; this launch has {world} processes")
        graph = trace_plan_model(plan)
        program = materialize(plan, graph)
        groups = {g: dist.new_group(list(g)) for g in program.groups}
        module, inputs = build_model(plan.model, batch=plan.global_batch, device="cpu", seed=seed)
        interp = Interpreter(program, graph, rank, module, inputs, groups, lr=lr, torch_device=device,
                             record=record)
        del module
        losses, times = [], []
        grad_err = 0.0
        ref = reference_run(plan.model, global_batch=plan.global_batch, steps=steps, lr=lr, seed=seed) \
            if check else None
        for step in range(steps):
            dist.barrier()
            t0 = time.perf_counter()
            local = interp.run_iteration(capture_grads=check and step == 0)
            dist.barrier()
            times.append(time.perf_counter() - t0)
            total = torch.tensor([local], dtype=torch.float64)
            dist.all_reduce(total)
            losses.append(float(total))
            if check and step == 0:
                boxes = dict(program.devices[rank].params)
                grad_err = max_grad_error(interp.captured_grads, boxes, ref)
        err = torch.tensor([grad_err], dtype=torch.float64)
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        res = RunResult(losses, times, list(ref.losses) if ref else [], float(err),
                        max(abs(a - b) for a, b in zip(losses, ref.losses)) if ref else float("nan"),
                        world, backend, [asdict(t) for t in interp.timeline])
        return asdict(res)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local(plan, nproc: int, *, steps: int = 1, lr: float = 1e-3, check: bool = True, seed: int = 0,
                 record: bool = False) -> RunResult:
    """Run ``plan`` on ``nproc`` local processes with torchrun's launcher; rank 0's result."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if nproc != plan.num_devices:
        raise ConfigError(f"--nproc {nproc} differs from the plan's {plan.num_devices} devices")
    cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, rdzv_backend="c10d",
                       rdzv_endpoint=f"127.0.0.1:{_free_port()}", max_restarts=0, monitor_interval=0.05,
                       run_id=f"planlab-{os.getpid()}-{time.time_ns()}")
    try:
        out = elastic_launch(cfg, worker)(plan_to_json(plan), steps, lr, check, seed, record)
    except ChildFailedError as e:
        first = next(iter(e.failures.values()))
        msg = first.message if isinstance(first.message, str) else str(first.message)
        raise ExecutionError(f"rank {first.local_rank} failed: {msg.strip().splitlines()[-1] if msg else e}") from None
    res = out[0]
    return RunResult(**res)
