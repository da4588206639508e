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
from planlab.graph import Graph, Signature
from planlab.lazy import make_lazy

__version__ = "0.1.0"

# Entry points that import torch, pandas or matplotlib load on first use (planlab.lazy), so that
# `planlab simulate` of a traced model's plan does not pay for them; planlab.explore is the function.
make_lazy(
    __name__,
    {
        "explore": "planlab.explore",
        "register_op": "planlab.graph.registry",
        "trace": "planlab.graph.trace",
        "materialize": "planlab.plan",
        "PlanBuilder": "planlab.plan",
        "Plan": "planlab.plan",
        "load_plan": "planlab.plan",
        "save_plan": "planlab.plan",
        "simulate": "planlab.simulator",
        "CostModel": "planlab.costmodel",
    },
)

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
