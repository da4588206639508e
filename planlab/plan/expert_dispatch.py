"""What a mixture of experts' dispatch and combine send across nodes when the software sends a token
once to each node (the software's ``expert_dispatch = "node_dedup"``).

planlab's dispatch moves a static buffer of every token's ``top_k`` copies, and an all-to-all priced
as NCCL's (Megatron-Core's all-to-all dispatcher) sends each copy on its own: a rank's bytes for
other nodes are ``(nodes - 1) / nodes`` of ``top_k`` copies of its tokens. DeepEP's internode
kernels (deepseek-ai/DeepEP, ``csrc/kernels/internode.cu``: a token crosses RDMA once per
destination node with a bitmask of the node's GPUs that take it, ``SourceMeta``, and is forwarded
over NVLink there; the combine sums a node's outputs before they cross back), NVIDIA's HybridEP (the
same two-level scheme in DeepEP's ``hybrid-ep`` branch, Megatron-Core's ``--moe-flex-dispatcher-backend
hybridep``) and DeepSeek-V3's own kernels (report section 3.2.2: "IB first transfers [a token] to the
GPUs with the same in-node index on their target nodes", then NVLink) cross each node once. With a
balanced load (the routing the published rows force or approach) a token's ``top_k`` experts are
drawn evenly, and what crosses the network is the share ``distinct nodes / top_k`` of the copies
(by symmetry the sender's own node is one of them as often for both). Group-limited routing
(DeepSeek-V3's node-limited routing, section 2.1.2: each token's experts in at most ``group_topk``
of ``groups`` groups; the released ``config.json``: ``n_group`` 8, ``topk_group`` 4) bounds the
distinct nodes further.

Experts lie on the expert-parallel ranks in order and the ranks on nodes in order (the ``ep`` axis),
so with ``groups`` a multiple of the nodes each node holds ``groups / nodes`` whole groups, and with
the nodes a multiple of ``groups`` a group spans ``nodes / groups`` nodes; other shapes are priced as
unlimited routing (more nodes, so never faster).

A fused token permutation (the software's ``fused_permute``: Megatron-Core's ``--moe-permute-fusion``,
Transformer Engine's ``moe_permute`` / ``moe_unpermute`` kernels, which HybridEP's dispatch and
combine also run inside them) makes the expert-major copies of a layer's tokens in one kernel and
sums them back in one: :func:`fuse_token_permutation` leaves the dispatch's scatter and the
combine's gather (each one read and one write of the ``top_k`` copies, the fused kernels' traffic)
and marks the element-wise and layout operators planlab's static-shape routing runs around them as
inside those kernels (``Task.in_kernel``), with their gradients.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from math import comb

from planlab.graph.ir import Graph
from planlab.plan.program import Program, TaskKind
from planlab.search_spaces.experts import expert_dims, num_experts, token_hidden_dims


@dataclass(frozen=True)
class Routing:
    """A routed layer's selection: ``top_k`` of ``experts``, within ``group_topk`` of ``groups``
    groups (``groups == group_topk``: no limit)."""

    experts: int
    top_k: int
    groups: int = 1
    group_topk: int = 1


def routing_of(graph: Graph) -> Routing | None:
    """The routing of ``graph``'s mixture-of-experts layers, read from its operators (memoized on
    the graph): the experts' one-hot of the chosen ``(..., top_k, experts)`` and, where the layer
    limits its groups, the ``topk`` over the group scores ``(..., groups) -> (..., group_topk)``
    on the same tokens. None for a model without routed experts."""
    return graph.memo(("expert_routing",), lambda: _routing_of(graph))


def _routing_of(graph: Graph) -> Routing | None:
    e = num_experts(graph)
    if not e:
        return None
    ts = graph.tensors
    choice = next(
        (op for op in graph.operators if op.kind == "one_hot" and ts[op.outputs[0]].shape[-1:] == (e,)),
        None,
    )
    if choice is None:
        return None
    tokens = ts[choice.inputs[0]].shape[:-1]
    k = ts[choice.outputs[0]].shape[-2]
    for op in graph.operators:
        if op.kind != "topk":
            continue
        src, out = ts[op.inputs[0]].shape, ts[op.outputs[0]].shape
        if src[:-1] == tokens and 1 < src[-1] < e and e % src[-1] == 0 and out[-1] < src[-1]:
            return Routing(e, k, src[-1], out[-1])
    return Routing(e, k)


def distinct_nodes(r: Routing, nodes: int) -> float:
    """The mean number of the ``nodes`` (over which the experts are spread evenly, in order) that a
    token's ``top_k`` experts are on, each expert drawn evenly from the groups it may take."""
    if nodes <= 1:
        return 1.0
    e, k, g, m = r.experts, r.top_k, r.groups, r.group_topk
    pool = m * e // g  # the experts of the chosen groups
    if m < g and g % nodes == 0:  # whole groups on a node: j of its g / nodes groups chosen
        per = g // nodes
        miss = sum(
            comb(per, j) * comb(g - per, m - j) / comb(g, m) * comb(pool - j * e // g, k) / comb(pool, k)
            for j in range(0, min(per, m) + 1)
        )
    elif m < g and nodes % g == 0:  # a group over nodes / g nodes: its share of the pool
        miss = (1 - m / g) + m / g * comb(pool - e // nodes, k) / comb(pool, k)
    else:
        miss = comb(e - e // nodes, k) / comb(e, k)
    return nodes * (1 - miss)


def node_share(r: Routing, nodes: int) -> float:
    """The share of a dispatch or combine all-to-all's bytes for other nodes that crosses the network
    when its group spans ``nodes`` nodes and the software sends a token once to each node:
    :func:`distinct_nodes` over ``top_k`` (1 on one node, where nothing crosses it)."""
    return 1.0 if nodes <= 1 else min(1.0, distinct_nodes(r, nodes) / r.top_k)


def dispatch_tensors(graph: Graph) -> frozenset[str]:
    """The activations a routed layer's dispatch and combine move: those an operator with the
    experts' axis reads or makes (memoized on the graph); their gradients cross back alike."""

    def find() -> frozenset[str]:
        carriers = expert_dims(graph)
        return frozenset(
            t
            for op in graph.operators
            if op.name in carriers
            for t in op.inputs + op.outputs
            if graph.tensors[t].role == "activation"
        )

    return graph.memo(("dispatch_tensors",), find)


def _each_task(program: Program, change) -> Program:
    """``program`` with every task of every block replaced by ``change(task)``."""
    devices = []
    for dp in program.devices:
        blocks = {key: dataclasses.replace(b, tasks=tuple(change(t) for t in b.tasks)) for key, b in dp.blocks.items()}
        devices.append(dataclasses.replace(dp, blocks=blocks))
    return dataclasses.replace(program, devices=tuple(devices))


def dedup_expert_dispatch(program: Program, graph: Graph, node_of) -> Program:
    """``program`` with each all-to-all of a routed layer's dispatch or combine (a tensor an
    operator with the experts' axis makes or reads, its gradients included) that spans nodes
    marked with the share of its copies that crosses the network (``Task.node_share``:
    :func:`distinct_nodes` over ``top_k``). ``node_of(device)`` is the device's node."""
    r = routing_of(graph)
    if r is None:
        return program
    moved = dispatch_tensors(graph)
    shares: dict[int, float] = {}

    def share(group: tuple[int, ...]) -> float:
        nodes = len({node_of(d) for d in group})
        if nodes not in shares:
            shares[nodes] = node_share(r, nodes)
        return shares[nodes]

    def marked(t):
        if t.kind is not TaskKind.COLLECTIVE or t.collective != "all_to_all" or not t.reads or t.reads[0] is None:
            return t
        if t.reads[0].tensor not in moved:
            return t
        s = share(t.group)
        return t if s >= 1.0 else t.but(node_share=s)

    return _each_task(program, marked)


# Operator kinds on the tokens' way into and out of the experts that a fused permutation runs inside
# its kernel: the top-k copies (expand, reshape), the kept-assignment and routing-weight products
# (mul), the empty slots (fill_like), the sum over the top k (sum), the slots' expert-major layout
# (reshape, transpose); the scatter and the gather stand for the fused kernels themselves
PERMUTE_KINDS = frozenset({"expand", "reshape", "transpose", "mul", "fill_like", "getitem", "sum"})
LAYOUT_KINDS = frozenset({"expand", "reshape", "transpose"})


def permutation_ops(graph: Graph) -> frozenset[str]:
    """The operators a fused token permutation runs inside its kernels (module docstring): those on
    the tokens' way into and out of the experts of kinds ``PERMUTE_KINDS``, and the layout operators
    beside the experts' GEMMs (memoized on the graph)."""

    def find() -> frozenset[str]:
        tokens, experts = token_hidden_dims(graph), expert_dims(graph)
        by_name = {op.name: op for op in graph.operators}
        return frozenset(
            [n for n in tokens if by_name[n].kind in PERMUTE_KINDS]
            + [n for n in experts if by_name[n].kind in LAYOUT_KINDS]
        )

    return graph.memo(("permutation_ops",), find)


# Transformer Engine's fused permutation kernels index each row of the copies with one int32 entry of their
# row map (transformer_engine/pytorch/permutation.py: moe_permute / moe_unpermute, row_id_map int32)
ROW_MAP_BYTES = 4


def permutation_kernels(graph: Graph) -> frozenset[str]:
    """The scatter and gather on the tokens' way into and out of the experts: the dispatch's scatter and
    the combine's gather, which stand for the fused permute and unpermute kernels (memoized on the graph)."""

    def find() -> frozenset[str]:
        by_name = {op.name: op for op in graph.operators}
        return frozenset(n for n in token_hidden_dims(graph) if by_name[n].kind in ("scatter", "gather"))

    return graph.memo(("permutation_kernels",), find)


def fused_permute_bytes(shapes: tuple[tuple[int, ...], ...], top_k: int, elem_bytes: int) -> float:
    """The memory traffic of one fused permute or unpermute kernel (or of its gradient) whose index
    (``shapes[1]``, planlab's index expanded over the hidden axis) has one row per token copy: each of
    the ``top_k`` copies of a token written (read) once, the token read (written) once, and a row-map
    entry per copy (Transformer Engine's ``moe_permute`` reads a token's row and writes it to each of its
    experts' rows; ``moe_unpermute`` reads a token's copies and writes their weighted sum). PyTorch's
    scatter_add and gather, as priced without the fusion, also read the empty buffer and the index at its
    expanded 8 bytes an element."""
    index = shapes[1]
    copies = math.prod(index)
    return copies * elem_bytes * (1 + 1 / top_k) + copies / index[-1] * ROW_MAP_BYTES


def fuse_token_permutation(program: Program, graph: Graph) -> Program:
    """``program`` with the forward, backward and local-copy tasks of :func:`permutation_ops` (a copy
    by the operator that made the tensor it copies) marked ``in_kernel``, and the dispatch's scatter and
    the combine's gather (:func:`permutation_kernels`, forward and backward) moving what the fused
    kernels move (:func:`fused_permute_bytes`)."""
    ops, kernels, r = permutation_ops(graph), permutation_kernels(graph), routing_of(graph)
    if not ops or r is None:
        return program
    eb = program.precision.activation_bytes

    def marked(t):
        if t.kind in (TaskKind.FORWARD, TaskKind.BACKWARD):
            if t.op in kernels and len(t.shapes) > 1:
                return t.but(bytes_moved=fused_permute_bytes(t.shapes, r.top_k, eb))
            inside = t.op in ops
        elif t.kind is TaskKind.LOCAL and t.reads and t.reads[0] is not None:
            made = graph.producer.get(t.reads[0].tensor)
            inside = made is not None and made.name in ops
        else:
            inside = False
        return t.but(in_kernel=True) if inside else t

    return _each_task(program, marked)
