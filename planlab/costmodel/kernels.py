"""The kernels one operator launches, by its kind, phase and local shapes, in a software
implementation (:class:`~planlab.costmodel.software.SoftwareSpec`).

Each operator of the graph becomes a short list of :class:`Kernel` s: GEMMs (priced by
:mod:`planlab.costmodel.gemm`) and memory-bound passes whose time is their traffic at the
achieved HBM bandwidth. ``calls`` counts the framework calls the host makes for it (each
costs the host's dispatch time; each kernel also its launch). The lists follow the code of
the implementations (shapes in comments: ``B`` batch, ``H`` heads, ``T`` sequence, ``D``
head dimension, ``N`` elements, ``eb`` bytes per activation element):

* ``linear`` (``x[..., K] @ W[N, K]^T + b``): forward one GEMM ``M x N x K`` with the bias
  in its epilogue; backward the input-gradient GEMM ``M x K x N``, the weight-gradient GEMM
  ``N x K x M``, the bias gradient (a reduction reading ``dy``) and, per parameter, the
  addition of this micro-batch's gradient into the accumulated one (PyTorch's autograd
  accumulates ``.grad`` by a separate kernel; Megatron-DeepSpeed keeps it).
  Projections reading one input that the software fuses (``fused_widths``: the output widths
  ``n_1, n_2, ...`` of the group, :mod:`planlab.plan.fused_gemms`: an attention's query, key and
  value with ``fused_qkv``, as Megatron's ``query_key_value``; a gated unit's gate and up
  projections with ``fused_gate_up``, as Megatron-Core's ``linear_fc1``) run as one GEMM each way:
  forward ``M x (n_1 + n_2 + ...) x K``, backward one input-gradient GEMM ``M x K x (n_1 + n_2 + ...)``
  (the input gradients summed in its reduction) and one weight-gradient GEMM
  ``(n_1 + n_2 + ...) x K x M``; each projection's task is charged its width's share of each (the
  kernel's ``computed``), the fused GEMM's launch in full.
* ``attention`` with ``megatron``: Megatron-LM's unfused core attention. Forward: the score
  GEMM ``baddbmm`` (``B*H`` GEMMs ``T x T x D``) writes the ``T x T`` scores, the fused
  scale-mask-softmax kernel reads and writes them (where Megatron's conditions for that kernel
  fail, :func:`fused_softmax_available`, PyTorch's five fp32 passes instead), attention dropout reads them and writes
  them and a one-byte mask, the context ``bmm`` (``T x D x T``) reads them, and the context is
  permuted into a contiguous ``[T, B, H*D]``. Backward: the permute's copy, the two GEMMs of
  the ``bmm``, dropout's and softmax's backward passes over the scores, the two GEMMs of the
  ``baddbmm``. With ``torch``, or ``megatron`` with the software's ``fused_attention``
  (Transformer Engine's flash / cuDNN fused attention in Megatron-Core): one fused attention kernel
  each way, priced as a GEMM of the same flop; the backward computes the scores again, 2.5 times
  the forward's flop (Dao, "FlashAttention-2", 2023, section 4.1: the backward's five matrix
  products against the forward's two). Under a causal mask (``causal``) the fused kernel computes
  only the blocks of queries and keys that the mask does not hide entirely, the diagonal ones in
  full (:func:`flash_causal_share`); the unfused path computes every score and masks them after.
* ``layer_norm``: one pass forward (apex's fused kernel: read ``x``, write ``y``); backward
  the input gradient (read ``dy``, ``x``, write ``dx``) and the weight gradients (read
  ``dy``, ``x``), then accumulation of both weight gradients.
* ``activation``, ``dropout``, ``softmax``, ``add``, ``mul``, ``copy``: element-wise
  passes (dropout writes and reads a one-byte mask); an ``add`` has no backward kernel unless
  it broadcast one input (then a reduction).
* ``embedding`` (and the vocabulary-parallel ``vocab_embedding``, which first masks the ids
  outside its shard and zeroes their rows): forward a gather; backward PyTorch's dense
  embedding backward (zero the table's gradient, sort the ids, add the rows) and the
  accumulation.
* ``cross_entropy`` (and ``vocab_cross_entropy``) with ``megatron``: Megatron's
  vocabulary-parallel cross entropy on fp32 logits: the conversion to fp32, max, subtract,
  exp, sum, divide (forward), multiply by the incoming gradient and the conversion back
  (backward), each a pass over the logits. With ``torch``: log-softmax and the loss's gather,
  backward their gradients.
* views (``reshape``, ``transpose``, ``permute``, ...): no kernel, one call each way.
* ``matmul``: a batched GEMM; backward two. An expert stack's products with a weight fused as a
  linear layer's are (``fused_widths``): one batched GEMM of the summed width each way, each
  charged its share.

FP8 (``fp8=True``: the precision computes GEMMs in FP8, everything else in 16 bits): a
``linear``'s GEMMs (and, with ``fp8_matmul``, those of a matrix product with a weight: the experts')
run in FP8, after casts that read the 16-bit tensor and write its FP8 copy and the transposed copy
the other GEMM of the backward reads: Transformer Engine's fused
cast-transpose with delayed scaling (``megatron``) for the input and the weight forward and the
output gradient backward; torchao's Float8 linear with dynamic tensorwise scaling (``torch``)
first reads each tensor once more for its absolute maximum. Projections run as one fused GEMM are
one module (Megatron-Core's ``linear_qkv``, ``linear_fc1``: one Transformer Engine linear or
grouped linear), which casts the input they share once: each is charged its width's share of
that cast. The model's output projection stays in 16 bits (``Task.output_layer``: torchtitan's
Float8 filter leaves ``output`` out, Megatron-Core's ``output_layer`` is no Transformer Engine module).
A software that keeps the weights' casts across a step's micro-batches (``fp8_weight_cache``,
Transformer Engine's ``is_first_microbatch``) charges each forward its share of one cast a step
(``weight_casts``).

``None`` for kinds not listed: the cost model then prices the task by its flop and bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planlab.errors import KernelFormulaError

VIEW_KINDS = frozenset({"reshape", "transpose", "permute", "expand", "getitem", "view"})
INDEX_BYTES = 8  # int64 token ids
SCALE_BYTES, SCALE_BLOCK = 4, 128  # block-scaled FP8: one fp32 scale per 128 elements (per 128 x 128 of a weight)

# FlashAttention-2's blocks, (queries kBlockM, keys kBlockN), forward then backward, by the head
# dimension it rounds up to, as its launch templates pick them on an A100 or H100 without attention
# dropout (shared memory per block >= 144 KB): run_mha_fwd_hdimN in
# csrc/flash_attn/src/flash_fwd_launch_template.h and run_mha_bwd_hdimN in flash_bwd_launch_template.h
# (github.com/Dao-AILab/flash-attention). The H100 takes 64 x 64 forward at head dimension 256.
FLASH_BLOCKS = {
    32: ((128, 128), (128, 128)),
    64: ((128, 128), (128, 128)),
    96: ((128, 64), (64, 128)),
    128: ((128, 64), (64, 128)),
    192: ((128, 64), (64, 64)),
    256: ((128, 64), (64, 64)),
}


@dataclass(frozen=True)
class Kernel:
    """One kernel: a batched GEMM ``(batch, m, n, k)`` or a memory-bound pass moving ``bytes`` (a fused
    kernel priced as a GEMM: ``bytes`` is its memory traffic, which bounds its time); ``weight`` marks a backward kernel that computes or accumulates a weight's gradient."""

    name: str
    bytes: float = 0.0
    gemm: tuple[int, int, int, int] | None = None
    weight: bool = False
    fp8: bool = False  # a GEMM on FP8 operands (the device's FP8 peak and efficiency)
    block: bool = False  # an FP8 GEMM with block scales (1 x 128 inputs, 128 x 128 weights: GemmSpec.fp8_block)
    fused: bool = False  # a fused kernel priced as a GEMM of its flop (flash attention): no per-tile k overhead
    computed: float = 1.0  # the share of its blocks the kernel computes (a causal flash kernel skips the masked ones)
    backward: bool = False  # a fused kernel's backward (its own kernel, at its own measured efficiency)
    # a batched GEMM of an unfused attention core (Megatron's baddbmm and bmm and their backward), which writes or
    # reads the T x S scores: at the device's measured "unfused" attention efficiency where it has one
    core: bool = False

    def __str__(self) -> str:
        if self.gemm:
            b, m, n, k = self.gemm
            part = f" x{self.computed:.3g}" if self.computed != 1.0 else ""
            return f"{self.name}[{b}x{m}x{n}x{k}{part}]"
        return f"{self.name}[{self.bytes / 2**20:.3g} MiB]"


@dataclass(frozen=True)
class OpKernels:
    """The kernels of one operator piece in one phase, and the framework calls that issue them."""

    kernels: tuple[Kernel, ...]
    calls: int

    def part(self, *, inputs: bool, weights: bool) -> OpKernels:
        """The kernels of a backward's input-gradient part (``inputs``), its weight-gradient part
        (``weights``; zero-bubble's ``I`` and ``W`` tasks) or both; the calls shared in proportion
        to the kernels, at least one for a part that has any."""
        kept = tuple(k for k in self.kernels if (weights if k.weight else inputs))
        if len(kept) == len(self.kernels):
            return self
        if not kept:
            return OpKernels((), 0)
        return OpKernels(kept, max(1, round(self.calls * len(kept) / len(self.kernels))))

    def __str__(self) -> str:
        return f"{self.calls} calls: " + ", ".join(str(k) for k in self.kernels)


def _n(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _pass(name: str, nbytes: float, weight: bool = False) -> Kernel:
    return Kernel(name, bytes=float(nbytes), weight=weight)


def _gemm(
    name: str,
    batch: int,
    m: int,
    n: int,
    k: int,
    weight: bool = False,
    fp8: bool = False,
    fused: bool = False,
    computed: float = 1.0,
    nbytes: float = 0.0,
    backward: bool = False,
    core: bool = False,
    block: bool = False,
) -> Kernel:
    return Kernel(
        name,
        bytes=float(nbytes),
        gemm=(int(batch), int(m), int(n), int(k)),
        weight=weight,
        fp8=fp8,
        block=block,
        fused=fused,
        computed=computed,
        backward=backward,
        core=core,
    )


def flash_causal_share(t: int, s: int, head_dim: int, backward: bool) -> float:
    """The share of the ``kBlockM x kBlockN`` blocks of a ``t x s`` score matrix (queries by keys)
    that FlashAttention-2 computes under a causal mask (:data:`FLASH_BLOCKS` by ``head_dim``, the
    ``backward`` kernel's or the forward's). The mask is aligned to the bottom right (query ``i``
    sees keys up to ``i + s - t``, FlashAttention 2.1 on); a block the mask hides entirely is
    skipped and one it crosses is computed in full, then masked (Dao, "FlashAttention-2", 2023,
    section 3.1.1). The forward loops over key blocks up to the last its query block sees
    (``n_block_max`` in flash_fwd_kernel.h); the backward, per key block, over the query blocks
    from the first that sees it (``m_block_min`` in flash_bwd_kernel.h)."""
    dim = next((h for h in FLASH_BLOCKS if head_dim <= h), max(FLASH_BLOCKS))
    bm, bn = FLASH_BLOCKS[dim][1 if backward else 0]
    rows, cols = -(-t // bm), -(-s // bn)  # query blocks, key blocks
    if backward:
        done = sum(rows - min(rows, max(0, (n * bn + t - s) // bm)) for n in range(cols))
    else:
        done = sum(min(cols, max(0, -(-((m + 1) * bm + s - t) // bn))) for m in range(rows))
    return done / (rows * cols)


def _accumulate(params: list[tuple[int, ...]], eb: int) -> list[Kernel]:
    """Adding this micro-batch's weight gradients into the accumulated ones (read both, write one)."""
    return [_pass("grad-accumulate", 3 * _n(p) * eb, True) for p in params]


def op_kernels(
    kind: str,
    phase: str,
    shapes: tuple[tuple[int, ...], ...],
    eb: int,
    implementation: str = "torch",
    fp8: bool = False,
    fused_softmax: bool = True,
    fused_attention: bool = False,
    causal: bool = False,
    fused_rms_norm: bool = True,
    fused_widths: tuple[int, ...] = (),
    fp8_matmul: bool = False,
    weight_casts: float = 1.0,
    fp8_gathered: bool = False,
    fp8_block: bool = False,
) -> OpKernels | None:
    """The kernels of one piece of an operator of ``kind`` in ``phase`` (``"F"`` or ``"B"``),
    given the local shapes of its inputs then outputs and ``eb`` bytes per activation element
    (``fp8``: linear layers' GEMMs in FP8, see the module docstring); None when the kind is not
    modelled (no formula for the kind, no shapes given, or a matrix product of a vector: the
    roofline prices those). ``fused_softmax`` False: Megatron's attention masks and normalizes its
    scores in separate kernels (:func:`unfused_softmax_2019`); ``fused_attention`` True: Megatron's
    attention runs fused, as ``torch``'s does; ``causal``: the attention is causal, so a fused
    kernel skips the blocks its mask hides (:func:`flash_causal_share`); ``fused_rms_norm`` False:
    RMSNorm as eager PyTorch's element-wise kernels (:func:`eager_rms_norm`); ``fused_widths``: a linear
    layer's (or a weight product's) GEMMs are its share of one fused with its siblings' (the output
    widths of all, its own included; see the module docstring); ``fp8_matmul``: a matrix product with
    a weight runs in FP8 with its casts, as a linear layer's GEMMs do under ``fp8``; ``weight_casts``:
    the share of its weight's FP8 cast an FP8 forward makes (1: every forward casts it; ``1 / M``:
    the software keeps the cast across a step's ``M`` micro-batches, each charged its share; 0: a
    forward that reads the kept cast, no cast kernel); ``fp8_gathered``: the weight arrived in FP8 from a
    ZeRO-3 gather (cast on the shard before it): no cast forward, and the backward copies it into the
    transposed layout its input-gradient GEMM reads (torchao: ``_scaled_mm`` takes its second operand
    column-major, ``preprocess_addmm`` copies a row-major one); ``fp8_block``: FP8 with block scales
    (1 x 128 tiles of activations and gradients, 128 x 128 blocks of weights), block-scaled GEMMs and
    casts that write the scales too. A formula that fails on the shapes
    it is given is a bug: KernelFormulaError, never a silent roofline."""
    if kind in VIEW_KINDS and kind not in _KINDS:
        return OpKernels((), 1)
    if kind not in _KINDS or not shapes or (kind == "matmul" and min(len(s) for s in shapes[:2]) < 2):
        return None
    try:
        if kind == "attention":
            impl = "torch" if fused_attention else implementation
            return _attention(phase, shapes, eb, impl, fused_softmax, causal)
        if kind == "linear" and fp8:
            return _linear_fp8(phase, shapes, eb, implementation, fused_widths, weight_casts, fp8_gathered, fp8_block)
        if kind == "linear":
            return _linear(phase, shapes, eb, implementation, fused_widths)
        if kind == "matmul" and fp8 and fp8_matmul:
            return _matmul_fp8(phase, shapes, eb, implementation, fused_widths, weight_casts, fp8_gathered, fp8_block)
        if kind == "matmul":
            return _matmul(phase, shapes, eb, implementation, fused_widths)
        if kind == "rms_norm" and not fused_rms_norm:
            return eager_rms_norm(phase, shapes, eb)
        return _KINDS[kind](phase, shapes, eb, implementation)
    except (IndexError, ValueError, ZeroDivisionError, TypeError, KeyError) as e:
        raise KernelFormulaError(
            f"the kernel formula of {kind!r} ({phase}) failed on shapes {shapes}: {e!r}; a bug in "
            "planlab.costmodel.kernels (the shapes come from the plan's Program)"
        ) from e


def _linear_gemms(phase, m, n, k, fused_widths, fp8=False, block=False):
    """A linear layer's GEMMs, ``m x n x k`` forward, input- then weight-gradient backward; with
    ``fused_widths`` (the output widths of the GEMM it is fused into, its ``n`` among them) the
    fused GEMMs of the summed width, each computing this layer's share."""
    width = sum(fused_widths) if fused_widths else n
    share = n / width
    if phase == "F":
        return [_gemm("gemm", 1, m, width, k, fp8=fp8, computed=share, block=block)]
    return [
        _gemm("gemm-dgrad", 1, m, k, width, fp8=fp8, computed=share, block=block),
        _gemm("gemm-wgrad", 1, width, k, m, True, fp8=fp8, computed=share, block=block),
    ]


def _linear(phase, shapes, eb, impl, fused_widths=()):
    x, w = shapes[0], shapes[1]
    has_bias = len(shapes) == 4
    k = x[-1]
    m = _n(x) // k
    n = w[0]
    if phase == "F":
        return OpKernels(tuple(_linear_gemms(phase, m, n, k, fused_widths)), 1)
    ks = _linear_gemms(phase, m, n, k, fused_widths)
    if has_bias:
        ks.append(_pass("bias-grad", m * n * eb + n * eb, True))
    params = [w] + ([shapes[2]] if has_bias else [])
    return OpKernels(tuple(ks + _accumulate(params, eb)), 1 + len(params))


def _linear_fp8(phase, shapes, eb, impl, fused_widths=(), weight_casts=1.0, fp8_gathered=False, block=False):
    """A linear layer with FP8 GEMMs: each cast reads the 16-bit tensor and writes its FP8 copy
    and the transposed copy (``eb + 2`` bytes per element); dynamic scaling (``torch``) reads it once
    more for its absolute maximum. The weight's cast is charged ``weight_casts`` of its traffic
    (:func:`op_kernels`), and left out at 0 or for a weight gathered in FP8 (``fp8_gathered``), whose
    backward copies it into its transposed layout instead (read and write one byte an element). With
    ``block`` scales (DeepSeek-V3's recipe) the GEMMs are block-scaled and each cast also writes its
    scales, one fp32 per 128 elements of each copy (per 128 x 128 of a weight)."""
    x, w = shapes[0], shapes[1]
    has_bias = len(shapes) == 4
    k = x[-1]
    m = _n(x) // k
    n = w[0]
    per = eb + 2 + (eb if impl == "torch" else 0)  # bytes per element of a cast
    share = n / sum(fused_widths) if fused_widths else 1.0  # a fused GEMM's one module casts its input once
    tile, square = _scale_bytes(block)

    def cast(name: str, elems: float, weight: bool = False) -> Kernel:
        return _pass(name, elems * (per + tile), weight)

    if phase == "F":
        weight = _fp8_weight_cast(n * k * (per + square), weight_casts, fp8_gathered)
        return OpKernels(
            (
                cast("fp8-cast-input", m * k * share),
                *weight,
                *_linear_gemms(phase, m, n, k, fused_widths, True, block),
            ),
            2 + len(weight),
        )
    ks = [
        cast("fp8-cast-grad", m * n),
        *_fp8_transpose(n * k, fp8_gathered),
        *_linear_gemms(phase, m, n, k, fused_widths, True, block),
    ]
    if has_bias:
        ks.append(_pass("bias-grad", m * n * eb + n * eb, True))
    params = [w] + ([shapes[2]] if has_bias else [])
    return OpKernels(tuple(ks + _accumulate(params, eb)), 2 + len(params))


def _attention(phase, shapes, eb, impl, fused_softmax=True, causal=False):
    q, kk, v, o = shapes[0], shapes[1], shapes[2], shapes[-1]
    t, d = q[-2], q[-1]
    s = kk[-2]
    e = v[-1]
    bh = _n(q[:-2])
    scores = bh * t * s  # elements of the T x S score matrix, over batch and heads
    if impl != "megatron":  # one fused (flash) kernel each way, priced as a GEMM of the same flop; its
        # blocks loop over the keys, so its prologue and epilogue are not paid per T x S tile of d + e.
        # It writes no score matrix: its memory traffic is its operands, read or written once (forward:
        # Q, K, V in, O out; backward: Q, K, V, O, dO in, dQ, dK, dV out; Dao, FlashAttention-2, 2023,
        # algorithms 1 and 2), not a GEMM's T x S output
        share = flash_causal_share(t, s, max(d, e), phase != "F") if causal else 1.0
        operands = (_n(q) + _n(kk) + _n(v) + _n(o)) * eb
        if phase == "F":
            return OpKernels(
                (_gemm("flash-attention", bh, t, s, d + e, fused=True, computed=share, nbytes=operands),), 1
            )
        k_bwd = int(2.5 * (d + e))
        return OpKernels(
            (
                _gemm(
                    "flash-attention-bwd",
                    bh,
                    t,
                    s,
                    k_bwd,
                    fused=True,
                    computed=share,
                    nbytes=2 * operands,
                    backward=True,
                ),
            ),
            1,
        )
    ctx = _n(o) * eb
    softmax = (
        _megatron_softmax(phase, bh, t, s, scores, eb)
        if fused_softmax
        else unfused_softmax_2019(phase, scores, _n(q) + _n(kk), eb)
    )
    if phase == "F":
        return OpKernels(
            (
                _gemm("baddbmm-scores", bh, t, s, d, core=True),
                *softmax,
                _pass("attention-dropout", scores * (2 * eb + 1)),
                _gemm("bmm-context", bh, t, e, s, core=True),
                _pass("permute-contiguous", 2 * ctx),
            ),
            11 + len(softmax),
        )  # the kernels' calls and the views between them (view, transpose, empty, permute)
    return OpKernels(
        (
            _pass("permute-contiguous", 2 * ctx),
            _gemm("bmm-grad-probs", bh, t, s, e, backward=True, core=True),
            _gemm("bmm-grad-value", bh, s, e, t, backward=True, core=True),
            _pass("attention-dropout-bwd", scores * (2 * eb + 1)),
            *softmax,
            _gemm("baddbmm-grad-query", bh, t, d, s, backward=True, core=True),
            _gemm("baddbmm-grad-key", bh, s, d, t, backward=True, core=True),
        ),
        9 + len(softmax),
    )


def fused_softmax_available(attn_batches: int, sq: int, sk: int) -> bool:
    """Megatron-LM's FusedScaleMaskSoftmax.is_kernel_available for a causal mask in fp16/bf16: the
    fused kernel needs ``16 < sk <= 4096``, ``sq`` and ``sk`` multiples of 4 and the batch x heads
    a multiple of the kernel's batches per block (4 for ``sk > 128``, 8 below)."""
    per_block = 4 if sk > 128 else 8  # 128 threads: 4 warps, one row each, or two rows per warp up to 128
    return 16 < sk <= 4096 and sq % 4 == 0 and sk % 4 == 0 and attn_batches % per_block == 0


def _megatron_softmax(phase: str, bh: int, t: int, s: int, scores: int, eb: int) -> list[Kernel]:
    """The scale-mask-softmax of Megatron's attention: one fused kernel each way, or, where the
    fused kernel is not available, PyTorch's path in fp32 (convert, scale, mask, softmax, convert
    back; backward the same passes in reverse)."""
    if fused_softmax_available(bh, t, s):
        return [
            _pass("scale-mask-softmax" + ("" if phase == "F" else "-bwd"), (2 if phase == "F" else 3) * scores * eb)
        ]
    f32 = 4
    if phase == "F":
        return [
            _pass("scores-to-fp32", scores * (eb + f32)),
            _pass("scale", 2 * scores * f32),
            _pass("mask-fill", scores * (2 * f32 + 1)),
            _pass("softmax-fp32", 2 * scores * f32),
            _pass("probs-to-half", scores * (f32 + eb)),
        ]
    return [
        _pass("grad-to-fp32", scores * (eb + f32)),
        _pass("softmax-fp32-bwd", 3 * scores * f32),
        _pass("mask-fill-bwd", scores * (2 * f32 + 1)),
        _pass("scale-bwd", 2 * scores * f32),
        _pass("grad-to-half", scores * (f32 + eb)),
    ]


def unfused_softmax_2019(phase: str, scores: int, qk: int, eb: int) -> list[Kernel]:
    """Megatron-LM 2019's scaling, masking and softmax (``mpu/transformer.py``,
    GPT2ParallelSelfAttention): query and key (``qk`` elements together) each divided by the fourth
    root of the head size before the score GEMM, then
    ``torch.mul(scores, mask) - 10000 * (1 - mask)`` and ``torch.nn.Softmax``, each its own kernel
    over the scores in the model's half precision (the mask is one ``s x s`` matrix broadcast over
    batch and heads, read from cache). Backward: softmax's (read the probabilities and their
    gradient, write one) and the multiplication's by the mask; the subtraction passes its gradient
    through."""
    scale = _pass("scale-query-key" + ("" if phase == "F" else "-bwd"), 2 * qk * eb)
    if phase == "F":
        return [
            scale,
            _pass("mask-mul", 2 * scores * eb),
            _pass("mask-sub", 2 * scores * eb),
            _pass("softmax", 2 * scores * eb),
        ]
    return [_pass("softmax-bwd", 3 * scores * eb), _pass("mask-mul-bwd", 2 * scores * eb), scale]


def _layer_norm(phase, shapes, eb, impl):
    x = shapes[0]
    n = _n(x)
    params = [p for p in shapes[1:-1]]
    rows = n // max(1, _n(params[0]) if params else x[-1])
    if phase == "F":
        return OpKernels((_pass("layer-norm", 2 * n * eb + rows * 8),), 1)
    ks = [_pass("layer-norm-dx", 3 * n * eb + rows * 8)]
    if params:
        ks.append(_pass("layer-norm-dweight", 2 * n * eb, True))
    return OpKernels(tuple(ks + _accumulate(params, eb)), 1 + len(params))


def eager_rms_norm(phase: str, shapes, eb: int) -> OpKernels:
    """torchtitan's 2024 ``RMSNorm`` (torchtitan/models/norms.py at 3faaa1a0d and 9dec370, norm_type
    "rmsnorm"): ``(x.float() * rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * w``,
    one eager kernel per operation. Forward (``n`` elements, ``eb`` bytes each, fp32 4): the cast to
    fp32, ``pow``, ``mean``, ``+ eps`` and ``rsqrt`` (one value per row), the product, the cast back,
    the product by the weight. Backward, autograd's kernels in reverse: the weight product's two
    gradients (the input's, and the weight's product and sum over rows), the cast back's (to fp32),
    the normalizing product's two (the input's, and ``rsqrt``'s: a product and a sum over the row),
    ``rsqrt``'s, the mean's (broadcast over the row), ``pow``'s (``2 x`` times the gradient), the sum of
    the input's two gradients, and the cast's (to 16 bits); then the weight's accumulation."""
    x = shapes[0]
    n = _n(x)
    w = shapes[1] if len(shapes) > 2 else None
    rows = n // max(1, x[-1])
    f32 = 4
    if phase == "F":
        ks = [
            _pass("to-fp32", n * (eb + f32)),
            _pass("pow", 2 * n * f32),
            _pass("mean", n * f32 + rows * f32),
            _pass("add-eps", 2 * rows * f32),
            _pass("rsqrt", 2 * rows * f32),
            _pass("normalize", 2 * n * f32 + rows * f32),
            _pass("to-half", n * (f32 + eb)),
        ]
        if w is not None:
            ks.append(_pass("weight-mul", 3 * n * eb))
        return OpKernels(tuple(ks), len(ks))
    ks = []
    if w is not None:
        ks += [
            _pass("weight-mul-dx", 2 * n * eb),
            _pass("weight-mul-dw", 3 * n * eb, True),
            _pass("weight-mul-dw-sum", n * eb, True),
        ]
    ks += [
        _pass("to-half-bwd", n * (eb + f32)),
        _pass("normalize-dx", 2 * n * f32 + rows * f32),
        _pass("normalize-drsqrt", 3 * n * f32),
        _pass("normalize-drsqrt-sum", n * f32 + rows * f32),
        _pass("rsqrt-bwd", 3 * rows * f32),
        _pass("mean-bwd", n * f32 + rows * f32),
        _pass("pow-bwd", 3 * n * f32),
        _pass("add-grads", 3 * n * f32),
        _pass("to-fp32-bwd", n * (f32 + eb)),
    ]
    acc = _accumulate([w], eb) if w is not None else []
    return OpKernels(tuple(ks + acc), len(ks) + len(acc))


def _elementwise(reads_f: float, reads_b: float):
    def f(phase, shapes, eb, impl):
        n = _n(shapes[-1])
        return OpKernels((_pass("elementwise", (reads_f if phase == "F" else reads_b) * n * eb),), 1)

    return f


def _dropout(phase, shapes, eb, impl):
    n = _n(shapes[-1])
    return OpKernels((_pass("dropout" if phase == "F" else "dropout-bwd", n * (2 * eb + 1)),), 1)


def _add(phase, shapes, eb, impl):
    out = _n(shapes[-1])
    ins = [_n(s) for s in shapes[:-1]]
    if phase == "F":
        return OpKernels((_pass("add", (sum(ins) + out) * eb),), 1)
    reduce = [_pass("add-bwd-reduce", (out + i) * eb) for i in ins if i != out]  # broadcast: sum its gradient
    return OpKernels(tuple(reduce), 1)


def _mul(phase, shapes, eb, impl):
    out = _n(shapes[-1])
    ins = [_n(s) for s in shapes[:-1]]
    if phase == "F":
        return OpKernels((_pass("mul", (sum(ins) + out) * eb),), 1)
    return OpKernels(tuple(_pass("mul-bwd", (2 * out + i) * eb) for i in ins), 1)


def _copy(phase, shapes, eb, impl):
    n = _n(shapes[-1])
    return OpKernels((_pass("copy", 2 * n * eb),), 1) if phase == "F" else OpKernels((), 1)


def _embedding(phase, shapes, eb, impl, vocab_parallel=False):
    idx, table = shapes[0], shapes[1]
    t = _n(idx)
    v, h = table[0], _n(table[1:])
    if phase == "F":
        ks = [_pass("embedding-gather", t * INDEX_BYTES + 2 * t * h * eb)]
        calls = 1
        if vocab_parallel:  # Megatron's VocabParallelEmbedding: mask ids outside the shard, zero their rows
            ks = [_pass("ids-mask", 4 * t * INDEX_BYTES) for _ in range(4)] + ks + [_pass("rows-mask", 2 * t * h * eb)]
            calls = 7
        return OpKernels(tuple(ks), calls)
    ks = [
        _pass("embedding-bwd-zero", v * h * eb, True),
        _pass("embedding-bwd-sort", 4 * t * INDEX_BYTES, True),
        _pass("embedding-bwd-segments", 4 * t * INDEX_BYTES, True),
        _pass("embedding-bwd-add", 3 * t * h * eb, True),
    ]
    return OpKernels(tuple(ks + _accumulate([table], eb)), 2)


def _cross_entropy(phase, shapes, eb, impl):
    logits = shapes[0]
    n = _n(logits)
    rows = n // logits[-1]
    if impl == "megatron":  # vocabulary-parallel cross entropy on fp32 logits (Megatron-LM)
        f32 = 4
        if phase == "F":
            ks = [_pass("to-fp32", n * (eb + f32))] if eb != f32 else []
            ks += [
                _pass("max", n * f32),
                _pass("subtract-max", 2 * n * f32),
                _pass("exp", 2 * n * f32),
                _pass("sum-exp", n * f32),
                _pass("softmax-divide", 2 * n * f32),
            ]
            ks += [_pass("target-logit", 8 * rows * f32) for _ in range(6)]  # masks, gather, log, loss
            return OpKernels(tuple(ks), 14)
        ks = [_pass("target-one-hot", 4 * rows * f32), _pass("grad-multiply", 2 * n * f32)]
        ks += [_pass("to-half", n * (f32 + eb))] if eb != f32 else []
        return OpKernels(tuple(ks), 4)
    if phase == "F":
        return OpKernels((_pass("log-softmax", 2 * n * eb), _pass("nll-loss", 4 * rows * eb)), 2)
    return OpKernels((_pass("nll-loss-bwd", n * eb), _pass("log-softmax-bwd", 3 * n * eb)), 2)


def _matmul(phase, shapes, eb, impl, fused_widths=(), fp8=False, block=False):
    a, b = shapes[0], shapes[1]  # both matrices or stacks of them (op_kernels leaves vectors to the roofline)
    m, k = a[-2], a[-1]
    n = b[-1]
    batch = _n(shapes[-1][:-2])
    width = sum(fused_widths) if fused_widths else n  # fused with its siblings: their summed width
    share = n / width
    if phase == "F":
        return OpKernels((_gemm("bmm", batch, m, width, k, fp8=fp8, computed=share, block=block),), 1)
    return OpKernels(
        (
            _gemm("bmm-grad-a", batch, m, k, width, fp8=fp8, computed=share, block=block),
            _gemm("bmm-grad-b", batch, k, width, m, fp8=fp8, computed=share, block=block),
        ),
        1,
    )


def _scale_bytes(block: bool) -> tuple[float, float]:
    """Bytes per element the block scales of a cast add, (an activation's or gradient's, a weight's): one
    fp32 scale per 1 x 128 tile of the row-wise copy and per 128 x 1 tile of the column-wise one, or per
    128 x 128 block of each weight copy (DeepSeek-V3 report, section 3.3.2); none per tensor."""
    if not block:
        return 0.0, 0.0
    return 2 * SCALE_BYTES / SCALE_BLOCK, 2 * SCALE_BYTES / SCALE_BLOCK**2


def _fp8_weight_cast(nbytes: float, weight_casts: float, gathered: bool) -> tuple[Kernel, ...]:
    """The forward's cast of a weight to FP8 (``nbytes`` its traffic), charged ``weight_casts`` of it
    (:func:`op_kernels`); nothing where the forward reads a kept cast (0) or a weight gathered in FP8."""
    return (_pass("fp8-cast-weight", nbytes * weight_casts),) if weight_casts and not gathered else ()


def _fp8_transpose(elems: float, gathered: bool) -> tuple[Kernel, ...]:
    """The backward's copy of a weight gathered in FP8 into its transposed layout (one byte an element
    read and written), or nothing for a weight the forward's cast transposed already."""
    return (_pass("fp8-transpose-weight", 2 * elems),) if gathered else ()


def _matmul_fp8(phase, shapes, eb, impl, fused_widths=(), weight_casts=1.0, fp8_gathered=False, block=False):
    """A matrix product with a weight (the experts' grouped GEMMs) in FP8, as :func:`_linear_fp8` runs a
    linear layer's: forward the casts of both operands (16-bit read, the FP8 copy and its transpose
    written; the weight's charged ``weight_casts`` of it, as a linear layer's), backward the cast of
    the output gradient, each GEMM on FP8 operands (Transformer Engine's GroupedLinear:
    fp8_multi_cast_transpose_fused, then fp8_grouped_gemm)."""
    a, b, out = shapes[0], shapes[1], shapes[-1]
    per = eb + 2 + (eb if impl == "torch" else 0)  # bytes per element of a cast, as a linear layer's
    tile, square = _scale_bytes(block)
    gemms = _matmul(phase, shapes, eb, impl, fused_widths, fp8=True, block=block)
    share = b[-1] / sum(fused_widths) if fused_widths else 1.0  # one fused module casts its input once
    if phase == "F":
        weight = _fp8_weight_cast(_n(b) * (per + square), weight_casts, fp8_gathered)
        casts = (_pass("fp8-cast-input", _n(a) * (per + tile) * share), *weight)
        return OpKernels(casts + gemms.kernels, 2 + len(weight))
    grad = _pass("fp8-cast-grad", _n(out) * (per + tile))
    return OpKernels((grad, *_fp8_transpose(_n(b), fp8_gathered), *gemms.kernels), 2)


_KINDS = {
    "linear": _linear,
    "attention": _attention,
    "layer_norm": _layer_norm,
    "layer_norm_fn": _layer_norm,
    "rms_norm": _layer_norm,
    "activation": _elementwise(2, 3),
    "softmax": _elementwise(2, 3),
    "dropout": _dropout,
    "add": _add,
    "mul": _mul,
    "copy": _copy,
    "embedding": _embedding,
    "vocab_embedding": lambda p, s, e, i: _embedding(p, s, e, i, vocab_parallel=True),
    "cross_entropy": _cross_entropy,
    "vocab_cross_entropy": _cross_entropy,
    "matmul": _matmul,
}
