"""The text ``planlab run`` prints after a run (the launcher's process, or rank 0 when torchrun
or srun started the ranks): time and peak memory per rank against the simulator's prediction,
predicted against measured per task kind, and the numeric check."""

from __future__ import annotations

from planlab.executor.run import RunConfig, RunResult
from planlab.executor.timeline import Prediction, compare, format_report, measured_events

GIB = 2**30


def memory_lines(res: RunResult, pred: Prediction) -> list[str]:
    """Per rank: measured peak, its part above the process's start-up, the simulator's peak."""
    if not res.peak_mem_bytes:
        return []
    predicted = {d.device: d.peak_mem_bytes for d in pred.sim.devices}
    lines = [
        f"peak memory per rank ({res.mem_kind}; 'above start-up' leaves out what the process held before "
        "building its model; predicted: the simulator's peak for the device):"
    ]
    for r, (peak, base) in enumerate(zip(res.peak_mem_bytes, res.base_mem_bytes)):
        p = predicted.get(r)
        lines.append(
            f"  rank {r}: {peak / GIB:7.3f} GiB, {(peak - base) / GIB:7.3f} GiB above start-up; predicted "
            + (f"{p / GIB:7.3f} GiB" if p is not None else "-")
        )
    return lines


def run_report(
    plan, res: RunResult, pred: Prediction, cfg: RunConfig, *, loss_tol: float, grad_tol: float, launcher: str = ""
) -> tuple[str, bool]:
    """The report's text and whether the numeric check passed (True without a check);
    ``launcher`` names who started the ranks (torchrun, slurm) when not planlab itself."""
    sim = pred.sim
    timed = len(res.iter_times_s) - res.warmup
    by = f" started by {launcher}" if launcher else ""
    lines = [
        f"{plan.describe()} on {res.world_size} {res.backend} processes{by}, {cfg}"
        + (f", from the checkpoint {cfg.load_dir}" if cfg.load_dir else ""),
        f"measured iteration {res.measured_iter_s * 1e3:.2f} ms (mean of {timed} steps after {res.warmup} "
        f"warm-up), simulated {sim.iter_time_s * 1e3:.2f} ms (measured / simulated = "
        f"{res.measured_iter_s / sim.iter_time_s:.2f})",
    ]
    lines += memory_lines(res, pred)
    if res.timeline:
        lines.append(format_report(compare(pred.program, sim.events, measured_events(res.timeline))))
    if cfg.save_dir:
        lines.append(f"wrote a sharded checkpoint to {cfg.save_dir}")
    if not cfg.check:
        return "\n".join(lines), True
    lines.append("losses against one process:")
    for i, loss in enumerate(res.losses):
        norm = (
            f"; gradient norm {res.grad_norms[i]:.6g} (one process {res.ref_grad_norms[i]:.6g})"
            if res.grad_norms and i < len(res.ref_grad_norms)
            else ""
        )
        lines.append(f"  step {i}: loss {loss:.6f} (one process {res.ref_losses[i]:.6f}){norm}")
    ok = res.max_loss_error <= loss_tol and res.max_grad_error <= grad_tol
    lines.append(
        f"numeric check against one process: loss error {res.max_loss_error:.2e} (tolerance {loss_tol:g}), "
        f"gradient error {res.max_grad_error:.2e} (tolerance {grad_tol:g}): {'PASSED' if ok else 'FAILED'}"
    )
    return "\n".join(lines), ok
