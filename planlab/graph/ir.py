"""The operator graph: tensors, operators and the graph that holds them."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from planlab.errors import GraphError
from planlab.graph.signature import Axis, Signature

DTYPE_BYTES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}

# The operator kind of ``Tensor.detach`` / ``torch.detach``: its output carries no gradient to its input.
DETACH = "detach"


def no_grad_tensors(graph: "Graph") -> frozenset[str]:
    """Activations that carry no gradient because every float activation they are computed from goes
    through a ``detach`` (AlphaFold2's recycled representations) or from no parameter at all (torch's
    ``requires_grad=False``, the masks): the outputs of detach operators, and of operators without
    parameters whose activation inputs (if any) are all such tensors. Empty for a graph without a
    detach, whose programs keep the gradients of parameter-free activations as they always did."""
    if not any(op.kind == DETACH for op in graph.operators):
        return frozenset()
    out: set[str] = set()
    tensors = graph.tensors
    for op in graph.operators:
        if op.kind == DETACH or not any(
            (role := tensors[t].role) == "param" or (role == "activation" and t not in out) for t in op.inputs
        ):
            out.update(op.outputs)
    return frozenset(out)


# Operator kinds that make a tensor like another (``torch.zeros_like``, ``ones_like``, ``full_like``,
# ``empty_like``): a factory function, whose result never requires a gradient and whose autograd
# records no edge to its input
FILL_LIKE = "fill_like"


def constant_tensors(graph: "Graph") -> frozenset[str]:
    """Activations that carry no gradient in any graph because they hold a constant: the outputs of
    ``fill_like`` operators (PyTorch's ``*_like`` factories return tensors with ``requires_grad``
    false), and of operators without parameters that read such a tensor and no other float
    activation (a view of the zeros, ``zeros_like(x).expand(...)``). An operator reading one (the
    experts' dispatch, ``scatter_add(zeros, index, tokens)``) computes no gradient for it."""
    out: set[str] = set()
    tensors = graph.tensors
    for op in graph.operators:
        if op.kind == FILL_LIKE:
            out.update(op.outputs)
            continue
        floats = [t for t in op.inputs if tensors[t].is_float and tensors[t].role in ("activation", "param")]
        if floats and all(t in out for t in floats):
            out.update(op.outputs)
    return frozenset(out)


@dataclass(frozen=True)
class TensorSpec:
    """A tensor of the graph. ``role`` is input, param, buffer or activation."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    role: str = "activation"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES.get(self.dtype, 4)

    @property
    def is_float(self) -> bool:
        return self.dtype.startswith(("float", "bfloat"))

    def __str__(self) -> str:
        return f"{self.name}{list(self.shape)}:{self.dtype}"


@dataclass(frozen=True)
class TensorArg:
    """Placeholder in a call template for the operator's ``index``-th input."""

    index: int


@dataclass(frozen=True, eq=False)
class CallSpec:
    """How to run an operator: ``target(*args, **kwargs)`` with TensorArg slots."""

    target: Any
    args: tuple
    kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class Operator:
    """One operator of the graph with its dimension signature and costs.

    ``inputs`` lists tensor names in signature order (activations first as
    they appear in the call, then parameters); ``saves`` names the tensors its
    backward needs, which the memory model keeps alive until the backward runs.
    """

    name: str
    kind: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    signature: Signature
    dim_sizes: dict[str, int]
    flops: float
    bytes_moved: float
    module: str
    call: CallSpec | None  # None in a graph for planning only (planlab.models.trace_cache)
    saves: tuple[str, ...] = ()
    bwd_flops_ratio: float = 2.0
    add_once: tuple[int, ...] = ()
    # whether a forward piece draws random numbers, kept when the call is dropped (planlab.models.trace_cache);
    # None: decided from the call (planlab.graph.random_ops)
    random: bool | None = None

    def __str__(self) -> str:
        return f"{self.name}[{self.kind}]({self.signature})"

    def axes_of(self, tensor: str) -> tuple[Axis, ...]:
        """The signature axes of one of this operator's tensors."""
        if tensor in self.inputs:
            return self.signature.inputs[self.inputs.index(tensor)]
        if tensor in self.outputs:
            return self.signature.outputs[self.outputs.index(tensor)]
        raise GraphError(f"operator {self.name!r} has no tensor {tensor!r}")

    def splittable_dims(self) -> list[str]:
        return [d for d in self.signature.dims() if self.signature.splittable(d)]


T = TypeVar("T")


class FrozenDict(dict):
    """A dict that refuses every change once built (a traced graph's tables); it pickles as a dict."""

    def _refuse(self, *args, **kwargs):
        raise GraphError("a traced graph is frozen: build a new Graph instead of changing this one")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _refuse

    def __reduce__(self):
        return (FrozenDict, (dict(self),))


@dataclass(frozen=True, eq=False)
class Graph:
    """A traced model: tensors by name and operators in topological order. Frozen once built:
    its tables refuse changes, and :meth:`memo` is the one cache of what passes derive from it.

    ``loss`` names the scalar the model returns; ``labels`` maps each tensor
    axis to a dimension label shared by every axis that is the same dimension
    of the model (the batch of the input is the batch of the loss), so search
    spaces can say "split the batch" once for every operator.
    """

    tensors: Mapping[str, TensorSpec]
    operators: tuple[Operator, ...]
    inputs: tuple[str, ...]
    loss: str
    labels: Mapping[tuple[str, int], str] = field(default_factory=dict)
    unknown: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        producer: dict[str, Operator] = {}
        consumers: dict[str, list[Operator]] = {}
        for op in self.operators:
            for t in op.outputs:
                producer[t] = op
            for t in op.inputs:
                consumers.setdefault(t, []).append(op)
        fixed = {
            "tensors": FrozenDict(self.tensors),
            "operators": tuple(self.operators),
            "inputs": tuple(self.inputs),
            "labels": FrozenDict(self.labels),
            "unknown": tuple(self.unknown),
            "_by_name": FrozenDict((op.name, op) for op in self.operators),
            "producer": FrozenDict(producer),
            "consumers": FrozenDict((t, tuple(ops)) for t, ops in consumers.items()),
            "_memo": {},
            "_memo_lock": threading.Lock(),
        }
        for name, value in fixed.items():
            object.__setattr__(self, name, value)

    def __reduce__(self):
        return (Graph, (dict(self.tensors), self.operators, self.inputs, self.loss, dict(self.labels), self.unknown))

    def memo(self, key: tuple, compute: Callable[[], T]) -> T:
        """The graph's cache of derived values: ``compute()`` the first time ``key`` (a tuple of
        frozen values naming the function and its other arguments) is asked for, its value after.
        It lives and dies with the graph, so no module keeps state keyed by a graph's ``id()``."""
        with self._memo_lock:
            if key in self._memo:
                return self._memo[key]
        value = compute()
        with self._memo_lock:
            return self._memo.setdefault(key, value)

    def memo_entries(self) -> tuple[tuple[tuple, object], ...]:
        """What the memo holds, as ``(key, value)`` pairs: what a cache of traced graphs keeps with a
        graph (:mod:`planlab.models.trace_cache`) and puts back with :meth:`memo`."""
        with self._memo_lock:
            return tuple(self._memo.items())

    def op(self, name: str) -> Operator:
        try:
            return self._by_name[name]
        except KeyError:
            raise GraphError(f"no operator named {name!r} in the graph") from None

    @property
    def params(self) -> list[TensorSpec]:
        return [t for t in self.tensors.values() if t.role == "param"]

    @property
    def num_params(self) -> int:
        return sum(t.numel for t in self.params)

    @property
    def flops(self) -> float:
        """Forward FLOPs of one pass over the traced batch."""
        return sum(op.flops for op in self.operators)

    def dim_label(self, op: Operator, dim: str) -> str | None:
        """The model-wide label of ``op``'s dimension ``dim``."""
        for t in op.inputs + op.outputs:
            for i, ax in enumerate(op.axes_of(t)):
                if ax and ax[0] == dim:
                    return self.labels.get((t, i))
        return None

    def dim_with_label(self, op: Operator, label: str) -> str | None:
        """The dimension of ``op`` that carries ``label``, if any."""
        for t in op.inputs + op.outputs:
            for i, ax in enumerate(op.axes_of(t)):
                if ax and self.labels.get((t, i)) == label:
                    return ax[0]
        return None

    @property
    def batch_label(self) -> str:
        """Label of the first input's first axis: the batch."""
        return self.labels[(self.inputs[0], 0)]

    def summary(self) -> str:
        kinds: dict[str, int] = {}
        for op in self.operators:
            kinds[op.kind] = kinds.get(op.kind, 0) + 1
        lines = [
            f"{len(self.operators)} operators, {self.num_params:,} parameters, {self.flops / 1e9:,.1f} GFLOP forward",
            "  " + ", ".join(f"{k}: {n}" for k, n in sorted(kinds.items())),
        ]
        if self.unknown:
            lines.append("  kept whole (no signature): " + ", ".join(self.unknown))
        return "\n".join(lines)
