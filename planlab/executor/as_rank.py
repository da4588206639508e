"""``planlab run PLAN.json`` started by a launcher: this process is one rank.

``torchrun --nnodes N --nproc-per-node G -m planlab.cli run PLAN.json`` (or ``torchrun
--no-python planlab run ...``) and ``srun ... planlab run PLAN.json`` start every rank
themselves (:mod:`planlab.executor.launch_env` reads which rank this is). Each rank refuses a
launch that does not fit the plan before it builds anything (the world size is in its
environment before it joins the group; the device kind; the memory of the ranks on its
node), runs the same worker as the local launcher's processes, and rank 0 prints the report
once. A failing rank prints its failure on one line and exits; torchrun stops the others on
its node, and ranks elsewhere fail at their next collective with the failed peer (or time
out after ``--timeout``).
"""

from __future__ import annotations

import os
from dataclasses import replace

from planlab.executor.checkpoint import read_manifest
from planlab.executor.failures import FAULT_ENV, Fault
from planlab.executor.launch_env import RankEnv, check_launch
from planlab.executor.report import run_report
from planlab.executor.run import RunConfig, RunResult, prepare, worker
from planlab.plan.plan_file import plan_to_json


def run_as_rank(
    plan,
    cfg: RunConfig,
    env: RankEnv,
    *,
    loss_tol: float,
    grad_tol: float,
    allow_device_mismatch: bool = False,
    profile: str | None = None,
    trace: str | None = None,
    predicted_trace: str | None = None,
) -> int:
    """Run this process as rank ``env.rank`` of ``plan``; rank 0 prints the report and writes
    the traces. Returns the exit status: 1 when rank 0's numeric check failed, else 0."""
    from planlab.costmodel import CostModel
    from planlab.executor.timeline import measured_events, predict, write_trace

    cfg.validate()
    device = check_launch(
        plan,
        env.world_size,
        cuda_devices=env.local_world_size,
        allow_device_mismatch=allow_device_mismatch,
        what=f"processes ({env.source})",
    )
    cfg = replace(cfg, device=device)
    if cfg.load_dir is not None:
        read_manifest(cfg.load_dir, plan.model.to_json())
    if os.environ.get(FAULT_ENV, "").strip():
        Fault.parse(os.environ[FAULT_ENV])
    if env.rank == 0:
        CostModel.load(plan.cluster, plan.nodes, profile=profile)  # a bad profile fails before the run
    setup = prepare(plan, cfg, env.local_ranks(), reference_here=0 in env.local_ranks())
    env.export()
    res = RunResult(**worker(plan_to_json(plan), cfg, None, exit_on_failure=True, setup=setup))
    if env.rank != 0:
        return 0
    pred = predict(plan, profile=profile)
    text, ok = run_report(plan, res, pred, cfg, loss_tol=loss_tol, grad_tol=grad_tol, launcher=env.source)
    print(text, flush=True)
    if trace:
        write_trace(trace, measured_events(res.timeline))
        print(f"wrote the measured trace of the last step (every rank) to {trace}")
    if predicted_trace:
        pred.sim.write_trace(predicted_trace)
        print(f"wrote the simulated trace (every device) to {predicted_trace}")
    return 0 if ok else 1
