"""Validation: metrics over the first `train.val_batches` global batches of the held-out set, each
split over the dp ranks as training batches are, reduced over all ranks."""

from __future__ import annotations

import torch

from shoal.comm.collectives import Comm
from shoal.config import TrainConfig
from shoal.parallel.parallelized import Parallelized, Totals, add_to
from shoal.parallel.precision import Precision


def evaluate(par: Parallelized, source, train: TrainConfig, precision: Precision, comm: Comm,
             device: torch.device) -> dict[str, float]:
    B, micro = train.global_batch_size, train.micro_batch_size
    totals: Totals = {}

    def val_batch(idx: torch.Tensor):
        return {k: v.to(device, non_blocking=True) for k, v in source.val_batch(idx).items()}

    with par.evaluating():
        for b in range(train.val_batches):
            if b * B >= source.num_val:
                break
            shares = torch.arange(b * B, min((b + 1) * B, source.num_val)).tensor_split(par.data_ranks)
            longest = max(len(s) for s in shares)
            add_to(totals, par.evaluate(shares[par.data_rank], longest, micro, val_batch, precision))
    keys = sorted(totals)
    # over every rank, each total counted once: tensor-parallel peers and earlier pipeline stages add 0
    flat = torch.stack([v for k in keys for v in totals[k]])
    flat = comm.all_reduce((flat if par.owns_loss else torch.zeros_like(flat)).to(device), label="world, validation")
    flat = flat.cpu()
    return {f"val_{k}": (flat[2 * i] / flat[2 * i + 1]).item() for i, k in enumerate(keys)}
