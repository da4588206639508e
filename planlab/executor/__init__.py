"""The executor: runs a Program on torch.distributed, checks it against one process, measures
its timeline against the simulator's, reports failed ranks and writes sharded checkpoints."""

from planlab.executor.check import Reference, reference_run
from planlab.executor.failures import Fault, RankFailure, TaskError
from planlab.executor.interpreter import Interpreter
from planlab.executor.pieces import run_piece
from planlab.executor.run import RunConfig, RunResult, launch_local, worker
from planlab.executor.timeline import (
    compare,
    format_report,
    largest_misses,
    measured_events,
    predict,
    read_trace,
    task_table,
)

__all__ = [
    "Fault",
    "Interpreter",
    "RankFailure",
    "Reference",
    "RunConfig",
    "RunResult",
    "TaskError",
    "compare",
    "format_report",
    "largest_misses",
    "launch_local",
    "measured_events",
    "predict",
    "read_trace",
    "reference_run",
    "run_piece",
    "task_table",
    "worker",
]
