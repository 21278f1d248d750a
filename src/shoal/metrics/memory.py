"""Memory of this process: what the model state holds (parameters, gradients, optimizer state, counting
only this rank's shards), and the peak (CUDA max allocated on GPU, peak resident set size on CPU)."""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable

import torch

from shoal.topology import local_part

STATE_KINDS = ("params", "grads", "optimizer")


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    if sys.platform == "darwin":
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB. The process's peak comes with any thread's usage: asked for the whole process, the
    # kernel also sums every thread's times (12 us in a worker here, against 1.4 us for this thread's, back to back)
    return resource.getrusage(resource.RUSAGE_THREAD).ru_maxrss * 1024


def device_memory_bytes(device: torch.device) -> dict[str, int]:
    """A GPU's memory beyond the tensors' peak: `reserved`, the caching allocator's peak of reserved bytes
    (its blocks, rounded up and kept cached), and `outside`, what this process holds outside the allocator
    now (the CUDA context with the kernels it loaded, NCCL's buffers): the device's used bytes less the
    allocator's reserved ones (one process a GPU: another process's memory would count as ours). Empty off
    a GPU."""
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    return {"reserved": torch.cuda.max_memory_reserved(device),
            "outside": max(total - free - torch.cuda.memory_reserved(device), 0)}


def memory_mark(device: torch.device) -> int:
    """What this process holds now, to measure a phase's growth from (memory_since): the device's allocated
    bytes on a GPU (its peak counter restarted here), the resident set on the CPU."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    try:  # Linux: "5" restarts the resident set's high-water mark (VmHWM) from what is resident now
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        pass  # an earlier peak then counts too: the growth is overstated, never understated
    return status_bytes("VmRSS")


def memory_since(device: torch.device, mark: int) -> int:
    """The most this process held since `mark` was taken, above it: a GPU's peak allocation; on the CPU the
    resident set's high-water mark."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) - mark
    return max(status_bytes("VmHWM") - mark, 0)


def status_bytes(field: str) -> int:
    """A byte count of /proc/self/status (VmRSS, VmHWM) of this process. (Not getrusage's maxrss: Linux carries
    that over from the parent across exec, so a new process started by a large one reports the parent's peak.)"""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {field}")


def _local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes held here: a DTensor counts its local shard; tensors sharing memory (tied weights,
    gradients that are views of DDP buckets) count once per storage."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = local_part(t)
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state held by this rank (call before zero_grad).
    `optimizer` is the one whose state this rank holds (ZeRO 1: the shard's inner optimizer)."""
    params = list(model.parameters())
    state = [v for per_param in optimizer.state.values() for v in per_param.values() if isinstance(v, torch.Tensor)]
    return {"params": _local_bytes(params), "grads": _local_bytes(p.grad for p in params),
            "optimizer": _local_bytes(state)}


class StateBytes:
    """model_state_bytes of a step's model and optimizer, walked again only when what it walks changes in
    number: the optimizer's state appears at the first step, gradients come and go, and otherwise the same
    tensors hold the same bytes. The walk costs ~4 us a tensor (0.4 ms of host time on each logged step of
    the tiny GPT of benchmarks/host_step.py, about 100 tensors; a GPT-2 has some 750)."""

    def __init__(self):
        self._key: tuple | None = None
        self._bytes: dict[str, int] = {}

    def __call__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        params = list(model.parameters())
        key = (id(model), id(optimizer), len(params), sum(p.grad is not None for p in params),
               sum(len(s) for s in optimizer.state.values()))
        if key != self._key:
            self._key, self._bytes = key, model_state_bytes(model, optimizer)
        return self._bytes
