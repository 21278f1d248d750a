"""AdamW (or SGD) with decoupled weight decay on matrices only, and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch

from shoal.compat import fused_optimizer_devices
from shoal.config import TrainConfig


def optimizer_groups(parameters, cfg: TrainConfig) -> tuple[type[torch.optim.Optimizer], list[dict], dict]:
    """The optimizer (train.optimizer: AdamW, or SGD with momentum), its parameter groups and
    hyperparameters: decay weight matrices and embeddings, not biases or norm gains (as in GPT-2 /
    nanoGPT)."""
    params = [p for p in parameters if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    implementation = {"fused": True} if fusable(params, sgd=cfg.optimizer == "sgd") else {}  # else foreach
    if cfg.optimizer == "sgd":
        return torch.optim.SGD, groups, {"lr": cfg.lr, "momentum": cfg.momentum, **implementation}
    return torch.optim.AdamW, groups, {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), **implementation}


def fusable(params: list[torch.Tensor], sgd: bool = False) -> bool:
    """Whether torch's fused optimizer kernels take these parameters: floating point, on a device they
    support (CUDA and CPU among them; a DTensor counts by its local device), and for SGD no DTensor (torch
    has no sharding rule for its fused kernel: ZeRO 2/3 and tensor parallelism step SGD with foreach, and
    read the bad-step verdict on the host). The fused step is one kernel per parameter group instead of a
    handful of foreach kernels, and off the CPU it skips a bad step by a device flag (parallel/precision.py),
    where the foreach step needs the host to decide."""
    from torch.distributed.tensor import DTensor
    devices = fused_optimizer_devices()
    if sgd and any(isinstance(p, DTensor) for p in params):
        return False  # DTensor has no sharding rule for the fused SGD kernel (it has one for Adam's)
    return bool(params) and all(p.is_floating_point() and p.device.type in devices for p in params)


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of cfg.lr at `step` (0-based): linear warmup, then cosine down to min_lr_ratio."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(cfg.steps - cfg.warmup_steps - 1, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class Schedule:
    """The learning-rate schedule, a checkpointed part of the run: step `step` (0-based) trains at
    base x lr_factor(step). What torch's LambdaLR computes, without its machinery on every step (its step()
    wraps the optimizer's and calls the factor once per group: ~20 us of a small model's step here); its
    saved state keeps LambdaLR's names, so checkpoints written with it load as they are."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: TrainConfig):
        self.optimizer, self.cfg = optimizer, cfg
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        self.set_step(0)

    def step(self) -> None:
        """One optimizer step done: the next step's rate."""
        self.set_step(self.last_epoch + 1)

    def set_step(self, step: int) -> None:
        """The learning rate of step `step` (0-based); also for a run whose schedule follows something other than
        its own count of optimizer steps (an asynchronous parameter server's worker: the data it is dealt)."""
        self.last_epoch = step
        factor = lr_factor(step, self.cfg)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = base * factor

    def state_dict(self) -> dict:
        return {"base_lrs": list(self.base_lrs), "last_epoch": self.last_epoch,
                "_last_lr": [group["lr"] for group in self.optimizer.param_groups]}

    def load_state_dict(self, state: dict) -> None:
        # the rate is set here (a sharded optimizer's outer groups are not in its saved state)
        self.base_lrs = list(state["base_lrs"])
        self.set_step(state["last_epoch"])
