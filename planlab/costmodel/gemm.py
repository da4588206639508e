"""GEMM time by tile and wave quantization, as NVIDIA's "Matrix Multiplication Background"
user's guide describes it.

A GEMM ``C[m, n] = A[m, k] @ B[k, n]`` (``batch`` of them) is cut into output tiles of
``tm x tn``; each tile is one thread block that steps through ``k``. The tiles run in *waves*
over the GPU's streaming multiprocessors (SMs): 108 on an A100, so 109 tiles take two waves,
the second one nearly empty (*wave quantization*); a dimension that is not a multiple of the
tile computes the padding anyway (*tile quantization*). A larger tile reuses more of what it
loads (its arithmetic intensity is ``tm*tn / ((tm+tn) * element bytes)`` flop per byte) but
makes fewer tiles, so the library picks per shape; so does this model, the fastest of the
tile shapes the device lists. When the tiles do not fill the SMs and ``k`` is long, the
library splits ``k`` (split-K) and adds the partial results, which costs an extra pass over
the output in fp32.

``time = max(waves * tile_s, bytes / achieved_hbm) ``, where ``tile_s`` is the tile's
flop at the SM's share of the peak times the GEMM efficiency (the fraction of the peak the
best GEMMs reach; the tile's own arithmetic intensity, against the L2 bandwidth per SM,
may lower it), and ``bytes`` reads A and B and writes C once.

Hopper's GEMM kernels are persistent, one thread block per SM looping over the tiles, and their
stream-K scheduler splits the tiles of the last, partial wave along ``k`` over every SM (CUTLASS 3's
``PersistentTileSchedulerSm90StreamK``, include/cutlass/gemm/kernel/sm90_tile_scheduler_stream_k.hpp;
Osama et al., "Stream-K", PPoPP 2023). A device with ``stream_k`` therefore pays for ``tiles / SMs``
waves, not the next whole number, once its tiles fill the SMs; the partial sums' fix-up, through a
workspace the size of one wave's tiles, is not priced.

Each tile also pays a fixed cost that does not shrink with ``k``: filling its load pipeline
before the first multiply and writing its output after the last (prologue and epilogue). The
model counts it as ``tile_overhead_k`` more steps of ``k`` per tile (per split, under split-K),
so a short ``k`` reaches a smaller fraction of the peak than a long one, as measured GEMMs do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from planlab.errors import ConfigError

SPLIT_K = (1, 2, 3, 4, 6, 8, 12, 16)  # split-K factors the model tries (cuBLAS uses such small factors)
MIN_SPLIT_K = 128  # each split keeps at least this much of k


@dataclass(frozen=True)
class GemmSpec:
    """What the tile model needs of a GPU: its SMs, the best GEMMs' fraction of the peak, the
    L2 bandwidth that feeds the tiles and the tile shapes its GEMM library uses."""

    sm_count: int
    efficiency: float  # fraction of the dense peak the best-shaped large GEMMs reach
    l2_bytes_per_s: float
    tiles: tuple[tuple[int, int], ...] = field(
        default=((256, 128), (128, 256), (128, 128), (256, 64), (64, 256), (128, 64), (64, 128), (64, 64))
    )
    efficiency_fp8: float = 0.0  # fraction of the dense FP8 peak the best FP8 GEMMs reach (0: none measured)
    tile_overhead_k: int = 0  # a tile's prologue and epilogue, as that many more steps of k (0: none)
    # the same fixed cost in steps of an FP8 GEMM's k, which the tensor cores run at twice the rate (None: as
    # tile_overhead_k)
    tile_overhead_k_fp8: int | None = None
    stream_k: bool = False  # the last partial wave's tiles are split along k over all SMs (Hopper's kernels)
    # a block-scaled FP8 GEMM's (1 x 128 input, 128 x 128 weight scales, promoted to fp32 every 128 of k):
    # its fraction of the FP8 peak and its tile overhead in FP8 steps of k (0 / None: as the per-tensor FP8 GEMM's)
    efficiency_fp8_block: float = 0.0
    tile_overhead_k_fp8_block: int | None = None
    # each fused attention kernel ("flash2", "cudnn", ...) on this device as a kernel microbenchmark measured
    # it: (kernel, forward efficiency, backward efficiency, overhead k: its work per score element, the
    # softmax's exponential and rescaling, as that many more steps of k); a kernel not listed runs at the
    # GEMMs' efficiency with no overhead
    attention_efficiency: tuple[tuple[str, float, float, int], ...] = ()
    # the board power limit's ceiling on the tensor cores' multiply-add rate, as a fraction of the 16-bit dense
    # peak (0: none measured): past it the clock falls to keep the power within the limit
    power_ceiling: float = 0.0

    def fp8(self) -> GemmSpec:
        """The spec an FP8 GEMM runs by: the FP8 efficiency and tile overhead where they are measured, the
        16-bit ones where not."""
        over_k = self.tile_overhead_k if self.tile_overhead_k_fp8 is None else self.tile_overhead_k_fp8
        # the 16-bit GEMMs' power ceiling is not the FP8 ones' (another energy per multiply-add; none measured)
        return replace(
            self, efficiency=self.efficiency_fp8 or self.efficiency, tile_overhead_k=over_k, power_ceiling=0.0
        )

    def fp8_block(self) -> GemmSpec:
        """The spec a block-scaled FP8 GEMM runs by: its own efficiency and tile overhead where they are
        measured, the per-tensor FP8 GEMM's where not."""
        spec = self.fp8()
        over_k = spec.tile_overhead_k if self.tile_overhead_k_fp8_block is None else self.tile_overhead_k_fp8_block
        return replace(spec, efficiency=self.efficiency_fp8_block or spec.efficiency, tile_overhead_k=over_k)

    def attention(self, kernel: str, backward: bool) -> tuple[float, int]:
        """The efficiency fused attention kernel ``kernel`` runs at, its ``backward`` or its forward, and its
        overhead k (the GEMMs' efficiency and none where no measurement is given)."""
        for name, forward_eff, backward_eff, overhead_k in self.attention_efficiency:
            if name == kernel:
                return (backward_eff if backward else forward_eff), overhead_k
        return self.efficiency, 0

    def measured_attention(self, kernel: str) -> bool:
        """Whether ``attention_efficiency`` lists ``kernel`` (a measurement, not the GEMMs' fallback)."""
        return any(name == kernel for name, *_ in self.attention_efficiency)

    def __str__(self) -> str:
        return f"{self.sm_count} SMs, {self.efficiency:.3g} of peak, {len(self.tiles)} tiles"


def tile_efficiency(spec: GemmSpec, tm: int, tn: int, peak_flops_per_s: float, elem_bytes: int) -> float:
    """The fraction of the peak one ``tm x tn`` tile reaches: the GEMM efficiency (that of the
    best GEMMs, which use the tile of highest arithmetic intensity), lowered in proportion where
    a smaller tile's arithmetic intensity needs more L2 bandwidth per SM than the best one's."""

    def fed(a: int, b: int) -> float:  # fraction of the peak the L2 can feed a tile of a x b
        intensity = a * b / ((a + b) * elem_bytes)  # flop per byte loaded
        return min(1.0, spec.l2_bytes_per_s * intensity / peak_flops_per_s)

    best = max(fed(a, b) for a, b in spec.tiles)
    return spec.efficiency * fed(tm, tn) / best


def gemm_time_s(
    spec: GemmSpec,
    *,
    batch: int,
    m: int,
    n: int,
    k: int,
    elem_bytes: int,
    peak_flops_per_s: float,
    hbm_bytes_per_s: float,
) -> float:
    """Seconds for ``batch`` GEMMs of ``m x k`` by ``k x n`` (no launch cost): the fastest tile
    shape and split-K factor by tile and wave quantization (under ``stream_k``, fractional waves
    once the tiles fill the SMs), each tile with its fixed ``tile_overhead_k``, and at least the
    time to move A, B and C once through memory at ``hbm_bytes_per_s`` (already the achieved
    bandwidth)."""
    for name, v in (("batch", batch), ("m", m), ("n", n), ("k", k)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"GEMM dimension {name} must be an integer >= 1, got {v!r}")
    per_sm_peak = peak_flops_per_s / spec.sm_count
    best = math.inf
    for tm, tn in spec.tiles:
        eff = tile_efficiency(spec, tm, tn, peak_flops_per_s, elem_bytes)
        tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
        for split in SPLIT_K:
            if split > 1 and (tiles * split > spec.sm_count or k // split < MIN_SPLIT_K):
                continue  # split-K only fills SMs that would otherwise stay idle
            kk = math.ceil(k / split)
            waves = tiles * split / spec.sm_count
            if not (spec.stream_k and tiles > spec.sm_count):
                waves = math.ceil(waves)
            t = waves * 2.0 * tm * tn * (kk + spec.tile_overhead_k) / (per_sm_peak * eff)
            if spec.power_ceiling:  # the multiply-adds the tiles run (padding included) at the power-limited rate
                t = max(t, tiles * split * 2.0 * tm * tn * kk / (peak_flops_per_s * spec.power_ceiling))
            if split > 1:  # partial sums in fp32 written and read back once more
                t += 2.0 * split * batch * m * n * 4 / hbm_bytes_per_s
            best = min(best, t)
    t_mem = batch * (m * k + k * n + m * n) * elem_bytes / hbm_bytes_per_s
    return max(best, t_mem)


def gemm_flops(batch: int, m: int, n: int, k: int) -> float:
    """Multiply-adds of the GEMM, as flop (2 per multiply-add)."""
    return 2.0 * batch * m * n * k
