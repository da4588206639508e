"""planlab's exception hierarchy.

Every error a user can cause is a :class:`PlanlabError`; its message names the
offending value and what was expected, so the CLI prints it on one line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from planlab.plan.program import Task


class PlanlabError(Exception):
    """Base class of every error planlab raises on bad input."""


class ConfigError(PlanlabError):
    """An unknown name (model, cluster, space, knob) or a value out of range."""


class GraphError(PlanlabError):
    """A module could not be traced, or an operator signature is malformed."""


class InfeasiblePlan(PlanlabError):
    """A plan that cannot be materialized or does not fit; searches record it as a result."""


class PlanFileError(PlanlabError):
    """A plan file that is malformed or written by another format version."""


class DeadlockError(InfeasiblePlan):
    """A Program whose devices would wait on each other forever."""


class ExecutionError(PlanlabError):
    """A failure while running a Program on torch.distributed."""


class TaskError(ExecutionError):
    """A task of ``device`` raised ``cause``; ``waited_on`` names the group or peer of a
    collective, send or receive (``planlab.executor.failures.waited_on``)."""

    def __init__(self, device: int, action: str, task: Task, cause: BaseException, waited_on: str = "") -> None:
        self.device, self.action, self.task, self.cause = device, action, task, cause
        self.waited_on = waited_on
        wait = f" (waiting on {waited_on})" if waited_on else ""
        super().__init__(f"device {device}, action {action}, task {task}{wait}: {type(cause).__name__}: {cause}")


class RankFailure(ExecutionError):
    """A rank failed: ``rank``, where it was (``where``: step, action, task) and the error."""

    def __init__(self, message: str, *, rank: int, where: str, error: str, cause: str) -> None:
        super().__init__(message)
        self.rank, self.where, self.error, self.cause = rank, where, error, cause


class InjectedFault(RuntimeError):
    """The exception a ``kind=raise`` test fault raises (``planlab.executor.failures``): not a
    PlanlabError, as the failures it stands for are not."""


class InternalError(RuntimeError):
    """An invariant inside planlab does not hold (a Task built with unknown fields, a conversion into
    a partial layout, a pipeline list schedule that stalls): a bug in planlab, not bad input, so not a
    PlanlabError. Where a user's input could reach a check, it raises a PlanlabError instead."""


class KernelFormulaError(InternalError):
    """A kernel formula (``planlab.costmodel.kernels``) failed on the shapes a task gave it: a bug in
    planlab, not bad input, so not a PlanlabError; never priced by the roofline instead."""


class UnknownKnob(ConfigError):
    """A constraint read a knob that its space does not have."""


class KnobNotSet(Exception):
    """A constraint read a knob that is not assigned yet (``planlab.search_spaces.space``: the
    constraint is deferred; never raised to a user)."""


class CheckpointError(PlanlabError):
    """A checkpoint that is missing, partial or malformed, of another format version or of
    another model, or a folder that cannot take one; the message names the file and tensor."""


def choices(values) -> str:
    """Format valid choices for an error message: ``'a', 'b' or 'c'``."""
    vals = [repr(v) for v in values]
    if not vals:
        return "(none)"
    if len(vals) == 1:
        return vals[0]
    return ", ".join(vals[:-1]) + " or " + vals[-1]


class PieceShapeError(RuntimeError):
    """A forward piece's output has another shape than its task's (``planlab.executor.piece_check``):
    a bug in planlab (a size fixed when the model was traced, a split the operator does not take),
    not bad input, so not a PlanlabError; caught at the first wrong shape instead of downstream."""
