"""ZeRO within the dp axis (Rajbhandari et al. 2020), on torch's own implementations.

  zero 1: optimizer state sharded. DDP all-reduces full gradients; ZeroRedundancyOptimizer gives each
          dp rank the AdamW state of a subset of whole parameters, steps it, and broadcasts the result.
  zero 2: also gradients. FSDP2 `fully_shard` per block with reshard_after_forward=False: a block's
          parameters are all-gathered once for forward and kept for its backward, gradients are
          reduce-scattered, and between steps each rank holds 1/dp of parameters, gradients and state.
  zero 3: also parameters during the step. Same, but every block but the last frees its gathered
          parameters after forward and gathers them again in backward (the last one's backward comes
          at once). The root module (embeddings, final norm, head) is one more group.

Units of sharding are the model's blocks (ModelBundle.block_types), as torchtitan and FSDP users do:
one all-gather per block, overlapped with the previous block's compute.
"""

from __future__ import annotations

import sys

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from shoal.config import Config
from shoal.models.registry import ModelBundle
from shoal.train.precision import DTYPES


def apply_fsdp(model: torch.nn.Module, bundle: ModelBundle, dp_mesh, cfg: Config) -> FSDPModule:
    zero = cfg.parallel.zero
    kwargs = {"mesh": dp_mesh, "mp_policy": mixed_precision(cfg)}
    if cfg.parallel.offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    blocks = [m for m in model.modules() if bundle.block_types and isinstance(m, bundle.block_types)]
    for i, block in enumerate(blocks):
        fully_shard(block, reshard_after_forward=zero == 3 and i < len(blocks) - 1, **kwargs)
    return fully_shard(model, reshard_after_forward=zero == 3, **kwargs)


def mixed_precision(cfg: Config) -> MixedPrecisionPolicy:
    """bf16: gather parameters in bf16 for compute, reduce gradients in precision.reduce_dtype; the
    sharded master parameters and the optimizer state stay fp32."""
    if cfg.precision.dtype == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=DTYPES[cfg.precision.dtype],
                                reduce_dtype=DTYPES[cfg.precision.reduce_dtype])


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose state this rank holds: under ZeRO 1, the shard's inner optimizer."""
    # torch.distributed.optim is imported only when ZeRO 1 is used (it loads TorchScript, with warnings)
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    return optimizer.optim if zero and isinstance(optimizer, zero.ZeroRedundancyOptimizer) else optimizer
