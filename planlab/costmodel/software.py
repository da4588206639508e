"""The training software as data: how operators become kernels, what the host pays to issue
them, what its mixed precision keeps, how it reduces gradients, how its ZeRO-3 / FSDP gathers
weights, and what it takes of device memory before the first tensor.

Built-in software lives in ``planlab/costmodel/software/NAME.json`` (``megatron``,
``deepspeed``, ``torch``); a user's file has the same fields, or names a ``base`` (a built-in
name or a file) and gives only the fields that differ from it. Every number names its source in
the file's ``source`` objects. Units are in the field names (``_us``, ``_MiB``). Fields:

``implementation``
    the kernels each operator launches (:mod:`planlab.costmodel.kernels`): ``"megatron"``
    (Megatron-LM's layers: unfused attention through a fused scale-mask-softmax, fp32
    vocabulary-parallel cross entropy) or ``"torch"`` (fused scaled-dot-product attention,
    ``F.cross_entropy``);
``host_call_us``, ``host_backward_call_us``, ``host_launch_us``, ``host_collective_us``
    the host's time per framework call forward, per autograd node backward, per kernel launch
    and per collective issued: a floor the device cannot beat when its kernels are short;
``grad_reduce``
    ``"overlapped"`` (gradient buckets all-reduced during the backward) or ``"after_backward"``
    (every bucket reduced once the backward is done); ``grad_bucket_elements`` the bucket size;
``grad_reduce_copies``
    passes over a data-parallel gradient bucket the software makes around its all-reduce, each
    reading and writing the bucket once on the device (DeepSpeed's engine without ZeRO: the
    gradients flattened into the bucket, the bucket multiplied by 1/dp after the all-reduce and
    copied back into the gradients, 3); absent: 0 (the gradients are all-reduced where they lie);
``pipeline_messages``
    ``"whole"`` or ``"partitioned"`` (each tensor-parallel rank sends a tp-th of an activation
    between stages and the receivers all-gather it: Megatron-LM's scatter/gather, DeepSpeed's
    ``pipe_partitioned``);
``pipeline_p2p``
    ``"async"`` (the default: a stage sends an activation or a gradient and goes on computing
    while it travels) or ``"blocking"`` (the send holds the sender's compute stream until the
    message is delivered, as a synchronous ``torch.distributed.send`` does: DeepSpeed's pipeline
    engine);
``collective_buffers``
    ``"flat"`` (all-gathers into one flat tensor, as ``all_gather_into_tensor`` takes it) or
    ``"per_rank"`` (the software passes a list of one tensor per rank, which PyTorch's
    ProcessGroupNCCL copies out of, or into, a flat buffer of its own: one copy kernel per rank
    and all-gather or reduce-scatter) or ``"copied"`` (FSDP2: each all-gather's output copied into the parameters,
    each reduce-scatter's input assembled from the gradients, one copy kernel each);
``fused_softmax``
    Megatron's attention scales, masks and normalizes its scores in one fused kernel each way
    (true, the default) or in separate PyTorch kernels as Megatron-LM's 2019 release did (false;
    :func:`planlab.costmodel.kernels.unfused_softmax_2019`);
``fused_attention``
    the attention core runs as a flash-style fused kernel each way (true: Transformer Engine's flash
    or cuDNN fused attention as Megatron-Core runs it, PyTorch's flash SDPA on CUDA): it keeps
    query, key, value, output and the softmax's log-sum-exp (fp32, one per row) for the backward,
    which computes the scores again, writes no score matrix and writes its output in the layout the
    output projection reads (:mod:`planlab.plan.saved`). False (the default): with the ``megatron``
    implementation, Megatron-LM's unfused score GEMM, softmax, dropout and context GEMM; the
    ``torch`` implementation's kernels are fused either way, and it keeps what the graph says;
``attention_kernels``
    which fused attention kernel the software runs on each device architecture: an object of
    architecture (``ampere``, ``hopper``, ...; a device's ``architecture``) -> kernel (``flash2``,
    ``flash3``, ``cudnn``), priced at the device's ``attention_efficiency`` of that kernel (an
    architecture not listed, or a kernel the device has no measurement of: the GEMMs' efficiency);
``fused_qkv``
    the attention's query, key and value projections, linear layers reading the same input under
    the same split, run as one GEMM of their summed output width each way (Megatron-LM's
    ``query_key_value``, Megatron-Core's ``linear_qkv``): each projection's task is charged its
    share, by its width, of the fused GEMMs' time (:mod:`planlab.costmodel.kernels`). False (the
    default): three GEMMs each way, as ``torch.nn`` layers (torchtitan's ``wq``, ``wk``, ``wv``) run;
``fused_gate_up``
    a gated linear unit's gate and up projections, linear layers (or an expert stack's batched
    products) reading the same input under the same split, run as one GEMM of twice the width each
    way (Megatron-Core's ``linear_fc1`` with ``gated_linear_unit``, its experts' grouped ``linear_fc1``
    alike; Megatron-DeepSpeed's ``dense_h_to_4h`` with ``--swiglu``), each projection charged its share
    (:mod:`planlab.plan.fused_gemms`). False (the default): two GEMMs each way, as torchtitan's ``w1``
    and ``w3`` run. ``fused_qkv`` also covers a cross-attention's key and value projections, which
    read the encoder's output (Megatron-Core's ``CrossAttention.linear_kv``);
``fused_glu``
    a gated linear unit's activation and product run as one kernel that keeps only its input, the
    gate and up projections' outputs, for the backward, which computes the activation again
    (Megatron-Core's ``bias_swiglu_impl`` / ``bias_geglu_impl``): the activation's output is not
    kept (:mod:`planlab.plan.saved`). False (the default): the product keeps the activation's
    output, as PyTorch's autograd does for ``F.silu(x @ w1) * (x @ w3)``;
``glu_output_recomputed``
    with ``fused_glu``, the layer that reads a gated linear unit's output (its down projection) does
    not keep that output for its weight gradient: the backward computes it again from the input the
    unit keeps (DeepSeek-V3's report, section 3.3.3: "we cache the inputs of the SwiGLU operator and
    recompute its output in the backward pass"). The recomputation's elementwise pass is not priced
    (:mod:`planlab.plan.saved`). False (the default): the down projection keeps it (its FP8 cast
    under ``linear_input_bytes``);
``norm_output_recomputed``
    a linear layer (or a product with a weight) that reads a normalization's output (RMSNorm,
    LayerNorm) does not keep that output, nor its FP8 cast, for its weight gradient: the backward
    computes the norm again from the input the norm keeps for its own backward (DeepSeek-V3's report,
    section 3.2.3: "we recompute all RMSNorm operations ... during back-propagation, thereby
    eliminating the need to persistently store their output activations"). The recomputed norm and
    its cast are not priced (:mod:`planlab.plan.saved`). False (the default): the reader keeps it
    (its FP8 cast under ``linear_input_bytes``), as ``megatron`` counts Megatron-Core's linear
    layers (:mod:`planlab.search_spaces.recompute_modules`);
``fused_rms_norm``
    RMSNorm runs as one kernel each way (true, the default: Megatron-Core's Transformer Engine / apex
    kernels, torchtitan's Triton ``fused_rmsnorm``, PyTorch's own fused ``rms_norm`` in recent
    releases) or as eager PyTorch's composite of element-wise kernels (false: torchtitan's 2024
    ``RMSNorm``, ``x * rsqrt(x.float().pow(2).mean(-1) + eps)``, back to 16 bits, times the weight,
    and autograd's kernels for each; :func:`planlab.costmodel.kernels.eager_rms_norm`); time only:
    what the eager norm keeps for its backward (its fp32 copy of the input) is not counted;
``fp8_weight_matmuls``
    under the ``fp8`` precision, matrix products with a weight (a mixture of experts' grouped GEMMs
    over the stacked expert weights) run in FP8 with their casts, as its linear layers do (Transformer
    Engine's ``GroupedLinear``, Megatron-Core's ``TEGroupedMLP``); false (the default): they stay in
    16 bits (torchao's Float8 training swaps ``nn.Linear`` layers only);
``fp8_weight_cache``
    under the ``fp8`` precision, each FP8 linear layer (and product with a weight) casts its weight to
    FP8 (with its transpose) in the first micro-batch of a step only and keeps that cast for the
    step's other micro-batches and recomputed forwards (Transformer Engine's ``is_first_microbatch``,
    which Megatron-Core's schedules pass): the cast is priced once a step (each forward of a step's
    ``M`` micro-batches charged ``1 / M`` of it, a recomputed forward nothing) and the kept FP8 weight
    and its transpose (two bytes per weight element) are static memory. False (the default): the
    weight is cast in every forward, recomputed ones included (torchao's Float8 linear);
``fp8_all_gather``
    under the ``fp8`` precision with ZeRO-3 / FSDP, the gather carries the FP8 linear layers' weights in
    FP8: each device casts its shard with a scale computed once a step after the optimizer (torchao's
    ``enable_fsdp_float8_all_gather`` with ``precompute_float8_dynamic_scale_for_fsdp``), so the
    gather moves and holds one byte an element, the forward uses the gathered FP8 weight without a
    cast, and the backward copies it into the transposed layout its input-gradient GEMM reads
    (:func:`planlab.costmodel.kernels.op_kernels`' ``fp8_gathered``). False (the default): bf16 weights
    are gathered and cast in each forward;
``fp8_block_scaling``
    under the ``fp8`` precision, FP8 with block scales (DeepSeek-V3's recipe: one scale per 1 x 128
    tile of activations and gradients, per 128 x 128 block of weights): block-scaled GEMMs
    (``GemmSpec.fp8_block``, the device's ``gemm_efficiency_fp8_block``) and casts that write the scales.
    False (the default): per-tensor scales;
``routing_weights_in_experts``
    a mixture of experts' routing weights multiply the experts' activation inside their kernel
    (Megatron-Core's weighted SwiGLU, since its "memory efficient token permutation"), so the
    combine keeps no gathered expert outputs for the weights' gradient; false (the default): the
    combine multiplies the gathered outputs by the weights and keeps them (:mod:`planlab.plan.saved`);
``expert_dispatch``
    how a mixture of experts' dispatch and combine cross nodes: ``all_to_all`` (the default,
    Megatron-Core's all-to-all dispatcher: each of a token's top-k copies is its own message) or
    ``node_dedup`` (DeepEP, HybridEP, DeepSeek's own kernels: a token crosses to each node that holds
    one of its experts once and is forwarded to those experts over NVLink there;
    :mod:`planlab.plan.expert_dispatch`);
``expert_dispatch_sms``
    the SMs the expert dispatch and combine kernels hold while they run (DeepEP's ``Buffer.num_sms``,
    Megatron-Core's ``--moe-deepep-num-sms``, 20 by default; DeepSeek-V3's report: 20 SMs): computation
    running beside one in a forward/backward pair has the others only (:attr:`CostModel.dispatch_slowdown`,
    :mod:`planlab.simulator.pairs`); 0 (the default): those of the cluster's collectives (``collective_sms``);
``fused_permute``
    a mixture of experts permutes its tokens to and from the experts in fused kernels (Megatron-Core's
    ``--moe-permute-fusion``, off by default; HybridEP runs them inside its dispatch and combine), so
    planlab's routing copies around the dispatch's scatter and the combine's gather take no time of
    their own (:mod:`planlab.plan.expert_dispatch`); false (the default): each is its own kernel;
``sequence_parallel_saves_shard``
    with sequence parallelism, a column-parallel linear layer keeps its input's sequence shard
    for the backward and gathers it again there (Megatron-LM) instead of the gathered input;
``precisions``
    per precision (``fp32``, ``bf16``, ``fp16``, ``fp8``): ``activation_bytes``,
    ``param_bytes``, ``grad_bytes`` (as reduced), ``optimizer_bytes`` (master weights and
    moments) per parameter, ``optimizer_pass_bytes`` (memory traffic of one optimizer step per
    parameter), ``compute`` (the dtype of the GEMMs) and, optionally, ``linear_input_bytes`` (a
    linear layer keeps the cast of its input made for an FP8 GEMM, this many bytes an element,
    instead of the input: Transformer Engine; absent: the input itself), ``glu_input_bytes`` (a
    fused gated linear unit, ``fused_glu``, keeps its input cast to this many bytes an element and
    casts it back in its backward: Megatron-Core's ``activation_func_fp8_input_store``; absent: the
    input itself), ``attention_output_bytes`` (a fused attention's output that an FP8 linear layer
    reads is kept once, cast to this many bytes an element, for both the attention's backward and
    the layer's: DeepSeek-V3's E5M6, 1.5; absent: the attention keeps its output and the layer its
    own cast) and
    ``per_tensor_overflow_check`` (the step on whole weights, without ZeRO shards, checks each
    gradient tensor for inf/nan with a host synchronization of its own, so the device idles while
    the host issues each next check: DeepSpeed's FP16_Optimizer; absent: false);
``zero3``
    ``unit`` (``"layer"``: one gather per transformer layer, as FSDP wraps them; ``"module"``:
    one per module holding weights, as DeepSpeed fetches them), ``regather_for_recompute``
    (a recomputed layer's forward gathers its weights again instead of using the backward's),
    ``max_live_elements`` (no unit is prefetched while the gathered unit holds at least this many
    elements: DeepSpeed's ``stage3_max_live_parameters``; 0 or absent: always prefetched),
    ``max_reuse_elements`` (a unit gathered for a recomputed forward is kept for its backward,
    not gathered again, when the other units used in between hold fewer elements: DeepSpeed's
    ``stage3_max_reuse_distance``; 0 or absent: never kept), ``synchronized_fetch`` (each gather
    zero-fills its buffer and is issued with the device synchronized, so the host's time to issue it and
    the fill delay the computation after it: DeepSpeed of 2021; absent: false),
    ``reduce_at_next_gradient`` (a unit's reduce-scatter is issued as the next backward task that
    writes a weight's gradient starts, not right after the unit's last backward task: DeepSpeed's
    gradient hooks reduce a full bucket when the next parameter's gradient arrives; absent: false),
    ``gather_rank_us`` (with ``synchronized_fetch``: the host's time per rank of the group that
    the software's own Python spends on a gather before it is issued, the device idle: DeepSpeed
    2021's loop of a narrow view and ``get_rank`` per rank; absent: 0),
    ``persistence_elements`` (weights of fewer elements are never gathered: kept whole on every
    device, their gradients and optimizer states sharded and the updated shards all-gathered after
    the step, as ZeRO-2 does: DeepSpeed's ``stage3_param_persistence_threshold``; 0 or absent: none);
``memory``
    ``cuda_context_MiB``, ``nccl_MiB``, ``workspace_MiB`` taken from the device's memory before
    any tensor, and ``fragmentation``, the fraction of the rest the caching allocator cannot hand out.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from planlab.costmodel.fields import Fields, read_json
from planlab.costmodel.hardware import ARCHITECTURES, ATTENTION_KERNELS
from planlab.costmodel.precision import PRECISIONS, Precision
from planlab.enums import StrEnum
from planlab.errors import ConfigError, choices

SOFTWARE_DIR = Path(__file__).parent / "software"
IMPLEMENTATIONS = ("megatron", "torch")
GRAD_REDUCE = ("overlapped", "after_backward")
PIPELINE_MESSAGES = ("whole", "partitioned")
PIPELINE_P2P = ("async", "blocking")
COLLECTIVE_BUFFERS = ("flat", "per_rank", "copied")
ZERO3_UNITS = ("layer", "module")
DEFAULT_SOFTWARE = "megatron"  # on GPU clusters; the CPU cluster runs planlab's own executor: torch
_US = 1e-6
_MiB = 2.0**20
EXPERT_DISPATCH = ("all_to_all", "node_dedup")  # the software's expert_dispatch values
_WHAT = "software file"


class Fusion(StrEnum):
    """Projections reading one input that a software may run as one GEMM (:mod:`planlab.plan.fused_gemms`)."""

    QKV = "qkv"  # an attention's query, key and value (or a cross-attention's key and value): fused_qkv
    GATE_UP = "gate_up"  # a gated linear unit's gate and up projections: fused_gate_up


_FIELDS = {
    "name",
    "description",
    "source",
    "implementation",
    "host_call_us",
    "host_backward_call_us",
    "host_launch_us",
    "host_collective_us",
    "grad_reduce",
    "grad_bucket_elements",
    "grad_reduce_copies",
    "pipeline_messages",
    "pipeline_p2p",
    "collective_buffers",
    "sequence_parallel_saves_shard",
    "fused_softmax",
    "fused_attention",
    "attention_kernels",
    "fused_qkv",
    "fused_gate_up",
    "fused_glu",
    "glu_output_recomputed",
    "norm_output_recomputed",
    "fused_rms_norm",
    "fp8_weight_matmuls",
    "fp8_weight_cache",
    "fp8_all_gather",
    "fp8_block_scaling",
    "routing_weights_in_experts",
    "expert_dispatch",
    "expert_dispatch_sms",
    "fused_permute",
    "precisions",
    "zero3",
    "memory",
}
_PRECISION_FIELDS = {
    "activation_bytes",
    "param_bytes",
    "grad_bytes",
    "optimizer_bytes",
    "optimizer_pass_bytes",
    "linear_input_bytes",
    "glu_input_bytes",
    "attention_output_bytes",
    "per_tensor_overflow_check",
    "compute",
    "source",
}
_ZERO3_FIELDS = {
    "unit",
    "regather_for_recompute",
    "max_live_elements",
    "max_reuse_elements",
    "synchronized_fetch",
    "gather_rank_us",
    "reduce_at_next_gradient",
    "persistence_elements",
    "source",
}
_MEMORY_FIELDS = {"cuda_context_MiB", "nccl_MiB", "workspace_MiB", "fragmentation", "source"}


@dataclass(frozen=True)
class MemoryReserve:
    """What the software takes of a device's memory before planlab's tensors (bytes), and the
    fraction of the rest the caching allocator loses to fragmentation."""

    cuda_context_bytes: float = 0.0
    nccl_bytes: float = 0.0
    workspace_bytes: float = 0.0
    fragmentation: float = 0.0

    def usable_bytes(self, capacity_bytes: float) -> float:
        """The bytes left for tensors on a device of ``capacity_bytes``."""
        fixed = self.cuda_context_bytes + self.nccl_bytes + self.workspace_bytes
        return max(0.0, capacity_bytes - fixed) * (1.0 - self.fragmentation)

    def __str__(self) -> str:
        fixed = (self.cuda_context_bytes + self.nccl_bytes + self.workspace_bytes) / _MiB
        return f"{fixed:.0f} MiB reserved, {self.fragmentation:.0%} fragmentation"


@dataclass(frozen=True)
class SoftwareSpec:
    """The training software (SI units); see the module docstring for the fields."""

    name: str = "torch"
    implementation: str = "torch"
    host_call_s: float = 0.0
    host_backward_call_s: float = 0.0
    host_launch_s: float = 0.0
    host_collective_s: float = 0.0
    grad_reduce: str = "overlapped"
    grad_bucket_elements: int = 40_000_000
    grad_reduce_copies: int = 0
    pipeline_messages: str = "whole"
    pipeline_p2p: str = "async"
    collective_buffers: str = "flat"
    sequence_parallel_saves_shard: bool = False
    fused_softmax: bool = True
    fused_attention: bool = False
    attention_kernels: tuple[tuple[str, str], ...] = ()  # (device architecture, fused attention kernel)
    fused_qkv: bool = False
    fused_gate_up: bool = False
    fused_glu: bool = False
    glu_output_recomputed: bool = False
    norm_output_recomputed: bool = False
    fused_rms_norm: bool = True
    fp8_weight_matmuls: bool = False
    fp8_weight_cache: bool = False
    fp8_all_gather: bool = False
    fp8_block_scaling: bool = False
    routing_weights_in_experts: bool = False
    expert_dispatch: str = "all_to_all"
    expert_dispatch_sms: int = 0
    fused_permute: bool = False
    precisions: Mapping[str, Precision] = field(default_factory=dict, hash=False, compare=False)
    zero3_unit: str = "layer"
    zero3_regather_for_recompute: bool = False
    zero3_max_live_elements: int = 0
    zero3_max_reuse_elements: int = 0
    zero3_synchronized_fetch: bool = False
    zero3_gather_rank_s: float = 0.0
    zero3_reduce_at_next_gradient: bool = False
    zero3_persistence_elements: int = 0
    memory: MemoryReserve = MemoryReserve()
    path: str = ""  # the file it was read from

    def precision(self, name: str) -> Precision:
        """The named precision; ConfigError naming the software and its precisions."""
        if name not in self.precisions:
            raise ConfigError(f"software {self.name!r} has no precision {name!r}; choose {choices(self.precisions)}")
        return self.precisions[name]

    @property
    def attention_fused(self) -> bool:
        """Whether the attention core runs as one fused (flash) kernel each way (``fused_attention``)."""
        return self.implementation != "megatron" or self.fused_attention

    def fuses(self, fusion: Fusion | None) -> bool:
        """Whether the software runs the projections of a ``fusion`` group as one GEMM."""
        return (fusion is Fusion.QKV and self.fused_qkv) or (fusion is Fusion.GATE_UP and self.fused_gate_up)

    def attention_kernel(self, architecture: str) -> str:
        """The fused attention kernel the software runs on a device of ``architecture`` ("" if none is named)."""
        return dict(self.attention_kernels).get(architecture, "")

    def __str__(self) -> str:
        return self.name


def list_software() -> list[str]:
    """Names of the built-in software files, sorted."""
    return sorted(p.stem for p in SOFTWARE_DIR.glob("*.json"))


def load_software(name_or_path: str | os.PathLike[str]) -> SoftwareSpec:
    """A built-in software by name (``list_software``) or a user's JSON file by path; ConfigError
    for an unknown name or a malformed file (naming the file and the field). A file with a
    ``base`` (a built-in name or a file) takes the base's fields and gives its own over them
    (:func:`with_base`)."""
    path = _software_path(name_or_path)
    return software_from(Fields(with_base(read_json(path, _WHAT), path), str(path), what=_WHAT), str(path))


def _software_path(name_or_path: str | os.PathLike[str]) -> Path:
    text = os.fspath(name_or_path)
    names = list_software()
    if text in names:
        return SOFTWARE_DIR / f"{text}.json"
    if text.endswith(".json") or "/" in text or os.sep in text:
        return Path(text)
    raise ConfigError(f"unknown software {text!r}; choose {choices(names)} or a path to a JSON software file")


def with_base(obj: dict, path: Path, _seen: tuple[Path, ...] = ()) -> dict:
    """A software object with its ``base`` filled in: the base's fields (itself with its own base
    filled in), the object's fields over them, its objects (``source``, ``precisions``, ``memory``,
    ``zero3``) merged field by field. An object without ``base`` is returned as it is."""
    if not isinstance(obj, dict) or "base" not in obj:
        return obj
    base = obj["base"]
    if not isinstance(base, str) or not base:
        raise ConfigError(
            f"{_WHAT} {str(path)!r}: field 'base' is {base!r}; expected a built-in software name or a file"
        )
    base_path = _software_path(base)
    if base_path.resolve() in _seen + (path.resolve(),):
        raise ConfigError(f"{_WHAT} {str(path)!r}: field 'base' {base!r} leads back to itself")
    parent = with_base(read_json(base_path, _WHAT), base_path, _seen + (path.resolve(),))
    return _merged(parent, {k: v for k, v in obj.items() if k != "base"})


def _merged(under: dict, over: dict) -> dict:
    out = dict(under)
    for key, value in over.items():
        out[key] = _merged(under[key], value) if isinstance(value, dict) and isinstance(under.get(key), dict) else value
    return out


def _choice(f: Fields, key: str, valid: tuple[str, ...], default: str) -> str:
    if key not in f.obj:
        return default
    val = f.get(key)
    if val not in valid:
        raise f.error(key, f"is {val!r}; choose {choices(valid)}")
    return val


def _count(f: Fields, key: str) -> int:
    """A whole number >= 0 (0 where the field is absent)."""
    if key not in f.obj:
        return 0
    val = f.get(key)
    if isinstance(val, bool) or not isinstance(val, int) or val < 0:
        raise f.error(key, f"must be a whole number >= 0, got {val!r}")
    return val


def _flag(f: Fields, key: str, default: bool) -> bool:
    if key not in f.obj:
        return default
    val = f.get(key)
    if not isinstance(val, bool):
        raise f.error(key, f"must be true or false, got {val!r}")
    return val


def software_from(f: Fields, path: str = "") -> SoftwareSpec:
    """Parse a software object (``f`` reads it; see the module docstring for the fields)."""
    f.only(_FIELDS)

    def us(key: str) -> float:
        return f.unit(key, "us", strict=False) * _US if key in f.obj else 0.0

    zero3 = f.sub("zero3") if "zero3" in f.obj else None
    if zero3 is not None:
        zero3.only(_ZERO3_FIELDS)
    return SoftwareSpec(
        name=f.text("name"),
        implementation=_choice(f, "implementation", IMPLEMENTATIONS, "") or f.text("implementation"),
        host_call_s=us("host_call_us"),
        host_backward_call_s=us("host_backward_call_us"),
        host_launch_s=us("host_launch_us"),
        host_collective_s=us("host_collective_us"),
        grad_reduce=_choice(f, "grad_reduce", GRAD_REDUCE, "overlapped"),
        grad_bucket_elements=f.integer("grad_bucket_elements") if "grad_bucket_elements" in f.obj else 40_000_000,
        grad_reduce_copies=_count(f, "grad_reduce_copies"),
        pipeline_messages=_choice(f, "pipeline_messages", PIPELINE_MESSAGES, "whole"),
        pipeline_p2p=_choice(f, "pipeline_p2p", PIPELINE_P2P, "async"),
        collective_buffers=_choice(f, "collective_buffers", COLLECTIVE_BUFFERS, "flat"),
        sequence_parallel_saves_shard=_flag(f, "sequence_parallel_saves_shard", False),
        fused_softmax=_flag(f, "fused_softmax", True),
        fused_attention=_flag(f, "fused_attention", False),
        attention_kernels=_attention_kernels(f),
        fused_qkv=_flag(f, "fused_qkv", False),
        fused_gate_up=_flag(f, "fused_gate_up", False),
        fused_glu=_flag(f, "fused_glu", False),
        glu_output_recomputed=_flag(f, "glu_output_recomputed", False),
        norm_output_recomputed=_flag(f, "norm_output_recomputed", False),
        fused_rms_norm=_flag(f, "fused_rms_norm", True),
        fp8_weight_matmuls=_flag(f, "fp8_weight_matmuls", False),
        fp8_weight_cache=_flag(f, "fp8_weight_cache", False),
        fp8_all_gather=_flag(f, "fp8_all_gather", False),
        fp8_block_scaling=_flag(f, "fp8_block_scaling", False),
        routing_weights_in_experts=_flag(f, "routing_weights_in_experts", False),
        expert_dispatch=_choice(f, "expert_dispatch", EXPERT_DISPATCH, "all_to_all"),
        expert_dispatch_sms=_count(f, "expert_dispatch_sms"),
        fused_permute=_flag(f, "fused_permute", False),
        precisions=_precisions(f.sub("precisions")),
        zero3_unit=_choice(zero3, "unit", ZERO3_UNITS, "layer") if zero3 else "layer",
        zero3_regather_for_recompute=_flag(zero3, "regather_for_recompute", False) if zero3 else False,
        zero3_max_live_elements=zero3.integer("max_live_elements") if zero3 and "max_live_elements" in zero3.obj else 0,
        zero3_max_reuse_elements=(
            zero3.integer("max_reuse_elements") if zero3 and "max_reuse_elements" in zero3.obj else 0
        ),
        zero3_synchronized_fetch=_flag(zero3, "synchronized_fetch", False) if zero3 else False,
        zero3_gather_rank_s=(
            zero3.unit("gather_rank_us", "us", strict=False) * _US if zero3 and "gather_rank_us" in zero3.obj else 0.0
        ),
        zero3_reduce_at_next_gradient=_flag(zero3, "reduce_at_next_gradient", False) if zero3 else False,
        zero3_persistence_elements=(
            zero3.integer("persistence_elements") if zero3 and "persistence_elements" in zero3.obj else 0
        ),
        memory=_memory(f.sub("memory")) if "memory" in f.obj else MemoryReserve(),
        path=path,
    )


def _attention_kernels(f: Fields) -> tuple[tuple[str, str], ...]:
    """The ``attention_kernels`` object: device architecture -> fused attention kernel; () if not given."""
    if "attention_kernels" not in f.obj:
        return ()
    sub = f.sub("attention_kernels")
    out = []
    for arch, kernel in sub.obj.items():
        if arch not in ARCHITECTURES:
            raise f.error("attention_kernels", f"names architecture {arch!r}; choose {choices(ARCHITECTURES)}")
        if kernel not in ATTENTION_KERNELS:
            raise sub.error(arch, f"is {kernel!r}; choose {choices(ATTENTION_KERNELS)}")
        out.append((arch, kernel))
    return tuple(out)


def _precisions(f: Fields) -> dict[str, Precision]:
    out = {}
    for name in f.obj:
        if str(name).startswith("_") or name == "source":
            continue
        if name not in PRECISIONS:
            raise f.error(name, f"is not a precision; choose {choices(PRECISIONS)}")
        p = f.sub(name)
        p.only(_PRECISION_FIELDS)

        def nbytes(key: str) -> int:
            val = p.number(key, strict=False, high=16, unit="bytes per element")
            if val != int(val):
                raise p.error(key, f"must be a whole number of bytes, got {val!r}")
            return int(val)

        out[name] = Precision(
            name,
            activation_bytes=nbytes("activation_bytes"),
            param_bytes=nbytes("param_bytes"),
            grad_bytes=nbytes("grad_bytes"),
            optimizer_bytes=nbytes("optimizer_bytes"),
            compute_dtype=_choice(p, "compute", PRECISIONS, "") or p.text("compute"),
            optimizer_pass_bytes=p.number(
                "optimizer_pass_bytes", strict=False, high=1000.0, unit="bytes moved per parameter"
            ),
            linear_input_bytes=nbytes("linear_input_bytes") if "linear_input_bytes" in p.obj else 0,
            glu_input_bytes=nbytes("glu_input_bytes") if "glu_input_bytes" in p.obj else 0,
            attention_output_bytes=(
                p.number("attention_output_bytes", high=16, unit="bytes per element")
                if "attention_output_bytes" in p.obj
                else 0.0
            ),
            per_tensor_overflow_check=_flag(p, "per_tensor_overflow_check", False),
        )
    if not out:
        raise ConfigError(
            f"{f.what} {f.where!r}: field 'precisions' lists no precision; expected {choices(PRECISIONS)}"
        )
    return out


def _memory(f: Fields) -> MemoryReserve:
    f.only(_MEMORY_FIELDS)

    def mib(key: str) -> float:
        return f.number(key, low=0.0, strict=False, high=1e5, unit="MiB") * _MiB if key in f.obj else 0.0

    return MemoryReserve(
        cuda_context_bytes=mib("cuda_context_MiB"),
        nccl_bytes=mib("nccl_MiB"),
        workspace_bytes=mib("workspace_MiB"),
        fragmentation=f.number("fragmentation", low=0.0, strict=False, high=0.9, unit="fraction of the memory")
        if "fragmentation" in f.obj
        else 0.0,
    )
