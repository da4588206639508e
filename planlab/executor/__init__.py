"""The executor: runs a Program on torch.distributed and checks it against one process."""

from planlab.executor.check import Reference, reference_run
from planlab.executor.interpreter import Interpreter, run_piece
from planlab.executor.run import RunResult, launch_local, worker

__all__ = ["Interpreter", "Reference", "RunResult", "launch_local", "reference_run", "run_piece", "worker"]
