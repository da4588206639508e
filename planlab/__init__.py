"""planlab: find fast, memory-feasible parallelization plans for training, and run them.

The flow: ``trace`` a model into a Graph, build Plans from a search space,
``materialize`` each into a Program, ``simulate`` it against a CostModel,
``explore`` many, and run the best with the executor.
"""

from planlab.errors import (
    CheckpointError,
    ConfigError,
    DeadlockError,
    GraphError,
    InfeasiblePlan,
    PlanFileError,
    PlanlabError,
)
from planlab.graph import Graph, Signature, register_op, trace

# Bound eagerly: the submodule planlab.explore would otherwise shadow the function once imported.
from planlab.explore import explore  # noqa: E402

__version__ = "0.1.0"


def __getattr__(name: str):
    # Heavier entry points load on first use.
    if name in ("materialize", "PlanBuilder", "Plan", "load_plan", "save_plan"):
        import planlab.plan as p

        return getattr(p, name)
    if name == "simulate":
        from planlab.simulator import simulate

        return simulate
    if name == "CostModel":
        from planlab.costmodel import CostModel

        return CostModel
    raise AttributeError(f"module 'planlab' has no attribute {name!r}")


__all__ = [
    "CheckpointError",
    "ConfigError",
    "CostModel",
    "DeadlockError",
    "Graph",
    "GraphError",
    "InfeasiblePlan",
    "Plan",
    "PlanBuilder",
    "PlanFileError",
    "PlanlabError",
    "Signature",
    "explore",
    "load_plan",
    "materialize",
    "register_op",
    "save_plan",
    "simulate",
    "trace",
]
