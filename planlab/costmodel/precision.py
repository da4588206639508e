"""Numeric precision of a training run: bytes per element of activations, and per parameter of
weights, gradients and optimizer states, and the dtype its GEMMs compute in.

A precision is a setting of the training software (``planlab/costmodel/software/*.json`` list
the ones each supports, with the bytes its mixed-precision implementation keeps); the device
names its default (a V100 has no bf16 tensor cores, so fp16). :data:`FP32` and
:data:`MIXED_BF16` are the values planlab uses where no software is given.
"""

from __future__ import annotations

from dataclasses import dataclass

PRECISIONS = ("fp32", "bf16", "fp16", "fp8")


@dataclass(frozen=True)
class Precision:
    """Bytes per element of activations and per parameter of weights, gradients (as reduced over
    data parallelism) and optimizer states; ``compute_dtype`` is the dtype of the GEMMs (``fp8``:
    FP8 GEMMs with bf16 everywhere else, as Transformer Engine runs them);
    ``optimizer_pass_bytes`` the memory traffic of one optimizer step per parameter;
    ``linear_input_bytes`` the bytes per element of the copy of a linear layer's input its backward
    keeps where the software keeps the FP8 cast it made for the forward GEMM instead of the input
    (Transformer Engine under FP8 training: 1), 0 where it keeps the input itself;
    ``glu_input_bytes`` the bytes per element of the copy of a fused gated linear unit's input (its
    gate and up projections' outputs) its backward keeps where the software stores it cast
    (Megatron-Core's ``activation_func_fp8_input_store``: 1), 0 where it keeps the input itself;
    ``attention_output_bytes`` the bytes per element of the one copy of a fused attention's output
    that both its own backward and its output projection's backward read, where the software keeps
    a single cast of that output for the two (DeepSeek-V3's report, section 3.3.3: E5M6, 12 bits,
    1.5), 0 where the attention keeps its output and the projection its own input (or FP8 cast);
    ``per_tensor_overflow_check`` True where the step on whole weights checks each gradient tensor
    for inf/nan with a host synchronization of its own (DeepSpeed's FP16_Optimizer), False where one
    multi-tensor kernel checks them all (or nothing is checked)."""

    name: str
    activation_bytes: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    compute_dtype: str
    optimizer_pass_bytes: float = 0.0
    linear_input_bytes: int = 0
    glu_input_bytes: int = 0
    attention_output_bytes: float = 0.0
    per_tensor_overflow_check: bool = False

    @property
    def elementwise_dtype(self) -> str:
        """The dtype of the kernels that are not GEMMs (bf16 under FP8 training)."""
        return "bf16" if self.compute_dtype == "fp8" else self.compute_dtype

    def __str__(self) -> str:
        return self.name


# Mixed precision with Adam: bf16 weights, fp32 main gradients, fp32 master weights + 2 moments
# (Megatron-LM without the distributed optimizer: 18 bytes per parameter).
MIXED_BF16 = Precision(
    "bf16-mixed", activation_bytes=2, param_bytes=2, grad_bytes=4, optimizer_bytes=12, compute_dtype="bf16"
)
FP32 = Precision("fp32", activation_bytes=4, param_bytes=4, grad_bytes=4, optimizer_bytes=8, compute_dtype="fp32")
