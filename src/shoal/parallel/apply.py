"""Turn a single-device model into the model each rank trains, in one fixed order:

    tensor parallel -> pipeline split -> activation checkpointing -> torch.compile -> ZeRO / data parallel

Sharding goes first because the later steps wrap what they see: checkpointing and compile must see
the sharded modules, and the data-parallel wrapper must see the final parameters it synchronizes.
ZeRO 2/3 (FSDP2) takes the place of DDP; ZeRO 1 is DDP plus a sharded optimizer (train/optim.py).
Pipeline parallelism is refused by config validation until it exists.
"""

from __future__ import annotations

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

from shoal.comm.watchdog import CollectiveLog
from shoal.config import Config
from shoal.errors import UserError
from shoal.models.registry import ModelBundle
from shoal.parallel.data import apply_data_parallel, apply_replicate
from shoal.parallel.zero import apply_fsdp
from shoal.topology import ParallelDims


def check_parallelizable(bundle: ModelBundle, cfg: Config) -> None:
    """Refuse, before any worker starts, what apply() could not do for this model."""
    tp = cfg.parallel.tp
    if tp > 1:
        if bundle.tp_plan is None:
            raise UserError(f'parallel.tp = {tp}, but model "{cfg.model.name}" has no tensor-parallel plan '
                            f"(ModelBundle.tp_plan); set parallel.tp = 1")
        bundle.tp_plan(bundle.model, tp, sequence_parallel=cfg.parallel.sequence_parallel)  # checks sizes only
    if cfg.precision.activation_checkpointing and not bundle.block_types:
        raise UserError(
            f'precision.activation_checkpointing = true, but model "{cfg.model.name}" names no blocks to '
            f"checkpoint (ModelBundle.block_types); set it to false"
        )


def parallelize(bundle: ModelBundle, dims: ParallelDims, cfg: Config, device: torch.device,
                log: CollectiveLog | None = None) -> torch.nn.Module:
    """Returns the module the training loop calls; `bundle.model` stays the unwrapped model."""
    model = bundle.model.to(device)
    if dims.tp > 1:
        bundle.loss_context = bundle.tp_plan(model, dims.tp, dims.mesh["tp"],
                                             sequence_parallel=cfg.parallel.sequence_parallel)
    if cfg.precision.activation_checkpointing:
        types = bundle.block_types
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, types))
    if cfg.train.compile:
        model = torch.compile(model)
    if cfg.parallel.zero >= 2:
        model = apply_fsdp(model, bundle, dims.mesh["dp"], cfg)
    elif dims.dp > 1 and dims.tp > 1:
        model = apply_replicate(model, bundle.block_types, dims.mesh["dp"])
    elif dims.dp > 1:
        group = dims.mesh["dp"].get_group() if dims.world_size > dims.dp else None
        model = apply_data_parallel(model, device, group, log)
    return model
