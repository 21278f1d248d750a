"""How much `shoal probe` measures, by device: the sizes of its matmul curve, its copy, and the reference GPT
whose training steps it times operator by operator (plan/probe/steps.py) and which it trains in each strategy to
calibrate the planner (plan/calibrate.py).

On a CPU the reference is small (2 blocks of 128-512, 4 sequences of 128 byte tokens) and the matmuls 128^3 to
1024^3: a 2-core machine runs them in seconds. On a GPU such sizes only time kernel launches (a 1024^3 bf16
matmul is ~3 us of an H100's work), so there the curve runs 256^3 to 8192^3 (fp32 to 4096^3: ~2 ms a call
already), the copy moves 1 GiB, and the reference GPT has GPT-2's head size, 1024-token sequences and a vocabulary
of 8192 (its fp32 logits 128 MiB a step), so that its tensors span ~1 KiB (a bias's update) to ~100 MiB, as a
real model's do; its steps are timed in fp32 and again in bf16 under autocast, as a GPU user trains.
"""

from __future__ import annotations

from dataclasses import dataclass

KIB, MIB, GIB = 2 ** 10, 2 ** 20, 2 ** 30


@dataclass(frozen=True)
class Reference:
    """The probe's reference GPT: 2 blocks at each of `widths`, `batch` sequences of `seq_len` tokens a step,
    a vocabulary of `vocab`; `head_dim` None: 4 heads at every width. Its steps are timed in each of
    `dtypes` (fp32: plain; bf16 or fp16: the forward and loss under autocast); the calibration trains it
    in `calibration_dtype`, `calibration_repeats` runs per width."""

    widths: tuple[int, ...]
    batch: int
    seq_len: int
    vocab: int
    head_dim: int | None = None
    dtypes: tuple[str, ...] = ("fp32",)
    calibration_dtype: str = "fp32"
    calibration_repeats: int = 2

    def heads(self, width: int) -> int:
        return 4 if self.head_dim is None else max(width // self.head_dim, 1)


CPU_REFERENCE = Reference(widths=(128, 256, 512), batch=4, seq_len=128, vocab=256)
# one run per width: with three widths a line is Theil and Sen's through three runs, and on 8 GPUs (dp, ZeRO 1-3,
# tp, pp) the calibration is 18 runs of a few seconds each rather than 36
GPU_REFERENCE = Reference(widths=(256, 512, 1024), batch=4, seq_len=1024, vocab=8192, head_dim=64,
                          dtypes=("fp32", "bf16"), calibration_dtype="bf16", calibration_repeats=1)


@dataclass(frozen=True)
class Sizing:
    """What a probe on one kind of device measures: square matmul sizes per dtype, the bytes of the copy that
    measures the memory bandwidth, and the reference GPT."""

    matmul_sizes: dict[str, tuple[int, ...]]
    copy_bytes: int
    reference: Reference


CPU_SIZING = Sizing({"fp32": (128, 256, 512, 1024), "bf16": (128, 256, 512, 1024)}, 64 * MIB, CPU_REFERENCE)
_GPU_16 = (256, 512, 1024, 2048, 4096, 8192)
GPU_SIZING = Sizing({"fp32": _GPU_16[:-1], "bf16": _GPU_16, "fp16": _GPU_16}, GIB, GPU_REFERENCE)


def sizing(device_type: str) -> Sizing:
    return GPU_SIZING if device_type == "cuda" else CPU_SIZING


def reference_for(device_type: str) -> Reference:
    return sizing(device_type).reference


MATMUL_SAMPLE_FLOPS = 2 ** 40  # ~1.4 ms of an H100's bf16 peak, ~20 ms of its fp32
MATMUL_MOST_CALLS = 256


def matmul_calls(device_type: str, n: int) -> int:
    """n x n x n matmuls per timed sample: one on a CPU (each call is milliseconds); on a GPU enough to add
    up to MATMUL_SAMPLE_FLOPS (at most MATMUL_MOST_CALLS), so that a sample is not the ~10 us a host waits
    for the device to report one small kernel done, and the queue keeps the GPU busy between launches as
    in training."""
    if device_type != "cuda":
        return 1
    return max(1, min(MATMUL_MOST_CALLS, MATMUL_SAMPLE_FLOPS // (2 * n ** 3)))
