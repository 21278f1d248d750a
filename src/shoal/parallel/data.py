"""Data parallelism through torch DDP: gradients are averaged over the dp group in buckets that
overlap with backward; during gradient accumulation only the last micro-batch synchronizes."""

from __future__ import annotations

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel as DDP


def apply_data_parallel(model: torch.nn.Module, device: torch.device, group=None) -> DDP:
    return DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=group,
        # gradients live in the communication buckets: one copy of the gradients instead of two
        gradient_as_bucket_view=True,
    )


def grad_sync(model: torch.nn.Module, sync: bool):
    """Context for one micro-batch's forward+backward: all-reduce gradients only when `sync`."""
    if isinstance(model, DDP) and not sync:
        return model.no_sync()
    return contextlib.nullcontext()
