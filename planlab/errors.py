"""planlab's exception hierarchy.

Every error a user can cause is a :class:`PlanlabError`; its message names the
offending value and what was expected, so the CLI prints it on one line.
"""

from __future__ import annotations


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
