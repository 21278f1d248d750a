"""What this machine's arithmetic and memory reach: matmul FLOP/s per dtype over square sizes (the curve)
and a large copy's bandwidth, each the median of timed runs."""

from __future__ import annotations

import statistics
import time

import torch

from shoal.plan.reference import matmul_calls

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _timed(fn, repeats: int, sync) -> float:
    """Median seconds of `fn()` over `repeats` runs after one warm-up."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_curve(dtype: torch.dtype, device: torch.device, sizes, repeats: int, sync) -> list[tuple[float, float]]:
    """[[n, FLOP/s of an n x n x n matmul], ...]: each timed sample matmul_calls(n) products in a row."""
    out = []
    for n in sizes:
        a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
        calls = matmul_calls(device.type, n)

        def products(a=a, b=b, calls=calls):
            for _ in range(calls):
                a @ b
        out.append((float(n), 2 * n ** 3 * calls / _timed(products, repeats, sync)))
    return out


def memory_bandwidth(device: torch.device, nbytes: int, repeats: int, sync) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * nbytes / _timed(lambda: dst.copy_(src), repeats, sync)  # read + write
