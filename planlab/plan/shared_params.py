"""Parameters read by several operators.

Of which at most one has a backward: AlphaFold2's recycling (:mod:`planlab.models.evoformer`) runs
the same trunk once per pass, all passes but the last behind a ``detach`` and without gradients.
The operator with a backward owns the parameter's gradient; each device holds each piece of the
parameter once, whatever the passes reading it.

Several with a backward (tied weights): DeepSeek-V3's multi-token-prediction modules look their
tokens up in the main embedding table, which DualPipe puts on the same pipeline ranks as the
modules, so the two share one parameter and one gradient physically (report section 3.2.3). The
first reader in the graph's order owns the gradient (its backward is the last to write it, so the
gradient's reduction follows both); every other reader's backward adds its contribution into the
same gradient buffer, as a later micro-batch's does. A tie is planned only where every reader holds
the same pieces on the same devices and gives a partial sum over the same devices, so the one
gradient and its one reduction serve them all; a tie across devices (Megatron-Core's embedding
group, all-reducing two copies once a step) is refused (:func:`check_tied`).
"""

from __future__ import annotations

from collections import defaultdict

from planlab.errors import InfeasiblePlan
from planlab.graph.ir import DETACH, Graph, Operator, constant_tensors, no_grad_tensors
from planlab.plan.layout import Layout, Partial


def forward_only_ops(graph: Graph, nograd: frozenset[str]) -> frozenset[str]:
    """Operators whose outputs reach the loss only through tensors in ``nograd`` (behind a detach:
    the no-grad recycling passes): they get no backward."""
    live: set[str] = set()
    loss, tensors, consumers = graph.loss, graph.tensors, graph.consumers
    for op in reversed(graph.operators):
        if op.outputs[0] == loss:
            live.add(op.name)
            continue
        for t in op.outputs:  # a float output not behind a detach that a live operator reads
            readers = consumers.get(t)
            if readers and t not in nograd and tensors[t].is_float and any(c.name in live for c in readers):
                live.add(op.name)
                break
    return frozenset(op.name for op in graph.operators if op.name not in live)


def forward_only_of(graph: Graph) -> frozenset[str]:
    """:func:`forward_only_ops` of a graph's detached tensors, cached per graph (empty without a
    detach): what the memory bound and the screen leave without backward and saved activations."""

    def compute() -> frozenset[str]:
        if any(op.kind == DETACH for op in graph.operators):
            return forward_only_ops(graph, no_grad_of(graph))
        return frozenset()

    return graph.memo(("forward_only_of",), compute)


def no_grad_of(graph: Graph) -> frozenset[str]:
    """:func:`~planlab.graph.ir.no_grad_tensors` of a graph, cached per graph."""
    return graph.memo(("no_grad_tensors",), lambda: no_grad_tensors(graph))


def constants_of(graph: Graph) -> frozenset[str]:
    """:func:`~planlab.graph.ir.constant_tensors` of a graph, cached per graph."""
    return graph.memo(("constant_tensors",), lambda: constant_tensors(graph))


def training_flops(graph: Graph) -> float:
    """The model FLOPs of one training iteration: the forward and a backward of twice its FLOPs,
    but no backward for the recycling passes behind a detach (AlphaFold2's no-grad passes)."""
    fwd_only = forward_only_of(graph)
    if not fwd_only:
        return 3.0 * graph.flops
    return graph.flops + 2.0 * sum(op.flops for op in graph.operators if op.name not in fwd_only)


def use_shared_param(
    op: Operator,
    ti: int,
    t: str,
    pieces: list[tuple[int, tuple]],
    owner: dict,
    fwd_only: frozenset[str],
    params_on: dict,
    held: dict,
) -> None:
    """Record that ``op`` reads parameter ``t`` (its input ``ti``) as ``pieces`` (device, box):
    an operator with a backward becomes the owner of its gradient; each device holds a piece once."""
    if op.name not in fwd_only:
        claim(owner, op, ti, t)
    for dev, box in pieces:
        if (t, box) not in held[dev]:
            held[dev].add((t, box))
            params_on[dev].append((t, box))


def claim(owner: dict, op: Operator, ti: int, t: str) -> None:
    """Make ``op`` (reading parameter ``t`` as its input ``ti``) the owner of ``t``'s gradient;
    InfeasiblePlan if another operator owns it already (tied weights)."""
    if t in owner and owner[t][0] is not op:
        raise InfeasiblePlan(
            f"parameter {t!r} is used by operators {owner[t][0].name!r} and "
            f"{op.name!r}; tied weights are not supported yet"
        )
    owner[t] = (op, ti)


def check_shared_params(params_on: dict, owned_pieces: dict[str, list[tuple[int, tuple]]]) -> None:
    """Every parameter piece a device holds (``params_on``) is one the owner of its gradient holds
    there too (``owned_pieces``: per parameter, (device, box)); otherwise a forward-only pass
    would read a copy that the optimizer never updates."""
    owned = defaultdict(set)
    for p, pieces in owned_pieces.items():
        for dev, box in pieces:
            owned[dev].add((p, box))
    for dev, items in params_on.items():
        for p, box in items:
            if (p, box) not in owned[dev]:
                raise InfeasiblePlan(
                    f"parameter {p!r} is read on device {dev} by a recycling pass without "
                    "gradients, but the pass with gradients does not hold that piece there: "
                    "place and split each pass's operators as the last pass's"
                )


def check_tied(owner: dict[str, tuple[Operator, int]], tied: dict[str, list[tuple[Operator, int]]], placed) -> None:
    """Each parameter read with a backward by several operators (``tied``: per parameter, the
    readers besides its ``owner``) is read by each as its owner reads it: the same pieces on the same
    devices, and a gradient contribution that is partial over the same devices; InfeasiblePlan
    otherwise. ``placed(op, k)``: ``(pieces, contribution)``, the (device, box) pairs ``op`` reads of
    its input ``k`` and the layout of its gradient contribution there."""
    for t, readers in tied.items():
        first, k = owner[t]
        pieces, contrib = placed(first, k)
        want = (frozenset(pieces), partial_groups(contrib))
        for op, j in readers:
            got, other = placed(op, j)
            if (frozenset(got), partial_groups(other)) != want:
                raise InfeasiblePlan(
                    f"parameter {t!r} is read with a backward by operators {first.name!r} and {op.name!r} "
                    "(tied weights) placed differently: a tied weight needs the same pieces on the same "
                    "devices for each reader (one parameter, one gradient); place them alike"
                )


def partial_groups(layout: Layout) -> frozenset[tuple[int, ...]]:
    """The groups of devices whose pieces of a gradient contribution in ``layout`` are summed (its
    partial mesh axes)."""
    axes = tuple(a for a, p in enumerate(layout.placements) if isinstance(p, Partial) and layout.mesh.shape[a] > 1)
    return frozenset(tuple(sorted(g)) for g in layout.mesh.group_map(axes).values())
