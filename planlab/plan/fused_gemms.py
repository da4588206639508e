"""Projections that read one input and that a software runs as one GEMM of their summed output
width (:meth:`planlab.costmodel.software.SoftwareSpec.fuses`):

- ``Fusion.QKV``: an attention's query, key and value projections reading the same input
  (Megatron-LM's ``query_key_value``, Megatron-Core's ``linear_qkv``), or, in a cross-attention
  whose queries read another input, its key and value projections (Megatron-Core's
  ``CrossAttention.linear_kv``, Megatron-LM's ``key_value``); the software's ``fused_qkv``;
- ``Fusion.GATE_UP``: a gated linear unit's gate and up projections, ``act(x W_g) * (x W_u)``
  (Megatron-Core's ``linear_fc1`` of width ``2 x ffn`` with ``gated_linear_unit``, its experts'
  grouped ``linear_fc1`` alike; Megatron-DeepSpeed's ``dense_h_to_4h`` with ``--swiglu``): linear
  layers, or an expert stack's batched products with a weight; the software's ``fused_gate_up``.

The graph keeps the projections as ``torch.nn`` models write them; what fuses them is the software,
so the graph and the layouts stay as they are: the price of their GEMMs changes
(:func:`planlab.costmodel.kernels.op_kernels`, ``fused_widths``), and the fused input-gradient GEMM
writes one gradient of the shared input, not one per projection summed after
(:func:`planlab.plan.passes.backward.fused_writers`). The groups are found once per graph
(memoized on it) and shared by materialize (:func:`fused_fields`, the simulator's tasks) and the
explorer's screen (:func:`whole_widths`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from planlab.costmodel.software import Fusion
from planlab.graph.ir import Graph, Operator

if TYPE_CHECKING:
    from planlab.plan.passes.draft import Draft

_MAX_STEPS = 12  # operators between a projection and the attention (views, rotary embedding, repeat_kv)
_GATE_STEPS = 3  # operators between a projection and the gate's product (the activation, views)
_GATE_PATH = frozenset({"activation", "reshape", "view", "transpose", "permute"})


@dataclass(frozen=True)
class FusedGroup:
    """Projections that one GEMM computes, in the fused weight's order, and which fusion it is."""

    fusion: Fusion
    ops: tuple[str, ...]


def is_projection(graph: Graph, op: Operator) -> bool:
    """A linear layer, or a batched product of an activation and a weight (an expert stack's)."""
    if op.kind == "linear":
        return True
    return op.kind == "matmul" and len(op.inputs) == 2 and graph.tensors[op.inputs[1]].role == "param"


def _projection(graph: Graph, tensor: str, steps: int, through: frozenset[str] | None = None) -> str | None:
    """The projection ``tensor`` comes from, through the first input of at most ``steps`` operators
    in between (of the kinds ``through``, any when None); None when there is none."""
    for _ in range(steps + 1):
        op = graph.producer.get(tensor)
        if op is None or not op.inputs:
            return None
        if is_projection(graph, op):
            return op.name
        if through is not None and op.kind not in through:
            return None
        tensor = op.inputs[0]
    return None


def _reads_one_input(graph: Graph, names: tuple[str | None, ...]) -> bool:
    """Whether ``names`` are distinct projections of one kind reading the same input."""
    if None in names or len(set(names)) != len(names):
        return False
    ops = [graph.op(n) for n in names]
    return len({op.inputs[0] for op in ops}) == 1 and len({op.kind for op in ops}) == 1


def fused_groups(graph: Graph) -> Mapping[str, FusedGroup]:
    """Per projection that one of the software's fused GEMMs computes (module docstring), its group
    (memoized on the graph)."""

    def compute() -> dict[str, FusedGroup]:
        out: dict[str, FusedGroup] = {}
        for op in graph.operators:
            if op.kind == "attention" and len(op.inputs) >= 3:
                qkv = tuple(_projection(graph, t, _MAX_STEPS) for t in op.inputs[:3])
                group, fusion = (qkv if _reads_one_input(graph, qkv) else qkv[1:]), Fusion.QKV  # or cross kv
            elif op.kind == "mul" and len(op.inputs) == 2:
                group = tuple(_projection(graph, t, _GATE_STEPS, _GATE_PATH) for t in op.inputs)
                fusion = Fusion.GATE_UP
            else:
                continue
            if _reads_one_input(graph, group) and not any(n in out for n in group):
                fused = FusedGroup(fusion, tuple(n for n in group if n is not None))
                out.update((n, fused) for n in fused.ops)
        return out

    return graph.memo(("fused_groups",), compute)


def output_width(kind: str, weight_shape: tuple[int, ...]) -> int:
    """A projection's output width from its weight's shape: a linear layer's ``(N, K)``, a batched
    product's ``(..., K, N)``."""
    return weight_shape[0] if kind == "linear" else weight_shape[-1]


def whole_widths(graph: Graph, op_name: str) -> tuple[Fusion | None, tuple[int, ...]]:
    """The fusion and the whole output widths of the group ``op_name`` is in ((None, ()) if none):
    what the screen prices, before any split."""
    group = fused_groups(graph).get(op_name)
    if group is None:
        return None, ()
    ops = [graph.op(n) for n in group.ops]
    return group.fusion, tuple(output_width(op.kind, graph.tensors[op.inputs[1]].shape) for op in ops)


def fused_fields(d: Draft, op: Operator) -> dict:
    """The Task fields of a piece of ``op`` that one of the software's fused GEMMs computes:
    ``fusion`` and ``fused_widths``, the group's local output widths, when all of its projections
    read the same buffer under the same split (a fused GEMM's pieces: the input the same, the
    weights' output rows concatenated); no fields otherwise."""
    group = fused_groups(d.graph).get(op.name)
    if group is None:
        return {}
    forms = [d.layouts.form(d.graph.op(n)) for n in group.ops]
    if len({d.reads[n][0] for n in group.ops}) != 1 or len({f.shapes[0] for f in forms}) != 1:
        return {}
    return dict(fusion=group.fusion, fused_widths=tuple(output_width(op.kind, f.shapes[1]) for f in forms))
