"""AdamW with decoupled weight decay on matrices only, and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch

from shoal.config import TrainConfig


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, shard_group=None) -> torch.optim.Optimizer:
    """AdamW; with `shard_group` (ZeRO 1), its state sharded over that group by ZeroRedundancyOptimizer."""
    params = [p for p in model.parameters() if p.requires_grad]
    # decay weight matrices and embeddings; not biases or norm gains (as in GPT-2 / nanoGPT)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    hyper = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2)}
    if shard_group is not None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer([g for g in groups if g["params"]], torch.optim.AdamW,
                                       process_group=shard_group, **hyper)
    return torch.optim.AdamW(groups, **hyper)


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of cfg.lr at `step` (0-based): linear warmup, then cosine down to min_lr_ratio."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(cfg.steps - cfg.warmup_steps - 1, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))
