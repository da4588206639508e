"""What an operator keeps for its backward, as the training software's implementation keeps it.

The graph says which of an operator's inputs and outputs its backward reads (``Operator.saves``,
PyTorch's view). The implementation decides the rest, and materialize, the explorer's memory
bound and the screen all ask here:

- dropout keeps a one-byte mask of its output, not the output (``torch.nn.functional.dropout``
  saves the boolean mask ``native_dropout`` returns);
- Megatron-LM's unfused attention (implementation ``megatron``) keeps the softmax's output, the
  attention dropout's mask and its output: 2 + 1 + 2 bytes (16-bit activations) per element of the
  ``B x H x T x S`` scores, and not its own output (the backward of ``probs @ V`` needs ``probs``
  and ``V``) (Korthikanti et al. 2022, section 4.1: ``5 a s^2 b`` bytes per layer);
- fused attention (the software's ``fused_attention``: Transformer Engine's flash / cuDNN fused
  attention as Megatron-Core runs it, PyTorch's flash and memory-efficient SDPA on CUDA) keeps
  query, key, value and its output and the softmax's log-sum-exp, one fp32 number per query row
  and head (``softmax_lse`` of FlashAttention-2, Dao 2023, algorithm 1; cuDNN's ``Stats`` tensor,
  TE's ``aux_ctx_tensors``), and no score matrix: its backward computes the scores again. Its
  output is written in the layout the output projection reads, so the heads' merge is a view and a
  projection that keeps its 16-bit input keeps the same storage (:func:`output_kept_by_reader`);
- a gated linear unit fused into one kernel (the software's ``fused_glu``: Megatron-Core's
  ``bias_swiglu_impl`` and ``bias_geglu_impl``, its default ``--bias-swiglu-fusion``) keeps only
  its input, the gate and up projections' outputs, and computes the activation again in its
  backward; the product does not keep the activation's output (:func:`glu_gate`), where PyTorch's
  autograd keeps it for ``F.silu(x @ w1) * (x @ w3)``;
- a mixture of experts whose routing weights multiply the experts' activation inside their kernel
  (the software's ``routing_weights_in_experts``: Megatron-Core's ``weighted_bias_swiglu_impl``,
  whose backward computes the weights' gradient from the SwiGLU input it keeps) keeps nothing at
  the combine: the weighted sum of the gathered expert outputs does not keep them
  (:func:`combined_outputs`), where the combine of earlier Megatron-Core (``unpermute`` with
  ``probs``) keeps them for the weights' gradient;
- a saved tensor that is a broadcast view of another (``Tensor.expand``: stride 0 on the new axes,
  no storage of its own) keeps the storage under it, the view's input: autograd saves the view, and
  the view holds its base alive, nothing more (the routing's index expanded to the hidden size,
  ``index.unsqueeze(-1).expand(..., H)``, keeps ``tokens x top-k`` integers, not ``x H`` of them);
- with the software's ``sequence_parallel_saves_shard`` a linear layer keeps the sequence shard
  its input was gathered from instead of the gathered input (Megatron-LM), gathering it again
  in the backward (overlapped with the input-gradient GEMM there, and not priced);
- under a precision with ``linear_input_bytes`` (Transformer Engine's FP8 training) a linear
  layer, and a matrix product with a weight (the experts' stacked weights: Transformer Engine's
  GroupedLinear), keeps the FP8 cast of its activation input instead of the input
  (:func:`cast_inputs`): one cast of a tensor in one layout, shared by the layers that read it
  there (one fused GEMM in Megatron-Core: its QKV and SwiGLU fc1 layers), buffer
  :func:`fp8_cast` of the buffer cast, the screen's and the explorer's key
  ``INTERNAL + "<tensor>:fp8"``;
- where the precision has ``attention_output_bytes`` (DeepSeek-V3's report, section 3.3.3: the
  inputs of the linear layer after the attention cached once, in a 12-bit E5M6 format, for the
  attention's backward too) the fused attention's output that an FP8 linear layer reads through
  views is kept once, as that layer's cast at those bytes an element, and the attention does not
  keep its output (:func:`attention_output_cast`, :func:`output_kept_by_reader`);
- with the software's ``glu_output_recomputed`` the layer that reads a fused gated linear unit's
  output does not keep it: its backward computes it again from the unit's kept input
  (:func:`recomputed_glu_outputs`; DeepSeek-V3's report, section 3.3.3);
- with the software's ``norm_output_recomputed`` a linear layer that reads a normalization's
  output does not keep it: its backward computes the norm again from the norm's kept input
  (:func:`recomputed_norm_outputs`; DeepSeek-V3's report, section 3.2.3);
- a fused gated linear unit whose software stores its input cast (the precision's
  ``glu_input_bytes``: Megatron-Core's ``activation_func_fp8_input_store``, whose
  ``SwiGLUFunction`` saves ``input.to(torch.float8_e4m3fn)`` and casts it back to the original
  dtype in its backward) keeps the projections' outputs as that cast (:func:`glu_inputs`), the
  same buffer :func:`fp8_cast` names.

An *internal* is a buffer that is no tensor of the graph: ``(tag, base tensor, elements per
element of the base, bytes per element)``; materialize's buffer for it is
:func:`planlab.plan.buffer.internal` (text ``k:<operator>:<tag>``), the screen's key
``INTERNAL + "<operator>:<tag>"``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

from planlab.plan.plan import RING_DIM, RING_KV_DIM
from planlab.costmodel.kernels import VIEW_KINDS
from planlab.graph.ir import Graph, Operator
from planlab.plan import buffer as buf_
from planlab.plan.buffer import Buffer
from planlab.plan.layout import Layout, Shard

if TYPE_CHECKING:
    from planlab.costmodel.precision import Precision
    from planlab.costmodel.software import SoftwareSpec

INTERNAL = "k:"  # prefix of the screen's and the explorer's keys for internal buffers


def implementation(software: SoftwareSpec | None) -> str:
    """The software's kernel implementation (``torch`` without a software)."""
    return software.implementation if software is not None else "torch"


def unfused_attention(software: SoftwareSpec | None) -> bool:
    """Whether the software runs attention unfused (Megatron-LM's score GEMM, softmax, dropout)."""
    return software is not None and not software.attention_fused


def saved_tensors(
    op: Operator, software: SoftwareSpec | None, graph: Graph | None = None, precision: Precision | None = None
) -> tuple[str, ...]:
    """The graph tensors ``op``'s backward keeps (inputs and outputs, weights included); with
    ``graph`` and ``precision``, a fused attention's output that the next layer keeps is counted
    there only (:func:`output_kept_by_reader`)."""
    if op.kind == "dropout":
        return tuple(t for t in op.saves if t not in op.outputs)  # the mask instead (internals)
    if op.kind == "attention" and unfused_attention(software):
        return tuple(t for t in op.saves if t not in op.outputs)
    if op.kind in CAST_KINDS and graph is not None and (recomputed := recomputed_inputs(op, graph, software)):
        return tuple(t for t in op.saves if t not in recomputed)
    if op.kind == "mul" and software is not None and graph is not None:
        drop = (glu_gate(op, graph) if software.fused_glu else None, None)
        if software.routing_weights_in_experts:
            drop = (drop[0], combined_outputs(op, graph))
        if drop != (None, None):
            return tuple(t for t in op.saves if t not in drop)
    if (
        op.kind == "attention"
        and software is not None
        and software.fused_attention
        and graph is not None
        and precision is not None
        and output_kept_by_reader(op, graph, precision, software)
    ):
        return tuple(t for t in op.saves if t not in op.outputs)
    return op.saves


# Operator kinds whose outputs a gated linear unit multiplies: its gate and up projections
GLU_PROJECTIONS = frozenset({"linear", "matmul"})


def glu_gate(op: Operator, graph: Graph) -> str | None:
    """The activated gate ``act(x @ w1)`` that ``op`` multiplies by an up projection ``x @ w3``
    when ``op`` is a gated linear unit's product and the only reader of that gate; else None.
    A fused gated linear unit (the software's ``fused_glu``) keeps the projections' outputs (the
    activation keeps its input, the product the up projection) and not the gate."""
    if op.kind != "mul" or len(op.inputs) != 2:
        return None
    for gate, up in (op.inputs, op.inputs[::-1]):
        act = graph.producer.get(gate)
        if act is None or act.kind != "activation" or len(graph.consumers.get(gate, ())) != 1:
            continue
        proj, other = graph.producer.get(act.inputs[0]), graph.producer.get(up)
        if proj is not None and other is not None and proj.kind in GLU_PROJECTIONS and other.kind in GLU_PROJECTIONS:
            return gate
    return None


def recomputed_glu_outputs(op: Operator, graph: Graph, software: SoftwareSpec | None) -> tuple[str, ...]:
    """The inputs of ``op`` (a linear layer or a product with a weight) that are a fused gated linear
    unit's output and that its backward computes again from the unit's kept input instead of keeping
    them (the software's ``glu_output_recomputed`` with ``fused_glu``: DeepSeek-V3's report, section
    3.3.3); () otherwise."""
    if software is None or not (software.fused_glu and software.glu_output_recomputed):
        return ()
    if op.kind != "linear" and not weight_matmul(op, graph):
        return ()
    return tuple(t for t in op.inputs if t in op.saves and _glu_product(graph.producer.get(t), graph))


# Operator kinds of a normalization whose output a software may compute again in the backward
NORM_KINDS = frozenset({"rms_norm", "rms_norm_fn", "layer_norm", "layer_norm_fn"})


def recomputed_norm_outputs(op: Operator, graph: Graph, software: SoftwareSpec | None) -> tuple[str, ...]:
    """The inputs of ``op`` (a linear layer or a product with a weight) that a normalization made
    and that its backward computes again from the norm's kept input instead of keeping them (the
    software's ``norm_output_recomputed``: DeepSeek-V3's report, section 3.2.3); () otherwise. The
    norm keeps its input for its own backward, so the recomputation keeps nothing more."""
    if software is None or not software.norm_output_recomputed:
        return ()
    if op.kind != "linear" and not weight_matmul(op, graph):
        return ()
    return tuple(
        t
        for t in op.inputs
        if t in op.saves
        and (p := graph.producer.get(t)) is not None
        and p.kind in NORM_KINDS
        and p.inputs[0] in p.saves
    )


def recomputed_inputs(op: Operator, graph: Graph, software: SoftwareSpec | None) -> tuple[str, ...]:
    """The inputs ``op``'s backward computes again instead of keeping: :func:`recomputed_glu_outputs`
    and :func:`recomputed_norm_outputs`."""
    return recomputed_glu_outputs(op, graph, software) + recomputed_norm_outputs(op, graph, software)


def _glu_product(op: Operator | None, graph: Graph) -> bool:
    """Whether ``op`` is a gated linear unit's product (:func:`glu_gate`)."""
    return op is not None and glu_gate(op, graph) is not None


def combined_outputs(op: Operator, graph: Graph) -> str | None:
    """The experts' outputs gathered back to their tokens that ``op`` multiplies by the routing
    weights (one per token and choice, a trailing axis of 1) when ``op`` is a mixture of experts'
    combine, ``torch.gather(experts' output, 1, slot) * weights`` (:mod:`planlab.models.moe`), and
    their only reader; else None."""
    if op.kind != "mul" or len(op.inputs) != 2:
        return None
    for y, w in (op.inputs, op.inputs[::-1]):
        g = graph.producer.get(y)
        if g is None or g.kind != "gather" or tuple(graph.tensors[w].shape[-1:]) != (1,):
            continue
        if len(graph.consumers.get(y, ())) != 1:
            continue
        src = graph.producer.get(g.inputs[0])
        while src is not None and src.kind in LAYOUT_VIEWS:
            src = graph.producer.get(src.inputs[0])
        if src is not None and src.kind == "matmul" and any(graph.tensors[t].role == "param" for t in src.inputs):
            return y
    return None


# Operator kinds that only relabel the axes of a fused attention's output: Transformer Engine writes
# it in the layout the output projection reads ([s, b, h * d]) and PyTorch's flash SDPA returns a
# transposed view of a [b, s, h, d] tensor, so these are views of one storage
LAYOUT_VIEWS = frozenset({"transpose", "reshape", "permute", "view"})


def output_kept_by_reader(
    op: Operator, graph: Graph, precision: Precision, software: SoftwareSpec | None = None
) -> bool:
    """Whether the layer that reads ``op``'s output, through views of it only (the heads merged: a
    transpose and a reshape), keeps that output itself for its backward (a linear layer keeping its
    16-bit input, not an FP8 cast), or keeps the one cast of it that the attention's backward reads
    too (:func:`attention_output_cast`): one storage, which the fused attention and its output
    projection both keep, counted once there."""
    t = op.outputs[0]
    while True:
        readers = graph.consumers.get(t, ())
        if len(readers) != 1:
            return False
        reader = readers[0]
        if reader.kind not in LAYOUT_VIEWS:
            if reader.kind != "linear" or t not in reader.saves:
                return False
            return t not in cast_inputs(reader, graph, precision) or attention_output_cast(
                reader, t, graph, precision, software
            )
        t = reader.outputs[0]


def attention_output_cast(
    op: Operator, t: str, graph: Graph, precision: Precision, software: SoftwareSpec | None
) -> bool:
    """Whether input ``t`` of ``op`` (a linear layer that keeps an FP8 cast of its input) is a fused
    attention's output, reached through views only (the heads merged), of which the software keeps
    one cast for both the attention's backward and the layer's (the precision's
    ``attention_output_bytes``): DeepSeek-V3's report, section 3.3.3, "Inputs of the Linear after
    the attention operator. These activations are also used in the backward pass of the attention
    operator ... We adopt a customized E5M6 data format exclusively for these activations"."""
    if not precision.attention_output_bytes or software is None or not software.fused_attention:
        return False
    if op.kind != "linear" or output_layer(op, graph):
        return False
    while True:
        if len(graph.consumers.get(t, ())) != 1:
            return False
        prod = graph.producer.get(t)
        if prod is None:
            return False
        if prod.kind == "attention":
            return prod.outputs[0] == t
        if prod.kind not in LAYOUT_VIEWS:
            return False
        t = prod.inputs[0]


def internals(op: Operator, graph: Graph, software: SoftwareSpec | None, activation_bytes: int) -> tuple:
    """``((tag, base tensor, elements per base element, bytes per element), ...)`` that ``op``'s
    implementation keeps for its backward besides graph tensors."""
    if op.kind == "dropout" and any(t in op.outputs for t in op.saves):
        return (("mask", op.outputs[0], 1.0, 1),)
    fused = software is not None and software.fused_attention
    if op.kind != "attention" or len(op.inputs) < 2 or not (fused or unfused_attention(software)):
        return ()
    q, k = graph.tensors[op.inputs[0]].shape, graph.tensors[op.inputs[1]].shape
    if len(q) < 2 or len(k) < 2 or not q[-1]:
        return ()
    if fused:  # log-sum-exp: B*H*T = q's elements / D, fp32
        return (("lse", op.inputs[0], 1 / q[-1], LSE_BYTES),)
    # scores B*H*T*S = q's elements (B*H*T*D) x S / D: softmax output, dropout mask, dropout output
    return (("probs", op.inputs[0], k[-2] / q[-1], 2 * activation_bytes + 1),)


LSE_BYTES = 4  # fused attention's log-sum-exp per row, fp32 (FlashAttention-2's softmax_lse, cuDNN's Stats)


# Operator kinds that run as a GEMM with a weight, whose input an FP8 training keeps as its cast
CAST_KINDS = frozenset({"linear", "matmul"})


def weight_matmul(op: Operator, graph: Graph) -> bool:
    """Whether ``op`` is a matrix product with a weight (a parameter operand: the experts' stacked
    weights), which an FP8 training may run as it runs a linear layer's GEMMs."""
    return op.kind == "matmul" and any(graph.tensors[t].role == "param" for t in op.inputs)


def step_microbatches(kind: str, with_weight: bool, microbatches: int) -> int:
    """A forward piece's ``Task.step_microbatches``: a step's ``microbatches`` for a piece that
    multiplies by a weight (a linear layer's, or a product with a weight's: ``with_weight``), among
    which a software that keeps a weight's FP8 cast shares one cast; 1 for any other."""
    return microbatches if kind == "linear" or with_weight else 1


LOSS_KINDS = frozenset({"cross_entropy", "vocab_cross_entropy"})


def output_layer(op: Operator, graph: Graph) -> bool:
    """Whether ``op`` is the model's output projection: a linear layer (or a product with a weight,
    a tied embedding's) whose output reaches the loss through views only. FP8 trainings keep it in
    16 bits: torchtitan converts every ``nn.Linear`` but the one named ``output``
    (``torchtitan/float8.py``'s module filter), and Megatron-Core's ``output_layer`` is a
    ``tensor_parallel.ColumnParallelLinear``, not a Transformer Engine module, so ``fp8_autocast``
    leaves it in 16 bits (``megatron/core/models/gpt/gpt_model.py``)."""
    if op.kind != "linear" and not weight_matmul(op, graph):
        return False
    frontier, seen = list(op.outputs), set()
    while frontier:
        for user in graph.consumers.get(frontier.pop(), ()):
            if user.kind in LOSS_KINDS:
                return True
            if user.kind in VIEW_KINDS and user.name not in seen:
                seen.add(user.name)
                frontier.extend(user.outputs)
    return False


CAST_WEIGHT_BYTES = 2  # a kept FP8 weight: its FP8 copy and its transpose, one byte an element each
FP8_BYTES = 1  # an FP8 element (E4M3 or E5M2)


def fp8_weights(graph: Graph, software: SoftwareSpec | None, precision: Precision) -> frozenset[str]:
    """The weights FP8 GEMMs multiply by under an FP8 precision: the linear layers' and, with the
    software's ``fp8_weight_matmuls``, the products with a weight's, the output projection's (16 bits)
    left out; empty in another precision (kept in the graph's memo)."""
    if precision.compute_dtype != "fp8":
        return frozenset()
    matmuls = software is not None and software.fp8_weight_matmuls

    def find() -> frozenset[str]:
        names = set()
        for op in graph.operators:
            fp8 = op.kind == "linear" or (matmuls and weight_matmul(op, graph))
            if fp8 and not output_layer(op, graph):
                names.update(t for t in op.inputs if graph.tensors[t].role == "param" and graph.tensors[t].is_float)
        return frozenset(names)

    return graph.memo(("fp8_weights", matmuls), find)


def cached_fp8_weights(graph: Graph, software: SoftwareSpec | None, precision: Precision) -> frozenset[str]:
    """The weights whose FP8 casts the software keeps across a step's micro-batches
    (``fp8_weight_cache``, Transformer Engine's workspaces: :data:`CAST_WEIGHT_BYTES` an element, static
    memory): :func:`fp8_weights` where the software keeps them, empty otherwise."""
    if software is None or not software.fp8_weight_cache:
        return frozenset()
    return fp8_weights(graph, software, precision)


def fp8_gathered_weights(graph: Graph, software: SoftwareSpec | None, precision: Precision) -> frozenset[str]:
    """The weights a ZeRO-3 / FSDP gather carries in FP8, cast on each device's shard before the gather
    (the software's ``fp8_all_gather``: torchao's float8 all-gather): :func:`fp8_weights` where the
    software does so, empty otherwise."""
    if software is None or not software.fp8_all_gather:
        return frozenset()
    return fp8_weights(graph, software, precision)


def cast_inputs(
    op: Operator, graph: Graph, precision: Precision, software: SoftwareSpec | None = None
) -> dict[str, float]:
    """The activation inputs ``op``'s backward keeps as a cast its forward made instead of
    themselves, with the bytes an element of each cast: those of a linear layer, or of a matrix
    product with a weight, kept as the FP8 cast of the forward GEMM where the precision says so
    (``precision.linear_input_bytes``; a fused attention's output kept once for both backwards,
    ``precision.attention_output_bytes``: :func:`attention_output_cast`), and those of a fused
    gated linear unit stored cast where the software fuses it and the precision says so
    (``precision.glu_input_bytes``: :func:`glu_inputs`) (module docstring)."""
    if precision.glu_input_bytes and software is not None and software.fused_glu:
        glu = glu_inputs(op, graph)
        if glu:
            return dict.fromkeys(glu, precision.glu_input_bytes)
    if not precision.linear_input_bytes or op.kind not in CAST_KINDS:
        return {}
    ts = graph.tensors
    if op.kind != "linear" and not weight_matmul(op, graph):
        return {}
    if output_layer(op, graph):  # runs in 16 bits: keeps its input itself
        return {}
    return {
        t: (
            precision.attention_output_bytes
            if attention_output_cast(op, t, graph, precision, software)
            else precision.linear_input_bytes
        )
        for t in op.saves
        if t in op.inputs and ts[t].role == "activation" and ts[t].is_float
    }


def glu_inputs(op: Operator, graph: Graph) -> tuple[str, ...]:
    """The inputs a fused gated linear unit keeps through ``op``: the gate projection's output
    where ``op`` is its activation (its one reader a product :func:`glu_gate` names), the up
    projection's output where ``op`` is its product; () for any other operator. Megatron-Core's
    ``SwiGLUFunction`` saves its one input, both projections' outputs side by side
    (``megatron/core/fusions/fused_bias_swiglu.py``)."""
    if op.kind == "mul":
        gate = glu_gate(op, graph)
        return tuple(t for t in op.inputs if t != gate and t in op.saves) if gate is not None else ()
    if op.kind != "activation" or len(op.outputs) != 1:
        return ()
    readers = graph.consumers.get(op.outputs[0], ())
    if len(readers) == 1 and glu_gate(readers[0], graph) == op.outputs[0]:
        return tuple(t for t in op.inputs[:1] if t in op.saves)
    return ()


def fp8_cast(buf: Buffer) -> Buffer:
    """The buffer of the FP8 cast of ``buf`` a linear layer keeps for its backward (:func:`cast_inputs`)."""
    return buf_.internal(str(buf), "fp8")


# Operator kinds whose output is a view of their first input broadcast along new or size-1 axes.
BROADCAST_VIEWS = frozenset({"expand"})


def view_of(tensor: str, graph: Graph) -> Operator | None:
    """The operator whose output ``tensor`` is a broadcast view of its first input (an activation
    some operator makes), or None: a backward that keeps ``tensor`` keeps that input's storage."""
    p = graph.producer.get(tensor)
    return p if p is not None and p.kind in BROADCAST_VIEWS and p.inputs[0] in graph.producer else None


def keeps_producer_layout(op: Operator, tensor: str, graph: Graph, software: SoftwareSpec | None) -> bool:
    """Whether ``op`` keeps ``tensor`` (an activation input) in the layout its producer made, not
    the one it computed on (Megatron-LM's sequence-parallel linear layers)."""
    return (
        software is not None
        and software.sequence_parallel_saves_shard
        and op.kind == "linear"
        and graph.tensors[tensor].role == "activation"
        and tensor in graph.producer
    )


def saved_buffers(
    op: Operator,
    bufs: tuple[Buffer, ...],
    outs: tuple[Buffer, ...],
    graph: Graph,
    has: Callable[[Operator, int], Layout],
    needs: Callable[[Operator, int], Layout],
    software: SoftwareSpec | None,
    precision: Precision,
    view_read: Callable[[Operator], Buffer | None] = lambda v: None,
) -> tuple[Buffer, ...]:
    """The buffers ``op``'s backward keeps: its saved inputs (``bufs``, in the layouts it computed
    on) and outputs (``outs``), an input in its producer's layout (``outs`` of the producer: the
    activation as it made it) where the software keeps that (:func:`keeps_producer_layout`) and
    that layout is more split, then its internal buffers. ``has(op, j)`` and ``needs(op, j)``: the
    layout of output ``j`` / input ``j``. A saved broadcast view (:func:`view_of`) keeps
    ``view_read(view operator)`` instead, the buffer the view operator read here (None: the view).
    An input kept as its FP8 cast (:func:`cast_inputs`) is kept as :func:`fp8_cast` of its buffer."""
    out = []
    cast = cast_inputs(op, graph, precision, software)
    for s in saved_tensors(op, software, graph, precision):
        if s in op.outputs:
            out.append(outs[op.outputs.index(s)])
            continue
        if graph.tensors[s].role == "param":
            continue
        view = view_of(s, graph)
        base = view_read(view) if view is not None else None
        if base is not None:
            out.append(base)
            continue
        j = op.inputs.index(s)
        buf = bufs[j]
        if keeps_producer_layout(op, s, graph, software) and buf != (made := buf_.activation(s)):
            prod = graph.producer[s]
            if shards(has(prod, prod.outputs.index(s))) > shards(needs(op, j)):
                buf = made  # the sequence shard it was gathered from
        out.append(fp8_cast(buf) if s in cast else buf)
    out += [buf_.internal(op.name, tag) for tag, *_ in internals(op, graph, software, precision.activation_bytes)]
    return tuple(dict.fromkeys(out))


def shards(layout: Layout) -> int:
    """How many pieces a layout cuts a tensor into (the product of its sharded mesh axes)."""
    return math.prod(layout.mesh.shape[a] for a, p in enumerate(layout.placements) if isinstance(p, Shard))


def saved_activations(
    op: Operator,
    piece,
    graph: Graph,
    software: SoftwareSpec | None,
    precision: Precision,
    microbatches: int,
    plans: dict,
) -> list[tuple[tuple, float]]:
    """What one piece of ``op`` keeps for its backward, one micro-batch: ``((key, bytes), ...)``,
    ``key`` naming the tensor and how many pieces it is cut into (operators that keep the same
    tensor in the same cut keep it once). ``piece`` is ``op``'s OpPlan and ``plans`` maps
    operator names to theirs (a tensor kept in its producer's layout is cut as its producer cuts it)."""

    def cut_of(oplan, o: Operator, t: str) -> int:
        held = {ax[0] for ax in o.axes_of(t) if ax}
        if oplan.ring and RING_KV_DIM in held:  # a ring attention's keys and values: split where its queries are
            held.add(RING_DIM)
        return math.prod(n for d, n in zip(oplan.dims, oplan.sizes) if d is not None and d in held)

    def per_microbatch(t: str, cut: int, per: float = 1.0, nbytes: float | None = None) -> float:
        spec = graph.tensors[t]
        batch = any(graph.labels.get((t, a)) == graph.batch_label for a in range(len(spec.shape)))
        eb = nbytes if nbytes is not None else (precision.activation_bytes if spec.is_float else 8)
        return spec.numel / cut / (microbatches if batch else 1) * per * eb

    out = []
    cast = cast_inputs(op, graph, precision, software)
    for t in saved_tensors(op, software, graph, precision):
        if graph.tensors[t].role == "param":
            continue
        view = view_of(t, graph)
        if view is not None and view.name in plans:  # the storage under a broadcast view, as the view cut it
            base = view.inputs[0]
            cut = cut_of(plans[view.name], view, base)
            out.append(((base, cut), per_microbatch(base, cut)))
            continue
        cut = cut_of(piece, op, t)
        if keeps_producer_layout(op, t, graph, software):
            prod = graph.producer[t]
            cut = max(cut, cut_of(plans[prod.name], prod, t))
        if t in cast:
            out.append(((f"{INTERNAL}{t}:fp8", cut), per_microbatch(t, cut, nbytes=cast[t])))
            continue
        out.append(((t, cut), per_microbatch(t, cut)))
    for tag, base, per, nbytes in internals(op, graph, software, precision.activation_bytes):
        cut = cut_of(piece, op, base)
        out.append(((f"{INTERNAL}{op.name}:{tag}", cut), per_microbatch(base, cut, per, nbytes)))
    return out
