"""Which operators of a graph draw random numbers.

A random operator draws from planlab's counter-based generator
(:mod:`planlab.executor.randomness`), keyed by the seed, the operator's name, the step and the
global index of each element it draws, so that any split of it draws what one process draws.
Materialize gives the forward tasks of these operators the box of their piece (``Task.box``),
and the interpreter runs them under the generator. Three kinds are random:

- ``dropout`` with ``p > 0`` (``F.dropout``, ``nn.Dropout``): one draw per output element;
- ``attention`` with ``dropout_p > 0`` (``F.scaled_dot_product_attention`` and functions that
  call it, such as planlab's biased attention): one draw per attention weight ``(b.., s, t)``;
- ``rand`` (``torch.rand``, ``torch.rand_like``, recorded by the Hugging Face tracer: stochastic
  depth's per-sample draws): one draw per output element.
"""

from __future__ import annotations

import inspect

from planlab.graph.ir import CallSpec, Graph, Operator

SDPA_DROPOUT_POSITION = 4  # F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, ...)


def attention_dropout_p(call: CallSpec) -> float:
    """The ``dropout_p`` an attention call passes (0 when it passes none)."""
    import torch.nn.functional as F  # here: planning from a cached graph imports no torch

    p = call.kwargs.get("dropout_p")
    if p is None:
        if call.target is F.scaled_dot_product_attention:
            pos = SDPA_DROPOUT_POSITION
        else:
            try:
                pos = list(inspect.signature(call.target).parameters).index("dropout_p")
            except (TypeError, ValueError):
                return 0.0
        p = call.args[pos] if len(call.args) > pos else 0.0
    return float(p) if isinstance(p, (int, float)) else 0.0


def draws_random(op: Operator) -> bool:
    """True if a forward piece of ``op`` draws random numbers (see the module docstring)."""
    if op.random is not None:
        return op.random
    if op.kind == "dropout":
        return op.flops > 0  # p = 0 is traced without work (planlab.graph.registry)
    if op.kind == "rand":
        return True
    if op.kind == "attention":
        return attention_dropout_p(op.call) > 0
    return False


def random_operators(graph: Graph) -> tuple[Operator, ...]:
    """The graph's random operators, in execution order (the order one process draws in)."""
    return tuple(op for op in graph.operators if draws_random(op))
