"""The attention's query, key and value projections: linear layers that read one input and feed
one attention, which a software with ``fused_qkv`` runs as one GEMM
(:attr:`planlab.costmodel.software.SoftwareSpec.fused_qkv`).

The graph keeps three linear operators (as ``torch.nn`` models write them); what fuses them is
the software, so the graph, the layouts and the memory stay as they are and only the price of
their GEMMs changes (:func:`planlab.costmodel.kernels.op_kernels`, ``fused_widths``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    from planlab.graph.ir import Graph
    from planlab.plan.passes.draft import Draft

_MAX_STEPS = 12  # operators between a projection and the attention (views, rotary embedding, repeat_kv)


def _projection(graph: Graph, tensor: str) -> str | None:
    """The linear operator ``tensor`` comes from, through the first input of the operators in
    between (views, a rotary embedding's products and sum, grouped-query attention's expand);
    None when there is none within a few steps."""
    for _ in range(_MAX_STEPS):
        op = graph.producer.get(tensor)
        if op is None or not op.inputs:
            return None
        if op.kind == "linear":
            return op.name
        tensor = op.inputs[0]
    return None


def qkv_groups(graph: Graph) -> Mapping[str, tuple[str, str, str]]:
    """Per linear operator that is one of an attention's query, key and value projections reading
    the same input, the three projections' names in query, key, value order."""

    def compute() -> dict[str, tuple[str, str, str]]:
        out: dict[str, tuple[str, str, str]] = {}
        for op in graph.operators:
            if op.kind != "attention" or len(op.inputs) < 3:
                continue
            names = tuple(_projection(graph, t) for t in op.inputs[:3])
            if None in names or len(set(names)) != 3:
                continue
            if len({graph.op(n).inputs[0] for n in names}) == 1:
                out.update((n, names) for n in names)
        return out

    return graph.memo(("qkv_groups",), compute)


def fused_widths(d: Draft, op_name: str) -> tuple[int, ...]:
    """The local output widths of the query, key and value projections ``op_name`` is one of,
    when all three read the same buffer under the same split (a fused GEMM's pieces: the input
    the same, the weights' output rows concatenated); () otherwise."""
    group = qkv_groups(d.graph).get(op_name)
    if group is None:
        return ()
    forms = [d.layouts.form(d.graph.op(n)) for n in group]
    if len({d.reads[n][0] for n in group}) != 1 or len({f.shapes[0] for f in forms}) != 1:
        return ()
    return tuple(f.shapes[1][0] for f in forms)
