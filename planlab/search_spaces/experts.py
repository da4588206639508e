"""Expert parallelism (``ep``) and expert tensor parallelism (``etp``), as Megatron-Core composes them.

Megatron-Core (``megatron/core/parallel_state.py``, "MoE parallel folding") lays the expert
layers' ranks out on the same devices as the attention's: an expert layer's grid is
``etp x ep x edp`` over the ``tp x dp`` devices of a pipeline stage (context parallelism aside).
Expert parallelism takes its ranks from the data-parallel replicas (and, with ``etp`` below
``tp``, from the tensor-parallel ranks), so the attention still sees ``dp`` replicas while each
expert's weights live on ``edp = tp x dp / (etp x ep)`` devices, whose gradients are reduced over
that expert-data-parallel group alone.

Here a plan says the same with two mesh axes where the data-parallel axis was: ``dp / ep_dp``
(the batch, for every operator) and, inside it, ``ep_dp`` (the batch for the attention and the
router, the expert axis for the operators between the dispatch and the combine). Where the
router's tokens (split along the batch) meet the experts (split along the expert axis),
materialize converts the layout on that axis: an all-to-all, the dispatch; after the experts,
the combine. With ``etp = 1`` the tensor-parallel axis splits the experts too (``ep = ep_dp x
tp``), and the tokens on their way to and from the experts are split over the tensor-parallel
ranks along the hidden size (:func:`token_hidden_dims`; the routing needs whole sequences, so
it cannot be the sequence): the dispatch and the combine are then each one all-to-all over the
``ep_dp x tp`` ranks in which every rank sends its own share, as Megatron-Core's dispatcher sends
each rank's own tokens over one group of all TP and EP ranks, not the buffer two tensor-parallel
ranks would both hold. ``etp`` other than 1 and ``tp`` is not run (it needs a third axis), and is
refused.
"""

from __future__ import annotations

import re

from planlab.errors import InfeasiblePlan
from planlab.graph.ir import Graph
from planlab.search_spaces.space import Constraint, Context, Draft, Knob, Space, divisors

# The stacked expert weights of planlab's MoE families, ``(experts, in, out)`` (planlab.models.moe).
EXPERT_WEIGHTS = re.compile(r"(^|\.)experts\.(w1|w2|w3)$")


def expert_dims(g: Graph) -> dict[str, str]:
    """Per operator that carries the experts' axis (the axis 0 of the stacked expert weights),
    the name of its dimension with that axis, if it may be split (memoized on the graph)."""
    return dict(g.memo(("expert_dims",), lambda: _expert_dims(g)))


def _expert_dims(g: Graph) -> dict[str, str]:
    labels = {g.labels[(t, 0)] for t in g.tensors if EXPERT_WEIGHTS.search(t) and (t, 0) in g.labels}
    out: dict[str, str] = {}
    for op in g.operators:
        for label in labels:
            d = g.dim_with_label(op, label)
            if d is not None and op.signature.splittable(d):
                out[op.name] = d
                break
    return out


def token_hidden_dims(g: Graph) -> dict[str, str]:
    """Per operator on the tokens' way into and out of the experts inside the mixture-of-experts
    layer, the dimension with the experts' hidden axis (axis 1 of the stacked ``w1``, the model's
    hidden size): the producers of the expert operators' inputs, back from them (the dispatch's
    scatter, the tokens' top-k copies into it), and the consumers of their outputs, on from them
    (the combine's gather, weighting and sum over the top k), each way as far as operators of the
    same module may split that axis (memoized on the graph)."""
    return dict(g.memo(("token_hidden_dims",), lambda: _token_hidden_dims(g)))


def _token_hidden_dims(g: Graph) -> dict[str, str]:
    w1 = next((t for t in g.tensors if EXPERT_WEIGHTS.search(t) and t.endswith("w1")), None)
    label = g.labels.get((w1, 1)) if w1 else None
    region = expert_dims(g)
    if label is None or not region:
        return {}
    out: dict[str, str] = {}

    def walk(ops: list, step) -> None:  # ops: (operator, the module of the one it was reached from)
        while ops:
            op, module = ops.pop()
            d = g.dim_with_label(op, label)
            if op.name in region or op.name in out or op.module != module or d is None:
                continue
            if op.signature.splittable(d):
                out[op.name] = d
                ops.extend((nxt, op.module) for nxt in step(op))

    def producers(op) -> list:
        return [g.producer[t] for t in op.inputs if t in g.producer]

    def consumers(op) -> list:
        return [c for t in op.outputs for c in g.consumers.get(t, ())]

    experts = [g.op(name) for name in region]
    walk([(p, op.module) for op in experts for p in producers(op)], producers)
    walk([(c, op.module) for op in experts for c in consumers(op)], consumers)
    return out


def num_experts(g: Graph) -> int:
    """The routed experts per layer (0 for a model without stacked expert weights). Memoized on
    the graph: the grid's constraints ask for it on every partial assignment (a scan of every
    tensor name took 11 ms on GPT-3 175B, most of the enumeration's time)."""
    return g.memo(("num_experts",), lambda: _num_experts(g))


def _num_experts(g: Graph) -> int:
    return next((g.tensors[t].shape[0] for t in g.tensors if EXPERT_WEIGHTS.search(t)), 0)


def _ep_values(c: Context) -> tuple[int, ...]:
    e = num_experts(c.graph)
    return tuple(d for d in divisors(c.num_devices) if e % d == 0) if e else (1,)


def _tp_over_etp(a: dict) -> int:
    """The tensor-parallel ranks the experts are split over by expert: ``tp / etp`` (1 with etp = tp)."""
    tp, etp = a.get("tp") or 1, a.get("etp")
    return 1 if etp is None or etp == tp else tp


def ep_over_dp(a: dict) -> int:
    """The data-parallel replicas the experts are split over: ``ep / (tp / etp)``."""
    return (a.get("ep") or 1) // _tp_over_etp(a)


def _known(a: dict, *names: str) -> bool:
    return all(a.get(n) is not None for n in names)


class ExpertParallel(Space):
    """Routed experts split over ``ep`` devices taken from the data-parallel replicas (and from
    the tensor-parallel ranks when ``etp`` = 1); tokens dispatched to their experts and combined
    back by all-to-all; expert weights' gradients reduced over the expert-data-parallel group."""

    name = "ep"
    order = 1  # right after dp: it splits the data-parallel axis in two
    knobs = (
        Knob.int(
            "ep",
            _ep_values,
            "expert-parallel degree (routed experts split over ep devices; all-to-all dispatch and combine)",
            default=1,
            range="divisors of the device count that divide the experts (1 without experts)",
        ),
    )
    constraints = (
        Constraint(
            lambda a, c: a["ep"] is None or a["ep"] == 1 or num_experts(c.graph) > 0,
            lambda a, c: f"ep={a['ep']} splits routed experts, and the model {c.model} has none; choose ep=1",
        ),
        Constraint(
            lambda a, c: a["ep"] is None or num_experts(c.graph) == 0 or num_experts(c.graph) % a["ep"] == 0,
            lambda a, c: (
                f"ep={a['ep']} does not divide the model's {num_experts(c.graph)} experts; choose "
                + ", ".join(map(str, _ep_values(c)))
            ),
        ),
        Constraint(
            lambda a, c: (
                not _known(a, "ep", "tp") or num_experts(c.graph) == 0 or (a["ep"] or 1) % _tp_over_etp(a) == 0
            ),
            lambda a, c: (
                f"ep={a['ep']} with etp=1 and tp={a['tp']}: the experts are split over the tensor-parallel "
                f"ranks too, so ep must be a multiple of tp={a['tp']}"
            ),
        ),
        Constraint(
            lambda a, c: not _known(a, "ep", "dp") or a["dp"] % max(1, ep_over_dp(a)) == 0,
            lambda a, c: (
                f"ep={a['ep']} takes {ep_over_dp(a)} data-parallel replicas to split the experts over, "
                f"which does not divide dp={a['dp']} (ep / (tp / etp) must divide dp)"
            ),
        ),
    )

    def apply(self, draft: Draft, values: dict) -> None:
        n = ep_over_dp(values)
        if n <= 1 or not num_experts(draft.ctx.graph):
            return
        names = [name for name, _ in draft.axes]
        if "dp" not in names:
            raise InfeasiblePlan(f"ep={values.get('ep')} splits the data-parallel axis, and the plan has none")
        i = names.index("dp")
        dp, batch = draft.axes[i][1], draft.axis_dims[i]
        experts = expert_dims(draft.ctx.graph)
        # the data-parallel axis becomes dp / n (the batch) and n inside it (the batch, or the experts)
        del draft.axes[i], draft.axis_dims[i]
        ops = draft.ctx.graph.operators
        draft.add_axis("dp", dp // n, dict(zip((op.name for op in ops), batch)))
        draft.add_axis("ep", n, {op.name: experts.get(op.name, d) for op, d in zip(ops, batch)})
        # add_axis appends [dp, ep]: move them, in that order, back where the data-parallel axis was
        for _ in range(2):
            draft.axes.insert(i, draft.axes.pop())
            draft.axis_dims.insert(i, draft.axis_dims.pop())


class ExpertTensorParallel(Space):
    """``etp``: the experts' ffn split over the tensor-parallel ranks as tp splits it (etp = tp,
    Megatron-Core's default), or the experts whole and split by expert over those ranks (etp = 1)."""

    name = "etp"
    order = 2  # after tp: it edits what the tensor-parallel axis splits in the expert layers
    knobs = (
        Knob.int(
            "etp",
            lambda c: (1, 2, 4, 8, 16, 32, 64) if num_experts(c.graph) else (1,),
            "expert tensor-parallel degree: tp (the experts' ffn split like tp's) or 1 (split by expert)",
            range="1 or tp (1 without experts)",
        ),
    )
    constraints = (
        Constraint(
            lambda a, c: not _known(a, "etp") or num_experts(c.graph) == 0 or a["etp"] in (1, a.get("tp") or 1),
            lambda a, c: (
                f"etp={a['etp']}: planlab runs etp=tp={a.get('tp') or 1} (the experts' ffn split as tp splits "
                "it, Megatron-Core's default) or etp=1 (the experts split by expert over the tensor-parallel ranks)"
            ),
        ),
    )

    def apply(self, draft: Draft, values: dict) -> None:
        if _tp_over_etp(values) == 1 or not num_experts(draft.ctx.graph):
            return
        names = [name for name, _ in draft.axes]
        t = names.index("tp")
        for op, d in expert_dims(draft.ctx.graph).items():
            draft.dims[op][t] = d
        # the tokens on their way to and from the experts, split over the tensor-parallel ranks along
        # the hidden size (where they were whole, or split along the sequence: the routing needs a
        # whole sequence): each rank sends its own share to the experts in one all-to-all over the
        # ep x tp ranks, as Megatron-Core's dispatcher sends each rank's own tokens
        for op, d in token_hidden_dims(draft.ctx.graph).items():
            draft.dims[op][t] = d
