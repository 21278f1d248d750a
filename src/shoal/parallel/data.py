"""Data parallelism through torch DDP: gradients are averaged over the dp group in buckets that
overlap with backward; during gradient accumulation only the last micro-batch synchronizes (for DDP
and for FSDP2, see zero.py)."""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel as DDP

from shoal.comm.watchdog import CollectiveLog


def apply_data_parallel(model: torch.nn.Module, device: torch.device, group=None,
                        log: CollectiveLog | None = None) -> DDP:
    ddp = DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=group,
        # gradients live in the communication buckets: one copy of the gradients instead of two
        gradient_as_bucket_view=True,
    )
    if log is not None:
        ddp.register_comm_hook((log, group), logged_allreduce_hook)
    return ddp


def apply_replicate(model: torch.nn.Module, block_types: tuple[type, ...], dp_mesh) -> torch.nn.Module:
    """Data parallelism for a model whose parameters are DTensors (tensor-parallel), which DDP cannot
    hold: torch's FSDP2-based `replicate`, per block (one gradient all-reduce per block, overlapped
    with backward) and for the rest of the model."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    for block in [m for m in model.modules() if block_types and isinstance(m, block_types)]:
        replicate(block, mesh=dp_mesh)
    return replicate(model, mesh=dp_mesh)


def logged_allreduce_hook(state, bucket):  # no annotations: DDP checks them, and they would be strings here
    """DDP's default gradient all-reduce (average over dp), recorded in the collective log."""
    log, group = state
    rec = log.enter("all_reduce", f"dp, gradient bucket {bucket.index()}", [bucket.buffer()])

    def finished(fut: torch.futures.Future) -> torch.Tensor:
        value = fut.value()  # raises if the all-reduce failed: the record then stays open
        CollectiveLog.done(rec)
        return value

    return allreduce_hook(group, bucket).then(finished)


@contextlib.contextmanager
def grad_sync(model: torch.nn.Module, sync: bool):
    """Context for one micro-batch's forward+backward: reduce gradients over dp only when `sync`
    (the last micro-batch of a step); the others accumulate locally."""
    if isinstance(model, DDP) and not sync:
        with model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)
        yield
    else:
        yield
