"""Everything decided about a run once the world size is known, checked before any worker starts.

Derived values (degrees, gradient accumulation, items per step) are computed here only; they are
printed at start and never stored as a second source of truth.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.config import Config
from shoal.dist import choose_backend
from shoal.errors import UserError
from shoal.topology import ParallelDims


@dataclass(frozen=True)
class RunPlan:
    dims: ParallelDims
    backend: str
    grad_accum: int  # micro-batches per rank per optimizer step
    per_rank_batch: int  # samples per rank per optimizer step
    pp_microbatches: int = 0  # pp > 1: micro-batches per step through the pipeline

    def describe(self, cfg: Config, items_name: str, items_per_sample: int) -> str:
        t, d = cfg.train, self.dims
        if d.pp > 1:
            split = (f"{self.per_rank_batch // self.pp_microbatches} x dp {d.dp} x {self.pp_microbatches} "
                     f"pipeline micro-batches")
        else:
            split = f"micro {t.micro_batch_size} x dp {d.dp} x accumulation {self.grad_accum}"
        zero = f", ZeRO {cfg.parallel.zero}" if cfg.parallel.zero else ""
        return (f"world {d.world_size} = dp {d.dp} x tp {d.tp} x pp {d.pp}{zero} ({self.backend}); global batch "
                f"{t.global_batch_size} = {split}; {t.global_batch_size * items_per_sample:,} {items_name} per step")


def make_plan(cfg: Config, world_size: int) -> RunPlan:
    p, t = cfg.parallel, cfg.train
    dims = ParallelDims.resolve(p.dp, p.tp, p.pp, world_size)
    backend = choose_backend(p.backend)
    step = t.micro_batch_size * dims.dp
    if t.global_batch_size % step:
        raise UserError(
            f"train.global_batch_size ({t.global_batch_size}) must be divisible by train.micro_batch_size "
            f"({t.micro_batch_size}) x dp ({dims.dp}) = {step}; set it to a multiple of {step} "
            f"(for example {max(step, t.global_batch_size // step * step)})"
        )
    if p.zero and dims.dp == 1:
        raise UserError(f"parallel.zero = {p.zero} shards state across the dp ranks, but dp = 1 (world {world_size} = "
                        f"tp {dims.tp} x pp {dims.pp}): there is nothing to shard across; set parallel.zero = 0 "
                        f"or start more processes")
    if p.zero == 1 and dims.tp > 1:
        raise UserError(f"parallel.zero = 1 with parallel.tp = {dims.tp} is not supported (ZeroRedundancyOptimizer "
                        f"cannot shard tensor-parallel parameters); use parallel.zero = 2 or 3, which compose with tp")
    if p.offload and p.zero < 2:
        raise UserError(f"parallel.offload = true needs parallel.zero = 2 or 3 (FSDP2), not {p.zero}")
    if p.offload and backend != "nccl":
        raise UserError("parallel.offload = true moves sharded state from GPU to CPU memory; this run trains on "
                        "CPU already (backend gloo): set parallel.offload = false")
    if cfg.precision.dtype == "fp16" and p.zero >= 2:
        raise UserError('precision.dtype = "fp16" with parallel.zero >= 2 is not supported (loss scaling of '
                        'sharded gradients); use "bf16"')
    if cfg.precision.dtype == "fp16" and not torch.cuda.is_available():
        raise UserError('precision.dtype = "fp16" needs CUDA (loss scaling); on CPU use "bf16" or "fp32"')
    if cfg.precision.dtype == "fp16" and backend != "nccl":
        raise UserError('precision.dtype = "fp16" trains on CUDA only; set parallel.backend = "nccl" or "auto"')
    per_rank = t.global_batch_size // dims.dp
    microbatches = 0
    if dims.pp > 1 and p.zero == 1:
        raise UserError(f"parallel.zero = 1 with parallel.pp = {dims.pp} is not supported (ZeroRedundancyOptimizer "
                        f"needs DDP, which cannot run under a pipeline schedule); use parallel.zero = 2 or 3")
    if dims.pp > 1:
        microbatches = p.pp_microbatches or per_rank // t.micro_batch_size
        if per_rank % microbatches:
            raise UserError(f"parallel.pp_microbatches ({microbatches}) must divide the per-rank batch ({per_rank} = "
                            f"train.global_batch_size / dp)")
        if p.pp_schedule == "interleaved-1f1b" and microbatches % dims.pp:
            raise UserError(f'parallel.pp_schedule = "interleaved-1f1b" needs the micro-batches ({microbatches}) to be '
                            f"a multiple of parallel.pp ({dims.pp}); set parallel.pp_microbatches")
    return RunPlan(dims, backend, t.global_batch_size // step, per_rank, microbatches)
