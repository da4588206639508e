"""The operator graph: signatures, the registry of operator kinds and ``trace()``.

The graph's data types load with the package; ``trace``, ``register_op`` and ``OpDef`` import
torch, so they load on first use (:mod:`planlab.lazy`).
"""

from planlab.graph.ir import CallSpec, Graph, Operator, TensorArg, TensorSpec
from planlab.graph.signature import Signature
from planlab.lazy import make_lazy

make_lazy(
    __name__,
    {"OpDef": "planlab.graph.registry", "register_op": "planlab.graph.registry", "trace": "planlab.graph.trace"},
)

__all__ = ["CallSpec", "Graph", "Operator", "OpDef", "Signature", "TensorArg", "TensorSpec", "register_op", "trace"]
