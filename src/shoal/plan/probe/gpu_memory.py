"""A GPU's memory beyond its tensors: the caching allocator's reserved peak over its allocated peak, and
what the process holds outside the allocator (the CUDA context, NCCL's buffers)."""

from __future__ import annotations

import torch

from shoal.metrics.memory import device_memory_bytes


def restart_peaks(device: torch.device) -> None:
    """A GPU: the caching allocator's cached blocks freed and its peak counters restarted, so that what
    follows is measured alone."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)


def reserve_ratio(device: torch.device) -> float | None:
    """A GPU: the caching allocator's reserved peak over its allocated peak since restart_peaks (blocks
    rounded up, freed blocks kept cached, fragmentation); None where nothing was allocated."""
    allocated = torch.cuda.max_memory_allocated(device)
    return torch.cuda.max_memory_reserved(device) / allocated if allocated else None


def outside_bytes(device: torch.device) -> int:
    """A GPU: what this process holds now outside the caching allocator (metrics/memory.py)."""
    return device_memory_bytes(device)["outside"]
