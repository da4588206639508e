"""Built-in spaces: data parallel, Megatron tensor parallel, 1F1B pipeline, and ``megatron``.

Each is written with the public Space API only; ``megatron`` is their product.
"""

from __future__ import annotations

import re

from planlab.graph.ir import DETACH, Graph, Operator
from planlab.plan.plan import ZERO_STAGES
from planlab.search_spaces.recycling_passes import num_passes, passes_of
from planlab.search_spaces.registry import parse_space, register_space, space_names
from planlab.search_spaces.experts import ExpertParallel, ExpertTensorParallel
from planlab.search_spaces.schedules import SCHEDULES
from planlab.search_spaces.space import Constraint, Context, Draft, Knob, Product, Space


def divisors(n: int) -> tuple[int, ...]:
    """The divisors of ``n``, ascending."""
    return tuple(d for d in range(1, n + 1) if n % d == 0)


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
    present = [a[k] for k in ("dp", "tp", "pp") if k in a]
    if any(v is None for v in present):
        return True
    prod = 1
    for v in present:
        prod *= v
    return prod == c.num_devices


# Every device runs a piece: the degrees of the spaces in a plan multiply to the device count.
ALL_DEVICES = Constraint(
    _uses_all,
    lambda a, c: (
        "the degrees "
        + " x ".join(f"{k}={a[k]}" for k in ("dp", "tp", "pp") if k in a)
        + f" do not multiply to the {c.num_devices} devices"
    ),
)


_BATCH_DIMS: dict[int, tuple[Graph, dict[str, str | None]]] = {}


def batch_dims(g: Graph) -> dict[str, str | None]:
    """Per operator (cached per graph), the splittable dimension that carries the batch, or None."""
    hit = _BATCH_DIMS.get(id(g))
    if hit is None or hit[0] is not g:
        out = {}
        for op in g.operators:
            d = g.dim_with_label(op, g.batch_label)
            out[op.name] = d if d is not None and op.signature.splittable(d) else None
        _BATCH_DIMS.clear()
        hit = _BATCH_DIMS[id(g)] = (g, out)
    return hit[1]


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
        Constraint(
            lambda a, c: a["dp"] is None or c.num_devices % a["dp"] == 0,
            lambda a, c: f"dp={a['dp']} does not divide the {c.num_devices} devices",
        ),
        Constraint(
            lambda a, c: a["dp"] is None or c.global_batch % a["dp"] == 0,
            lambda a, c: f"dp={a['dp']} does not divide the global batch {c.global_batch}",
        ),
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
        dims = batch_dims(draft.ctx.graph)
        draft.add_axis("dp", dp, dims)
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


_TP_CACHE: dict[int, tuple[Graph, dict[str, str | None]]] = {}


def tensor_parallel_dims(g: Graph) -> dict[str, str | None]:
    """Per operator (cached per graph), the dimension Megatron's tensor parallelism splits: ``n`` of column-parallel
    linears, ``k`` of row-parallel ones, and between them the head or hidden dimension their
    outputs carry; everything else replicated."""
    hit = _TP_CACHE.get(id(g))
    if hit is not None and hit[0] is g:
        return hit[1]
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
    _TP_CACHE.clear()  # one graph at a time is plenty
    _TP_CACHE[id(g)] = (g, out)
    return out


# Megatron-LM's vocabulary-parallel operators (planlab.models.vocab_parallel), split along ``v``;
# with them, the output layer is column-parallel over the vocabulary and its logits stay split up
# to the loss, which agrees across its pieces (planlab.executor.vocab_parallel).
VOCAB_PARALLEL_OPS = ("vocab_embedding", "vocab_cross_entropy")


_VP_CACHE: dict[int, tuple[Graph, int | None]] = {}


def vocab_parallel_size(g: Graph) -> int | None:
    """The vocabulary of ``g``'s vocabulary-parallel loss, or None if it has none (cached per graph)."""
    hit = _VP_CACHE.get(id(g))
    if hit is None or hit[0] is not g:
        loss = [op for op in g.operators if op.kind == "vocab_cross_entropy"]
        _VP_CACHE.clear()
        hit = _VP_CACHE[id(g)] = (g, loss[0].dim_sizes["v"] if loss else None)
    return hit[1]


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
    return getattr(c.model.config(), "kv_heads", None)


# A fused q/k/v projection (GPT-2's Conv1D ``attn.c_attn``, Hugging Face) holds q, k and v side by side
# in one weight: its contiguous column shards would mix them, so tensor parallelism leaves that
# attention replicated and splits the MLP (c_fc column-, c_proj row-parallel) only.
FUSED_QKV = re.compile(r"(^|\.)attn\.c_attn$")
_FUSED_CACHE: dict[int, tuple[Graph, str | None]] = {}


def fused_qkv(g: Graph) -> str | None:
    """The module of the graph's first fused q/k/v projection, or None (cached per graph)."""
    hit = _FUSED_CACHE.get(id(g))
    if hit is None or hit[0] is not g:
        _FUSED_CACHE.clear()
        hit = _FUSED_CACHE[id(g)] = (
            g,
            next((op.module for op in g.operators if op.kind == "linear" and FUSED_QKV.search(op.module)), None),
        )
    return hit[1]


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
        Constraint(
            lambda a, c: a["tp"] is None or c.num_devices % a["tp"] == 0,
            lambda a, c: f"tp={a['tp']} does not divide the {c.num_devices} devices",
        ),
        Constraint(
            lambda a, c: a["tp"] is None or c.heads % a["tp"] == 0,
            lambda a, c: f"tp={a['tp']} does not divide the model's {c.heads} attention heads",
        ),
        Constraint(
            lambda a, c: a["tp"] is None or _kv_heads(c) is None or _kv_heads(c) % a["tp"] == 0,
            lambda a, c: f"tp={a['tp']} does not divide the model's {_kv_heads(c)} key/value heads",
        ),
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
        dims = sequence_parallel_dims(g) if values.get("sequence_parallel") else tensor_parallel_dims(g)
        draft.add_axis("tp", tp, dims)


_SP_CACHE: dict[int, tuple[Graph, dict[str, str | None]]] = {}


def sequence_parallel_dims(g: Graph) -> dict[str, str | None]:
    """Megatron's sequence parallelism (cached per graph): inside the layers, the operators tensor
    parallelism replicates (norms, dropout, residual adds) split the sequence instead; materialize
    then turns each all-reduce into a reduce-scatter and an all-gather."""
    hit = _SP_CACHE.get(id(g))
    if hit is not None and hit[0] is g:
        return hit[1]
    dims = dict(tensor_parallel_dims(g))
    seq = g.labels.get((g.inputs[0], 1))
    for op in g.operators:
        if dims[op.name] is None and LAYER_MODULE.search(op.module):
            d = g.dim_with_label(op, seq) if seq else None
            if d is not None and op.signature.splittable(d):
                dims[op.name] = d
    _SP_CACHE.clear()
    _SP_CACHE[id(g)] = (g, dims)
    return dims


LAYER_MODULE = re.compile(r"(^|\.)blocks\.(\d+)(\.|$)")  # an operator's module inside layer ``blocks.<i>``


def sequence_parallel_splits(g: Graph) -> bool:
    """Whether sequence parallelism splits anything in ``g`` that tensor parallelism replicates
    (a model without a sequence in its first input, such as Swin's images, gets the same plan)."""
    return sequence_parallel_dims(g) != tensor_parallel_dims(g)


_STAGES_CACHE: dict[tuple[int, int, int], tuple[Graph, dict[str, int]]] = {}


def pipeline_stages(g: Graph, pp: int, layers: int) -> dict[str, int]:
    """Layers split evenly over ``pp`` stages; other operators follow their inputs
    (or, with no computed inputs, their first consumer). Computed once per graph and degree."""
    hit = _STAGES_CACHE.get((id(g), pp, layers))
    if hit is None or hit[0] is not g:
        if len(_STAGES_CACHE) > 64 or any(v[0] is not g for v in _STAGES_CACHE.values()):
            _STAGES_CACHE.clear()
        hit = _STAGES_CACHE[(id(g), pp, layers)] = (g, stages_by_layer(g, pp, layers))
    return dict(hit[1])


def stages_by_layer(g: Graph, pp: int, layers: int, passes: dict[str, int] | None = None) -> dict[str, int]:
    """Layer ``i`` in stage ``i // (layers / pp)``, plus ``passes[op] * pp`` for a recycling model
    (whose ``detach`` outputs then count as no input: planlab/search_spaces/recycling.py)."""
    per = layers // pp
    stage: dict[str, int] = {}
    for op in g.operators:
        m = LAYER_MODULE.search(op.module)
        if m:
            stage[op.name] = (passes[op.name] * pp if passes else 0) + int(m.group(2)) // per
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
    return stage


def pipeline_schedules() -> tuple[str, ...]:
    """Every schedule the pp space can run: those of schedules.SCHEDULES, and interleaved."""
    return tuple(SCHEDULES) + ("interleaved",)


# The schedules explored when --set schedule=... does not pick one: GPipe's bubble is 1F1B's and it
# keeps every micro-batch's activations, so Megatron-LM's grid leaves it out.
EXPLORED_SCHEDULES = ("1f1b", "interleaved")


class PipelineParallel(Space):
    """Layers in ``pp`` stages, run with 1F1B or interleaved 1F1B over ``virtual_stages`` model
    chunks per device (explored); GPipe and zero-bubble ZB-H1 (backward split into input and
    weight gradients) when ``--set schedule=`` (or ``restrict``) picks them."""

    name = "pp"
    order = 0
    knobs = (
        Knob.int(
            "pp",
            lambda c: tuple(d for d in divisors(c.num_devices) if c.layers % d == 0),
            "pipeline-parallel degree (device groups)",
            default=1,
            range="divisors of the device count that divide the layers",
        ),
        Knob.choice(
            "schedule", lambda c: pipeline_schedules(), "pipeline schedule", default="1f1b", explore=EXPLORED_SCHEDULES
        ),
        Knob.int(
            "virtual_stages",
            lambda c: tuple(v for v in (1, 2, 3, 4, 6, 8) if c.layers % v == 0),
            "model chunks per device (interleaved schedule)",
            default=1,
            range="1, 2, 3, 4, 6 or 8 that divide the layers",
        ),
    )
    constraints = (
        Constraint(
            lambda a, c: a["pp"] is None or c.num_devices % a["pp"] == 0,
            lambda a, c: f"pp={a['pp']} does not divide the {c.num_devices} devices",
        ),
        Constraint(
            lambda a, c: a["pp"] is None or c.layers % a["pp"] == 0,
            lambda a, c: f"pp={a['pp']} does not divide the model's {c.layers} layers",
        ),
        Constraint(
            lambda a, c: (
                a["pp"] is None or a["virtual_stages"] is None or c.layers % (a["pp"] * a["virtual_stages"]) == 0
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
        Constraint(
            lambda a, c: (
                a["schedule"] != "interleaved"
                or a["pp"] is None
                or a.get("microbatch") is None
                or a.get("dp") is None
                or (c.global_batch // (a["dp"] * a["microbatch"])) % a["pp"] == 0
            ),
            lambda a, c: "the interleaved schedule needs the number of micro-batches to divide by pp",
        ),
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
        draft.num_stages = pp * v
        draft.chunks = v
        draft.schedule = values.get("schedule") or "1f1b"
        if pp * v > 1:
            draft.stages = pipeline_stages(draft.ctx.graph, pp * v, draft.ctx.layers)


def _recycles(c: Context) -> int:
    """The model's recycling passes (AlphaFold2, planlab/search_spaces/recycling.py)."""
    return num_passes(c.graph)


def recycling_stages(g: Graph, pp: int, layers: int) -> dict[str, int]:
    """Stage ``pass * pp + layer // (layers / pp)`` for the layers; other operators follow their
    computed inputs, except that a ``detach`` output counts as none (the next pass's recycling
    embedder runs where that pass starts), else their first consumer."""
    return stages_by_layer(g, pp, layers, passes_of(g))


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
    knobs = (Knob.choice("recompute", ("none", "selective", "full"), "activation recomputation", default="none"),)
    constraints = (
        Constraint(
            lambda a, c: a["recompute"] in (None, "none", "selective", "full"),
            lambda a, c: f"recompute={a['recompute']!r}: choose 'none', 'selective' or 'full'",
        ),
    )

    def apply(self, draft: Draft, values: dict) -> None:
        mode = values.get("recompute") or "none"
        if mode != "none":
            draft.recompute.update(recompute_groups(draft.ctx.graph, mode))


_RECOMPUTE_CACHE: dict[tuple[int, str], tuple[Graph, dict[str, int]]] = {}


def recompute_groups(g: Graph, mode: str) -> dict[str, int]:
    """Per recomputed operator (cached per graph and mode), its group: its layer's number + 1."""
    hit = _RECOMPUTE_CACHE.get((id(g), mode))
    if hit is not None and hit[0] is g:
        return hit[1]
    out = {}
    for op in g.operators:
        m = LAYER_MODULE.search(op.module)
        if m and (mode == "full" or op.kind in ATTENTION_CORE):
            out[op.name] = int(m.group(2)) + 1
    if any(v[0] is not g for v in _RECOMPUTE_CACHE.values()):
        _RECOMPUTE_CACHE.clear()
    _RECOMPUTE_CACHE[(id(g), mode)] = (g, out)
    return out


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
    (1F1B, interleaved) parallelism x recomputation, with expert (and expert tensor) parallelism
    for mixture-of-experts models (planlab/search_spaces/experts.py)."""

    def __init__(self) -> None:
        super().__init__(
            (
                PipelineParallel(),
                DataParallel(),
                ExpertParallel(),
                TensorParallel(),
                ExpertTensorParallel(),
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
