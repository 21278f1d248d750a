"""Data parallelism: every dp rank holds the whole model and trains on its slice of the global
batch; gradients are averaged over the dp group in buckets that overlap with backward (torch DDP,
or FSDP2's `replicate` for a model whose parameters are DTensors). When the averaging happens is
the step synchronisation's business (sync.py); `grad_sync` turns it on or off per micro-batch for
whichever wrapper holds the model."""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel as DDP


def replicate_ddp(model: torch.nn.Module, device: torch.device, group=None, init_sync: bool = True) -> DDP:
    """`init_sync`: broadcast rank 0's weights and buffers at the start (False: every rank loads the same
    state afterwards, from a checkpoint or a live peer)."""
    return DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=group,
        # gradients live in the communication buckets: one copy of the gradients instead of two
        gradient_as_bucket_view=True,
        init_sync=init_sync,
    )


def replicate_dtensor(model: torch.nn.Module, block_types: tuple[type, ...], dp_mesh) -> torch.nn.Module:
    """Data parallelism for a model whose parameters are DTensors (tensor-parallel), which DDP cannot
    hold, or that runs under a pipeline schedule: torch's FSDP2-based `replicate`, per block (one
    gradient all-reduce per block, overlapped with backward) and for the rest of the model, leaving alone
    what DDP would be told to (left_alone)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    ignored = left_alone(model)
    for block in [m for m in model.modules() if block_types and isinstance(m, block_types)]:
        replicate(block, mesh=dp_mesh, ignored_params=ignored)
    return replicate(model, mesh=dp_mesh, ignored_params=ignored)


def left_alone(model: torch.nn.Module) -> set[torch.nn.Parameter]:
    """The parameters DDP is told to leave alone (DDP._set_params_and_buffers_to_ignore_for_model: expert
    parallelism's experts, DTensors of a mesh of their own whose gradients it reduces itself)."""
    base = getattr(model, "_orig_mod", model)  # torch.compile's wrapper prefixes every name
    names = set(getattr(base, "_ddp_params_and_buffers_to_ignore", ()))
    return {p for n, p in base.named_parameters() if n in names}


def holds_sync(module: torch.nn.Module) -> bool:
    """Whether grad_sync can hold `module`'s gradient reduction back (DDP, FSDP2): else it does nothing."""
    return isinstance(module, (DDP, FSDPModule))


@contextlib.contextmanager
def grad_sync(module: torch.nn.Module, enabled: bool):
    """Context for one micro-batch's forward+backward: reduce gradients over dp in its backward only
    when `enabled`; otherwise they accumulate locally."""
    if isinstance(module, DDP) and not enabled:
        with module.no_sync():
            yield
    elif isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(enabled)
        yield
    else:
        yield


def set_grad_sync(module: torch.nn.Module, enabled: bool) -> None:
    """From now on (set before a micro-batch's forward, where DDP reads it), whether backward reduces
    gradients over dp: for a loop shoal does not run, where no context can span forward and backward."""
    if isinstance(module, DDP):
        module.require_backward_grad_sync = enabled
    elif isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(enabled)
