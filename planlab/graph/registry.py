"""The signature registry: what planlab knows about each operator kind.

An :class:`OpDef` derives an operator's dimension signature, FLOPs and saved
tensors from the shapes seen while tracing. Built-in definitions cover the
operators of a GPT decoder; :func:`register_op` adds a user's own function as a
single operator (a leaf while tracing) with a fixed signature.

The types and tables are :mod:`planlab.graph.opdefs`'; the definitions are the ``ops_*``
modules', loaded here in their order (each later one refines or leaves alone what the earlier
ones define): :mod:`~planlab.graph.ops_gpt`, :mod:`~planlab.graph.ops_einsum`,
:mod:`~planlab.graph.ops_biased_attention`, :mod:`~planlab.graph.ops_vision`,
:mod:`~planlab.graph.ops_routing`, :mod:`~planlab.graph.ops_hf`. Ask :func:`lookup` here.
"""

from __future__ import annotations

from planlab.graph import ops_hf  # noqa: F401  (loads every ops_* module before it, in order)
from planlab.graph.opdefs import OPAQUE, OpContext, OpDef, lookup, register_op, user_functions

__all__ = ["OPAQUE", "OpContext", "OpDef", "lookup", "register_op", "user_functions"]
