"""A GPU kernel's time where the profile measured no rate for its operator (a preset holds only the data
sheet's peaks and bandwidth): each kind of operator at the fraction of the data sheet such kernels reach,
by size.

  matrix products  tensor-core kernels compute the output in tiles, one tile per multiprocessor at a time:
                   a product whose tiles do not fill the last wave leaves multiprocessors idle (wave
                   quantization), and a short inner dimension spends more of each tile's time filling its
                   pipeline than multiplying; at full waves and a long inner dimension, MATMUL_EFFICIENCY of
                   the peak (a bf16 8192^3 product ran at 799 TFLOP/s on an H100 SXM, data sheet 989.4)
  attention        flash attention's kernels at ATTENTION_EFFICIENCY of the peak, forward and backward, on the
                   FLOPs torch's formulas count (the whole s x s scores; a causal kernel skips the masked half,
                   which these fractions include: every model shoal plans is causal)
  the rest         memory-bound (norms, element-wise, casts, the loss, reductions): bytes at
                   MEMORY_EFFICIENCY of the data sheet's bandwidth (a large copy reaches ~85-90% of it)
A kernel is never shorter than the host's time to launch it (the profile's per-operator cost): where
kernels are small the GPU waits on the host, where they are large the host runs ahead.
"""

from __future__ import annotations

import math

from shoal.hardware import HardwareProfile

TILE = 128  # the output tile of cuBLAS's tensor-core kernels on Ampere and Hopper, rows and columns
MATMUL_EFFICIENCY = 0.82  # 799 / 989.4 at k = 8192, over the inner dimension's k / (k + K_FILL)
K_FILL = 128  # the inner dimension at which a tile spends as long filling its pipeline as multiplying
# flash attention (FlashAttention-2, as torch's SDPA runs it on Ampere and Hopper) in FLOPs counted over the
# whole scores, causal: ~200-335 TFLOP/s forward on an H100 on the causal half (~0.2-0.35 of the peak),
# backward ~2/3 of the forward's rate; counted over the whole matrix, twice those
ATTENTION_EFFICIENCY = {"forward": 0.5, "backward": 0.35}
MEMORY_EFFICIENCY = 0.85


def matmul_seconds(flops: float, shape: tuple[int, int, int, int], peak: float, multiprocessors: int) -> float:
    """A (batch of) m x k by k x n product's seconds at `peak` FLOP/s: its tiles over the multiprocessors in
    waves, the last one partly idle, each tile at k / (k + K_FILL) of MATMUL_EFFICIENCY."""
    batch, m, n, k = shape
    tiles = batch * math.ceil(m / TILE) * math.ceil(n / TILE)
    waves = math.ceil(tiles / multiprocessors)
    fill = tiles / (waves * multiprocessors)
    return flops / (peak * MATMUL_EFFICIENCY * fill * k / (k + K_FILL))


def kernel_seconds(name: str, flops: float, moved: float, shape: tuple | None, profile: HardwareProfile,
                   dtype: str) -> float:
    """One operator's kernel on a GPU from the profile's peak and bandwidth: the data sheet's (a preset,
    taken at the fractions above) or the probe's measured ones (already what kernels reach: taken whole)."""
    measured = bool(profile.matmul_curve)
    bandwidth = (profile.memory_bandwidth or 1e11) * (1.0 if measured else MEMORY_EFFICIENCY)
    memory = moved / bandwidth
    if not flops:
        return memory
    peak = profile.peak_flops(dtype) / (MATMUL_EFFICIENCY if measured else 1.0)
    if shape is not None:
        return max(memory, matmul_seconds(flops, shape, peak, profile.multiprocessors or 1))
    if "attention" in name:
        return max(memory, flops / (peak * ATTENTION_EFFICIENCY["backward" if "backward" in name else "forward"]))
    return max(memory, flops / (peak * MATMUL_EFFICIENCY))


def fused_step_seconds(nbytes: float, profile: HardwareProfile) -> float:
    """An optimizer step by torch's fused kernels (and the clip's foreach norm and scale): memory-bound, its
    bytes at the bandwidth kernels reach, launched a few times over all the tensors."""
    measured = bool(profile.matmul_curve)
    return nbytes / ((profile.memory_bandwidth or 1e11) * (1.0 if measured else MEMORY_EFFICIENCY))
