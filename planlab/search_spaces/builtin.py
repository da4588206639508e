"""Built-in spaces: data parallel, Megatron tensor parallel, 1F1B pipeline, and ``megatron``.

Each is written with the public Space API only; ``megatron`` is their product.
"""

from __future__ import annotations

import re
from typing import Callable

from planlab.graph.ir import DETACH, Graph, Operator
from planlab.plan.plan import ZERO_STAGES
from planlab.search_spaces.recycling_passes import num_passes, passes_of
from planlab.search_spaces.registry import parse_space, register_space, space_names
from planlab.search_spaces.context import ContextParallel
from planlab.search_spaces.experts import ExpertParallel, ExpertTensorParallel
from planlab.search_spaces.recompute_modules import MODULE_DOCS, MODULE_KNOBS, discards, layer_number, module_groups
from planlab.search_spaces.interleaved import interleaved_constraints, interleaved_knobs
from planlab.search_spaces.schedules import SCHEDULES
from planlab.search_spaces.schedules_v import V_SCHEDULES
from planlab.search_spaces.stages import (
    FIRST,
    LAST,
    chunk_layers,
    explored_ends,
    layer_stages,
    layers_per_stage,
    uneven_problem,
)
from planlab.search_spaces.space import Constraint, Context, Draft, Knob, Product, Space, in_graph_order
from planlab.search_spaces.space import divisors  # noqa: F401 (re-exported: alpa and the spaces read it here)


def powers_of_two_upto(n: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to ``n``."""
    out, v = [], 1
    while v <= n:
        out.append(v)
        v *= 2
    return tuple(out)


def _get(values: dict, name: str, default: int = 1) -> int:
    v = values.get(name)
    return default if v is None else v


def _uses_all(a: dict, c: Context) -> bool:
    present = [a[k] for k in DEGREES if k in a]
    if any(v is None for v in present):
        return True
    prod = 1
    for v in present:
        prod *= v
    return prod == c.num_devices


# Every device runs a piece: the degrees of the spaces in a plan multiply to the device count.
DEGREES = ("dp", "cp", "tp", "pp")
ALL_DEVICES = Constraint(
    _uses_all,
    lambda a, c: (
        "the degrees "
        + " x ".join(f"{k}={a[k]}" for k in DEGREES if k in a and (k != "cp" or a[k] != 1))
        + f" do not multiply to the {c.num_devices} devices"
    ),
)


def batch_dims(g: Graph) -> dict[str, str | None]:
    """Per operator (cached per graph), the splittable dimension that carries the batch, or None."""

    def compute() -> dict[str, str | None]:
        out = {}
        for op in g.operators:
            d = g.dim_with_label(op, g.batch_label)
            out[op.name] = d if d is not None and op.signature.splittable(d) else None
        return out

    return g.memo(("batch_dims",), compute)


class DataParallel(Space):
    """Every operator split along the batch over ``dp`` devices; ``microbatch`` samples per
    device per micro-batch (gradient accumulation over the rest); ``zero`` shards optimizer
    states (1), gradients (2) and weights (3, FSDP: gathered per layer) over the replicas (with dp > 1)."""

    name = "dp"
    order = 1
    knobs = (
        Knob.int(
            "dp",
            lambda c: divisors(c.num_devices),
            "data-parallel degree",
            default=1,
            range="divisors of the device count",
        ),
        Knob.int(
            "microbatch",
            lambda c: tuple(v for v in powers_of_two_upto(c.global_batch)),
            "micro-batch size per replica",
            range="powers of 2 up to the global batch",
        ),
        Knob.int(
            "zero",
            lambda c: ZERO_STAGES,
            "ZeRO stage: 1 shards optimizer states over dp, 2 also gradients, 3 also weights (FSDP)",
            default=0,
            range=", ".join(map(str, ZERO_STAGES)),
        ),
    )
    constraints = (
        Constraint.divides("dp", "the {n} devices", lambda c: c.num_devices),
        Constraint.divides("dp", "the global batch {n}", lambda c: c.global_batch),
        Constraint(
            lambda a, c: (
                a["dp"] is None or a["microbatch"] is None or c.global_batch % (a["dp"] * a["microbatch"]) == 0
            ),
            lambda a, c: (
                f"dp={a['dp']} x microbatch={a['microbatch']} does not divide the global batch {c.global_batch}"
            ),
        ),
        Constraint.where(
            lambda k: k["zero"] == 0 or k["dp"] > 1,
            "zero={zero} shards over the data-parallel replicas: it needs dp > 1, not dp={dp}",
        ),
        ALL_DEVICES,
    )

    def apply(self, draft: Draft, values: dict) -> None:
        dp = values.get("dp") or draft.ctx.num_devices
        mbs = values.get("microbatch") or draft.ctx.global_batch // dp
        draft.microbatches = draft.ctx.global_batch // (dp * mbs)
        draft.add_axis("dp", dp, in_graph_order(draft.ctx.graph, "batch_dims", batch_dims))
        draft.zero = values.get("zero") or 0


# Megatron-LM's column- and row-parallel linear layers, by module name (torchtitan's colwise/rowwise):
# GPT's attn.q/k/v, mlp.fc | attn.proj, mlp.proj; LLaMA's attention.wq/wk/wv, feed_forward.w1/w3 |
# attention.wo, feed_forward.w2 (grouped-query attention splits its key/value heads too); T5's
# self_attn/cross_attn.q/k/v, ff.wi(_0/_1) | .o, ff.wo; DeepSeek's
# latent attention up-projections attention.wq_b/wkv_b | attention.wo (the down-projections to the
# latents stay whole, as Megatron-Core's MLA keeps linear_q_down_proj/linear_kv_down_proj) and its
# shared experts shared_experts.w1/w3 | shared_experts.w2. Hugging Face
# models (planlab/graph/hf.py, transformers 5): LLaMA/Mixtral self_attn.q_proj/k_proj/v_proj,
# mlp.gate_proj/up_proj | self_attn.o_proj, mlp.down_proj; ViT/Swin attention.q_proj/k_proj/v_proj,
# mlp.fc1 | attention.o_proj, mlp.fc2; T5 SelfAttention/EncDecAttention.q/k/v, DenseReluDense.wi(_0/_1)
# | .o, DenseReluDense.wo.
COLWISE = re.compile(
    r"(^|\.)(attn\.(q|k|v)|mlp\.fc|attention\.(wq|wk|wv|wq_b|wkv_b)|(feed_forward|shared_experts)\.(w1|w3)|(self_attn|cross_attn)\.(q|k|v)|ff\.(wi|wi_0|wi_1)|mha\.linear_(q|k|v|g)|(msa_att_row|tri_att_start|tri_att_end)\.linear_bias|(msa|pair)_transition\.linear_1|mlp\.fc1|(self_attn|attention)\.(q_proj|k_proj|v_proj)|mlp\.(gate_proj|up_proj)|(SelfAttention|EncDecAttention)\.(q|k|v)|DenseReluDense\.(wi|wi_0|wi_1)|mlp\.c_fc)$"
)
ROWWISE = re.compile(
    r"(^|\.)(attn\.proj|mlp\.proj|attention\.wo|(feed_forward|shared_experts)\.w2|(self_attn|cross_attn)\.o|ff\.wo|mha\.linear_o|(msa|pair)_transition\.linear_2|mlp\.fc2|(self_attn|attention)\.o_proj|mlp\.down_proj|(SelfAttention|EncDecAttention)\.o|DenseReluDense\.wo|mlp\.c_proj)$"
)


def tensor_parallel_dims(g: Graph) -> dict[str, str | None]:
    """Per operator (cached per graph), the dimension Megatron's tensor parallelism splits: ``n`` of column-parallel
    linears, ``k`` of row-parallel ones, and between them the head or hidden dimension their
    outputs carry; everything else replicated."""
    return g.memo(("tensor_parallel_dims",), lambda: _tensor_parallel_dims(g))


def _tensor_parallel_dims(g: Graph) -> dict[str, str | None]:
    labels: set[str] = set()
    out: dict[str, str | None] = {}
    vocab = vocab_parallel_size(g)
    for op in g.operators:
        dim = None
        if vocab and op.kind in VOCAB_PARALLEL_OPS:
            dim = "v"
        elif vocab and is_output_layer(op, vocab):  # column-parallel over the vocabulary, as Megatron-LM's
            dim = "n"
            labels.add(g.dim_label(op, "n"))
        elif op.kind == "linear" and COLWISE.search(op.module):
            dim = "n"
            labels.add(g.dim_label(op, "n"))
        elif op.kind == "linear" and ROWWISE.search(op.module):
            dim = "k"
        elif expert_column_dim(op) is not None:  # stacked mixture-of-experts weights, see below
            dim = expert_column_dim(op)
            labels.add(g.dim_label(op, dim))
        else:
            for d in op.splittable_dims():
                if g.dim_label(op, d) in labels:
                    dim = d
                    break
        out[op.name] = dim
    return out


# Megatron-LM's vocabulary-parallel operators (planlab.models.vocab_parallel), split along ``v``;
# with them, the output layer is column-parallel over the vocabulary and its logits stay split up
# to the loss, which agrees across its pieces (planlab.executor.vocab_parallel).
VOCAB_PARALLEL_OPS = ("vocab_embedding", "vocab_cross_entropy")


def vocab_parallel_size(g: Graph) -> int | None:
    """The vocabulary of ``g``'s vocabulary-parallel loss, or None if it has none (cached per graph)."""

    def compute() -> int | None:
        loss = [op for op in g.operators if op.kind == "vocab_cross_entropy"]
        return loss[0].dim_sizes["v"] if loss else None

    return g.memo(("vocab_parallel_size",), compute)


def is_output_layer(op: Operator, vocab: int) -> bool:
    """Whether ``op`` is the output layer: a linear with ``vocab`` features outside the layers."""
    return op.kind == "linear" and op.dim_sizes.get("n") == vocab and not LAYER_MODULE.search(op.module)


# Mixture-of-experts layers (planlab.models.moe) hold their experts as stacked weights
# ``(experts, in, out)`` used by batched matmuls ``e t h, e h f -> e t f``, not by linears. The w1
# and w3 matmuls split their ffn dimension ``n`` as column-parallel linears do; the label
# propagation of tensor_parallel_dims then splits the SwiGLU product between them and the w2
# matmul's reduction ``k``, as a row-parallel linear (its output is summed by an all-reduce).
EXPERT_COLWISE = re.compile(r"(^|\.)experts\.(w1|w3)$")


def expert_column_dim(op: Operator) -> str | None:
    """``n`` for a batched matmul by stacked column-parallel expert weights, else None."""
    if op.kind == "matmul" and len(op.inputs) == 2 and EXPERT_COLWISE.search(op.inputs[1]):
        return "n"
    return None


def tp_limit(c: Context) -> int:
    """Tensor parallelism stays inside a node; on single-device nodes (the CPU cluster) it may span them."""
    return c.num_devices if c.devices_per_node == 1 else min(c.devices_per_node, c.num_devices)


def _kv_heads(c: Context) -> int | None:
    """Key/value heads of a grouped-query attention model (None if the model does not say)."""
    return getattr(c.config, "kv_heads", None)


# A fused q/k/v projection (GPT-2's Conv1D ``attn.c_attn``, Hugging Face) holds q, k and v side by side
# in one weight: its contiguous column shards would mix them, so tensor parallelism leaves that
# attention replicated and splits the MLP (c_fc column-, c_proj row-parallel) only.
FUSED_QKV = re.compile(r"(^|\.)attn\.c_attn$")


def fused_qkv(g: Graph) -> str | None:
    """The module of the graph's first fused q/k/v projection, or None (cached per graph)."""
    return g.memo(
        ("fused_qkv",),
        lambda: next((op.module for op in g.operators if op.kind == "linear" and FUSED_QKV.search(op.module)), None),
    )


class TensorParallel(Space):
    """Megatron-style tensor parallelism over ``tp`` devices inside a node, with sequence
    parallelism (``sequence_parallel``) when tp > 1."""

    name = "tp"
    order = 2
    knobs = (
        Knob.int(
            "tp",
            lambda c: powers_of_two_upto(tp_limit(c)),
            "tensor-parallel degree",
            default=1,
            range="powers of 2 up to the devices of a node",
        ),
        Knob.bool("sequence_parallel", "split the sequence where tp replicates (with tp > 1)"),
    )
    constraints = (
        Constraint.divides("tp", "the {n} devices", lambda c: c.num_devices),
        Constraint.divides("tp", "the model's {n} attention heads", lambda c: c.heads),
        Constraint.divides("tp", "the model's {n} key/value heads", _kv_heads),
        Constraint(
            lambda a, c: (
                a["tp"] is None or not vocab_parallel_size(c.graph) or vocab_parallel_size(c.graph) % a["tp"] == 0
            ),
            lambda a, c: (
                f"tp={a['tp']} does not divide the {vocab_parallel_size(c.graph)} entries of the "
                "model's vocabulary-parallel output layer and loss"
            ),
        ),
        Constraint(
            lambda a, c: a["tp"] is None or a["tp"] <= tp_limit(c),
            lambda a, c: f"tp={a['tp']} exceeds the {tp_limit(c)} devices of a node",
        ),
        Constraint.where(
            lambda k: not k["sequence_parallel"] or k["tp"] > 1,
            "sequence_parallel splits what tensor parallelism replicates: it needs tp > 1, not tp={tp}",
        ),
        Constraint.where(
            lambda k, c: not k["sequence_parallel"] or sequence_parallel_splits(c.graph),
            lambda a, c: (
                "sequence_parallel=True would split nothing in this model: no operator that "
                "tensor parallelism replicates carries the sequence of its first input"
            ),
        ),
        ALL_DEVICES,
    )

    def apply(self, draft: Draft, values: dict) -> None:
        tp = values.get("tp") or 1
        g = draft.ctx.graph
        if values.get("sequence_parallel"):
            dims = in_graph_order(g, "sequence_parallel_dims", sequence_parallel_dims)
        else:
            dims = in_graph_order(g, "tensor_parallel_dims", tensor_parallel_dims)
        draft.add_axis("tp", tp, dims)


def sequence_parallel_dims(g: Graph) -> dict[str, str | None]:
    """Megatron's sequence parallelism (cached per graph): inside the layers, the operators tensor
    parallelism replicates (norms, dropout, residual adds) split the sequence instead; materialize
    then turns each all-reduce into a reduce-scatter and an all-gather."""
    return g.memo(("sequence_parallel_dims",), lambda: _sequence_parallel_dims(g))


def _sequence_parallel_dims(g: Graph) -> dict[str, str | None]:
    dims = dict(tensor_parallel_dims(g))
    seq = g.labels.get((g.inputs[0], 1))
    for op in g.operators:
        if dims[op.name] is None and LAYER_MODULE.search(op.module):
            d = g.dim_with_label(op, seq) if seq else None
            if d is not None and op.signature.splittable(d):
                dims[op.name] = d
    return dims


LAYER_MODULE = re.compile(r"(^|\.)blocks\.(\d+)(\.|$)")  # an operator's module inside layer ``blocks.<i>``


def sequence_parallel_splits(g: Graph) -> bool:
    """Whether sequence parallelism splits anything in ``g`` that tensor parallelism replicates
    (a model without a sequence in its first input, such as Swin's images, gets the same plan)."""
    return sequence_parallel_dims(g) != tensor_parallel_dims(g)


def pipeline_stages(g: Graph, pp: int, layers: int, counts: tuple[int, ...] | None = None) -> dict[str, int]:
    """Layers split over ``pp`` stages, evenly or ``counts[s]`` layers on stage ``s``; other
    operators follow their inputs (or, with no computed inputs, their first consumer). Computed
    once per graph, degree and counts."""
    key = ("pipeline_stages", pp, layers, counts)
    return dict(g.memo(key, lambda: stages_by_layer(g, pp, layers, counts=counts)))


def stages_by_layer(
    g: Graph, pp: int, layers: int, passes: dict[str, int] | None = None, counts: tuple[int, ...] | None = None
) -> dict[str, int]:
    """Layer ``i`` in stage ``i // (layers / pp)`` (or by per-stage layer ``counts``), plus
    ``passes[op] * pp`` for a recycling model (whose ``detach`` outputs then count as no input:
    planlab/search_spaces/recycling.py)."""
    of_layer = layer_stages(layers, counts or (layers // pp,) * pp)
    stage: dict[str, int] = {}
    for op in g.operators:
        m = LAYER_MODULE.search(op.module)
        if m:
            stage[op.name] = (passes[op.name] * pp if passes else 0) + of_layer[min(int(m.group(2)), len(of_layer) - 1)]
        else:
            prods = [
                stage[g.producer[t].name]
                for t in op.inputs
                if t in g.producer and not (passes and g.producer[t].kind == DETACH)
            ]
            stage[op.name] = max(prods) if prods else -1
    for op in reversed(g.operators):
        if stage[op.name] == -1:
            cons = [stage[c.name] for t in op.outputs for c in g.consumers.get(t, [])]
            stage[op.name] = min(cons) if cons else 0
    if counts and 0 in (counts[0], counts[-1]):
        pin_ends_to_empty_stages(g, stage, counts)
    return stage


def pin_ends_to_empty_stages(g: Graph, stage: dict[str, int], counts: tuple[int, ...]) -> None:
    """A first stage of no layer runs what comes before the first layer (the embedding), a last
    stage of no layer what comes after the last (the output layer and the loss), in place."""
    in_layer = [bool(LAYER_MODULE.search(op.module)) for op in g.operators]
    if True not in in_layer:
        return
    first = in_layer.index(True)
    last = len(in_layer) - 1 - in_layer[::-1].index(True)
    for i, op in enumerate(g.operators):
        if counts[0] == 0 and i < first:
            stage[op.name] = 0
        elif counts[-1] == 0 and i > last:
            stage[op.name] = len(counts) - 1


def pipeline_schedules() -> tuple[str, ...]:
    """Every schedule the pp space can run: those of schedules.SCHEDULES, interleaved, and the
    V-shaped ones of schedules_v.V_SCHEDULES (two stages per device)."""
    return tuple(SCHEDULES) + ("interleaved",) + tuple(V_SCHEDULES)


# The schedules explored when --set schedule=... does not pick one: GPipe's bubble is 1F1B's and it
# keeps every micro-batch's activations, so Megatron-LM's grid leaves it out.
EXPLORED_SCHEDULES = ("1f1b", "interleaved")


def uneven_stage_knobs() -> tuple[Knob, Knob]:
    """Megatron-Core's layer counts of the first and last pipeline stages (0: an even share),
    explored at the balanced split of each degree that does not divide the layers."""

    def explore(which: int):
        def tried(c: Context) -> tuple[int, ...]:
            return explored_ends(c.layers, tuple(d for d in divisors(c.num_devices) if d <= c.layers))[which]

        tried.__doc__ = "0 and the balanced uneven split of each pp that does not divide the layers"
        return tried

    return tuple(
        Knob.int(
            name,
            lambda c: tuple(range(c.layers)),
            f"layers of the {end} pipeline stage (0: an even share; Megatron-Core's --decoder-{end}-pipeline-num-layers)",
            default=0,
            explore=explore(i),
            range="0 (an even share) .. layers - 1",
        )
        for i, (name, end) in enumerate(((FIRST, "first"), (LAST, "last")))
    )


def uneven_stage_constraints() -> tuple[Constraint, ...]:
    """The layers add up over the stages, every stage holds one; uneven ends with one chunk per
    device and no recycling."""
    ends = lambda a: (a.get(FIRST) or 0, a.get(LAST) or 0)  # noqa: E731
    return (
        Constraint(
            lambda a, c: a["pp"] is None or None in ends_or_none(a) or layers_per_stage(c.layers, a["pp"], *ends(a)),
            lambda a, c: uneven_problem(c.layers, a["pp"], *ends(a)) or "",
        ),
        Constraint(
            lambda a, c: ends(a) == (0, 0) or _recycles(c) == 1 and uneven_chunks_fit(c.layers, a),
            lambda a, c: (
                f"{FIRST}={ends(a)[0]}, {LAST}={ends(a)[1]} with virtual_stages={a['virtual_stages']}: "
                + (
                    "uneven end stages need a model that does not recycle"
                    if _recycles(c) > 1
                    else "each device's layers must split into its model chunks evenly, but for the first "
                    "device's first chunk and the last device's last chunk (0 to a chunk's layers each); "
                    "choose virtual_stages=1 or one that divides the middle stages' layers"
                )
            ),
        ),
    )


def _schedule_constraint(schedules: tuple[str, ...], holds: Callable, message: Callable) -> Constraint:
    """``holds(a, c)`` for plans whose schedule is one of ``schedules``, once their pp is assigned."""
    return Constraint(lambda a, c: a["schedule"] not in schedules or a["pp"] is None or holds(a, c), message)


def v_schedule_constraint() -> Constraint:
    """A V-shaped schedule holds two stages per device: ``2 pp`` stages must divide the layers."""
    return _schedule_constraint(
        tuple(s for s in V_SCHEDULES if s != "dualpipe"),
        lambda a, c: c.layers % (2 * a["pp"]) == 0 and ends_or_none(a) in ((0, 0), (None, None), (0, None), (None, 0)),
        lambda a, c: (
            f"schedule={a['schedule']} holds two stages per device: its 2 x pp={a['pp']} stages must divide "
            f"the model's {c.layers} layers evenly (no {FIRST} / {LAST})"
        ),
    )


def dualpipe_constraint() -> Constraint:
    """DualPipe mirrors the stages over an even number of ranks and splits every micro-batch in two."""
    return _schedule_constraint(
        ("dualpipe",),
        lambda a, c: a.get("microbatch") is None or (a["pp"] % 2 == 0 and a["microbatch"] % 2 == 0),
        lambda a, c: (
            f"schedule=dualpipe holds stages r and pp - 1 - r on rank r and feeds half of every micro-batch "
            f"from each end: it needs an even pp and an even microbatch, not pp={a['pp']}, microbatch={a.get('microbatch')}"
        ),
    )


def uneven_chunks_fit(layers: int, a: dict) -> bool:
    """Whether uneven end stages split into ``virtual_stages`` model chunks a device
    (:func:`planlab.search_spaces.stages.chunk_layers`); true while a knob is unassigned."""
    v, pp = a["virtual_stages"], a["pp"]
    if v in (None, 1) or pp is None or None in ends_or_none(a):
        return True
    counts = layers_per_stage(layers, pp, a.get(FIRST) or 0, a.get(LAST) or 0)
    return counts is None or chunk_layers(counts, v) is not None


def ends_or_none(a: dict) -> tuple:
    """The first and last stage's layer counts, None where not assigned yet."""
    return a.get(FIRST), a.get(LAST)


def uneven_counts(layers: int, pp: int, values: dict) -> tuple[int, ...] | None:
    """Per-stage layer counts for the knobs in ``values`` (None: an even split)."""
    first, last = values.get(FIRST) or 0, values.get(LAST) or 0
    if not (first or last):
        return None
    return layers_per_stage(layers, pp, first, last)


class PipelineParallel(Space):
    """Layers in ``pp`` stages, run with 1F1B or interleaved 1F1B over ``virtual_stages`` model
    chunks per device (explored); GPipe, zero-bubble ZB-H1 (backward split into input and
    weight gradients), ZB-V and DualPipe (two stages per device, planlab/search_spaces/schedules_v.py)
    when ``--set schedule=`` (or ``restrict``) picks them. ``first_stage_layers`` and
    ``last_stage_layers`` make the end stages uneven (planlab/search_spaces/stages.py)."""

    name = "pp"
    order = 0
    knobs = (
        Knob.int(
            "pp",
            lambda c: tuple(d for d in divisors(c.num_devices) if d <= c.layers),
            "pipeline-parallel degree (device groups)",
            default=1,
            range="divisors of the device count up to the layers (that divide them, or with uneven end stages)",
        ),
        Knob.choice(
            "schedule", lambda c: pipeline_schedules(), "pipeline schedule", default="1f1b", explore=EXPLORED_SCHEDULES
        ),
        Knob.int(
            "virtual_stages",
            # with uneven ends: one layer fewer at each end (layers + 2), or one fewer in the first chunk and
            # two in the last, as Megatron-Bridge's DeepSeek-V3 layout 'Et|(tt|)*30mL' (layers + 3)
            lambda c: tuple(v for v in (1, 2, 3, 4, 6, 8) if any((c.layers + d) % v == 0 for d in (0, 2, 3))),
            "model chunks per device (interleaved schedule)",
            default=1,
            range="1, 2, 3, 4, 6 or 8 that divide the layers (or the layers + 2 or + 3, with uneven end stages)",
        ),
        *uneven_stage_knobs(),
        *interleaved_knobs(),
    )
    constraints = (
        Constraint.divides("pp", "the {n} devices", lambda c: c.num_devices),
        *uneven_stage_constraints(),
        v_schedule_constraint(),
        dualpipe_constraint(),
        Constraint(
            lambda a, c: (
                a["pp"] is None
                or a["virtual_stages"] in (None, 1)
                or c.layers % (a["pp"] * a["virtual_stages"]) == 0
                or a.get(FIRST) is None  # not decided before the end stages' knobs are
                or a.get(LAST) is None
                or (a[FIRST] or a[LAST])  # uneven ends: uneven_stage_constraints
            ),
            lambda a, c: (
                f"pp={a['pp']} x virtual_stages={a['virtual_stages']} does not divide the model's {c.layers} layers"
            ),
        ),
        Constraint(
            lambda a, c: (
                a["schedule"] is None
                or a["virtual_stages"] is None
                or (a["schedule"] == "interleaved") == (a["virtual_stages"] > 1)
            ),
            lambda a, c: (
                f"virtual_stages={a['virtual_stages']} goes with schedule=interleaved "
                f"(and only with it), not schedule={a['schedule']}"
            ),
        ),
        *interleaved_constraints(),
        Constraint.where(
            lambda k: k["schedule"] == "1f1b" or k["pp"] > 1,
            "schedule={schedule} orders pipeline stages: it needs pp > 1, not pp={pp}",
        ),
        Constraint(
            lambda a, c: (
                _recycles(c) == 1
                or a["pp"] in (None, 1)
                or (a["schedule"] != "interleaved" and a["virtual_stages"] in (None, 1))
            ),
            lambda a, c: (
                f"the model {c.model} recycles its trunk {_recycles(c)} times: each pass is a model "
                f"chunk already, so schedule={a['schedule']} with virtual_stages="
                f"{a['virtual_stages']} is not available; use 1f1b, gpipe or zb-h1 (or the 3f1b space)"
            ),
        ),
        ALL_DEVICES,
    )

    def apply(self, draft: Draft, values: dict) -> None:
        pp = values.get("pp") or 1
        if pp > 1 and _recycles(draft.ctx) > 1:  # a chunk per recycling pass, planlab/search_spaces/recycling.py
            stage_recycling(draft, pp, values.get("schedule") or "1f1b")
            return
        v = values.get("virtual_stages") or 1
        if values.get("schedule") == "dualpipe" and pp > 1:  # two mirrored copies: halves of each micro-batch
            draft.mirror = True
            draft.add_axis("dual", 2, batch_dims(draft.ctx.graph))
        elif values.get("schedule") in V_SCHEDULES:  # two stages per device group, in a V
            v, draft.vshape = 2, True
        draft.num_stages = pp * v
        draft.chunks = v
        draft.group = (values.get("pipeline_group") or 0) if v > 1 else 0
        draft.paired = bool(values.get("expert_overlap")) and v > 1
        draft.schedule = values.get("schedule") or "1f1b"
        if pp * v > 1:
            counts = uneven_counts(draft.ctx.layers, pp, values)
            if counts is not None and v > 1:
                counts = chunk_layers(counts, v)
            draft.stages = pipeline_stages(draft.ctx.graph, pp * v, draft.ctx.layers, counts)


def _recycles(c: Context) -> int:
    """The model's recycling passes (AlphaFold2, planlab/search_spaces/recycling.py)."""
    return num_passes(c.graph)


def recycling_stages(g: Graph, pp: int, layers: int) -> dict[str, int]:
    """Stage ``pass * pp + layer // (layers / pp)`` for the layers; other operators follow their
    computed inputs, except that a ``detach`` output counts as none (the next pass's recycling
    embedder runs where that pass starts), else their first consumer. Computed once per graph and
    degree (a fresh dict each call, which the draft may change)."""
    key = ("recycling_stages", pp, layers)
    return dict(g.memo(key, lambda: stages_by_layer(g, pp, layers, passes_of(g))))


def stage_recycling(draft: Draft, pp: int, schedule: str) -> None:
    """Stage a recycling model's passes over ``pp`` device groups (a chunk per pass)."""
    g = draft.ctx.graph
    r = num_passes(g)
    draft.num_stages, draft.chunks, draft.recycles, draft.schedule = r * pp, r, r, schedule
    draft.stages = recycling_stages(g, pp, draft.ctx.layers)


ATTENTION_CORE = ("attention", "softmax")


class Recompute(Space):
    """Activation recomputation per transformer layer: ``none``, ``selective`` (the attention
    core only, as Megatron-LM's selective recompute) or ``full`` (every operator of the layer;
    only the layer's input is kept)."""

    name = "recompute"
    order = 3
    knobs = (
        Knob.choice("recompute", ("none", "selective", "full"), "activation recomputation", default="none"),
        Knob.bool("recompute_moe_act", "recompute the experts' activation (Megatron-Core's moe_act)", pinned=True),
        Knob.bool("recompute_mlp", "recompute the dense layers' MLP (Megatron-Core's mlp)", pinned=True),
        Knob.bool(
            "recompute_mla_up_proj", "recompute MLA's up-projections, freeing their outputs (mla_up_proj)", pinned=True
        ),
    )
    constraints = (
        Constraint(
            lambda a, c: a["recompute"] in (None, "none", "selective", "full"),
            lambda a, c: f"recompute={a['recompute']!r}: choose 'none', 'selective' or 'full'",
        ),
        Constraint(
            lambda a, c: not any(a.get(k) for k in MODULE_KNOBS) or a.get("recompute") != "full",
            lambda a, c: (
                "recompute='full' recomputes every operator of a layer already; leave the recompute_* "
                "module knobs false"
            ),
        ),
        Constraint(
            lambda a, c: all(not a.get(k) or module_groups(c.graph, k) for k in MODULE_KNOBS),
            lambda a, c: "; ".join(
                f"{k}=true: the model has no {MODULE_DOCS[k]}; leave it false"
                for k in MODULE_KNOBS
                if a.get(k) and not module_groups(c.graph, k)
            ),
        ),
    )

    def apply(self, draft: Draft, values: dict) -> None:
        mode = values.get("recompute") or "none"
        g = draft.ctx.graph
        if mode != "none":
            draft.recompute.update(recompute_groups(g, mode))
        for knob in MODULE_KNOBS:
            if values.get(knob):
                groups = module_groups(g, knob, alone=mode == "none")
                draft.recompute.update(groups)
                if discards(knob, mode):
                    draft.discard_outputs.update(groups.values())


def recompute_groups(g: Graph, mode: str) -> dict[str, int]:
    """Per recomputed operator (cached per graph and mode), its group: its layer's number + 1."""

    def compute() -> dict[str, int]:
        out = {}
        for op in g.operators:
            layer = layer_number(g, op.module)  # a multi-token-prediction module's layer too
            if layer is not None and (mode == "full" or op.kind in ATTENTION_CORE):
                out[op.name] = layer + 1
        return out

    return g.memo(("recompute_groups", mode), compute)


class Offload(Space):
    """ZeRO-Offload (Ren et al., USENIX ATC'21): ``offload_optimizer`` keeps the fp32 master
    weights and Adam's states in host memory and steps them on the host CPU, the gradients copied
    device to host after their reduction and the weights back; composes with ZeRO 0 to 3 (``megatron*offload``). Priced on the cluster's host link and CPU."""

    name = "offload"
    order = 4
    knobs = (Knob.bool("offload_optimizer", "optimizer states and step in host memory (ZeRO-Offload)"),)

    def apply(self, draft: Draft, values: dict) -> None:
        draft.offload_optimizer = bool(values.get("offload_optimizer"))


class Megatron(Product):
    """The Megatron-LM and DeepSpeed grid: data (ZeRO) x tensor (sequence parallel) x pipeline
    (1F1B, interleaved) parallelism x recomputation, context parallelism (planlab/search_spaces/context.py), with expert (and expert tensor) parallelism
    for mixture-of-experts models (planlab/search_spaces/experts.py)."""

    def __init__(self) -> None:
        super().__init__(
            (
                PipelineParallel(),
                DataParallel(),
                ExpertParallel(),
                TensorParallel(),
                ExpertTensorParallel(),
                ContextParallel(),
                Recompute(),
            ),
            name="megatron",
        )


# The built-in spaces; another module registers its own with one line: register_space(name, factory).
BUILTIN: dict[str, type[Space]] = {
    "dp": DataParallel,
    "tp": TensorParallel,
    "pp": PipelineParallel,
    "recompute": Recompute,
    "megatron": Megatron,
    "offload": Offload,
}
for _name, _factory in BUILTIN.items():
    register_space(_name, _factory)


def get_space(spec: str) -> Space:
    """A registered name, a product ``a*b``, a union ``a|b``, or ``package.module:attribute`` for a
    user's space (see :func:`planlab.search_spaces.registry.parse_space`)."""
    return parse_space(spec)


def list_spaces() -> list[Space]:
    """Every registered space (built-in ones first)."""
    from planlab.search_spaces.registry import make_space

    return [make_space(name) for name in space_names()]
