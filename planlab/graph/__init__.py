"""The operator graph: signatures, the registry of operator kinds and ``trace()``."""

from planlab.graph.ir import CallSpec, Graph, Operator, TensorArg, TensorSpec
from planlab.graph.registry import OpDef, register_op
from planlab.graph.signature import Signature
from planlab.graph.trace import trace

__all__ = ["CallSpec", "Graph", "Operator", "OpDef", "Signature", "TensorArg", "TensorSpec", "register_op", "trace"]
