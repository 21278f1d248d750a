"""Turn a single-device model into the model each rank trains, in one fixed order:

    tensor parallel -> pipeline split -> activation checkpointing -> torch.compile -> ZeRO / data parallel

Sharding goes first because the later steps wrap what they see: checkpointing and compile must see
the sharded modules, and the data-parallel wrapper must see the final parameters it synchronizes.
ZeRO 2/3 (FSDP2) takes the place of DDP; ZeRO 1 is DDP plus a sharded optimizer (train/optim.py).
With pipeline parallelism the split comes before the wrappers, so each stage gets its own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

from shoal.comm.watchdog import CollectiveLog
from shoal.config import Config
from shoal.errors import UserError
from shoal.models.registry import ModelBundle
from shoal.parallel.data import apply_data_parallel, apply_replicate
from shoal.parallel.pipeline import Pipeline, StageUnion, measure_layer_times, plan_layout
from shoal.parallel.zero import apply_fsdp
from shoal.plan import RunPlan
from shoal.topology import ParallelDims


def check_parallelizable(bundle: ModelBundle, cfg: Config) -> None:
    """Refuse, before any worker starts, what apply() could not do for this model."""
    tp = cfg.parallel.tp
    if tp > 1:
        if bundle.tp_plan is None:
            raise UserError(f'parallel.tp = {tp}, but model "{cfg.model.name}" has no tensor-parallel plan '
                            f"(ModelBundle.tp_plan); set parallel.tp = 1")
        bundle.tp_plan(bundle.model, tp, sequence_parallel=cfg.parallel.sequence_parallel)  # checks sizes only
    pp = cfg.parallel.pp
    if pp > 1:
        if bundle.pp_plan is None:
            raise UserError(f'parallel.pp = {pp}, but model "{cfg.model.name}" has no pipeline plan '
                            f"(ModelBundle.pp_plan); set parallel.pp = 1")
        if cfg.checkpoint.final_weights and not cfg.checkpoint.enabled:
            raise UserError("with parallel.pp > 1 the final weights are exported from the final checkpoint: set "
                            "checkpoint.enabled = true, or checkpoint.final_weights = false")
        names, costs, _, _ = bundle.pp_plan(bundle.model)
        p = cfg.parallel
        plan_layout(names, costs, pp, p.pp_schedule, p.pp_stages_per_rank, p.pp_split)  # checks the split
    if cfg.precision.activation_checkpointing and not bundle.block_types:
        raise UserError(
            f'precision.activation_checkpointing = true, but model "{cfg.model.name}" names no blocks to '
            f"checkpoint (ModelBundle.block_types); set it to false"
        )


def parallelize(bundle: ModelBundle, dims: ParallelDims, cfg: Config, device: torch.device, rank: int,
                plan: RunPlan, log: CollectiveLog | None = None,
                sample: dict | None = None) -> tuple[torch.nn.Module, Pipeline | None]:
    """Returns the module the training loop calls, and this rank's Pipeline when pp > 1. `bundle.model`
    stays the unwrapped model (with pp: this rank's stages, under the whole model's names). `sample`:
    one pipeline micro-batch, to time the layers with (parallel.pp_balance = "time")."""
    model = bundle.model.to(device)
    if dims.tp > 1:
        bundle.loss_context = bundle.tp_plan(model, dims.tp, dims.mesh["tp"],
                                             sequence_parallel=cfg.parallel.sequence_parallel)
    if dims.pp == 1:
        return wrap(model, bundle, dims, cfg, device, log), None
    p = cfg.parallel
    names, costs, build_stage, output_loss = bundle.pp_plan(model)
    basis = "forward FLOPs"
    if p.pp_balance == "time" and not p.pp_split:
        costs, basis = layer_times(names, build_stage, output_loss, sample, bundle, device), "time"
    layout = plan_layout(names, costs, dims.pp, p.pp_schedule, p.pp_stages_per_rank, p.pp_split, basis)
    pp_rank = dims.coords(rank)["pp"]
    stage_ids = [pp_rank + k * dims.pp for k in range(layout.stages_per_rank)]
    # weights with several names (tied) are kept under their first name on every stage that holds them
    # (found before the wrappers below replace parameters)
    tied = [names[0] for names in _names_by_param(model).values() if len(names) > 1]
    stages = [build_stage(*layout.bounds(i)) for i in stage_ids]
    bundle.model = StageUnion(stages)
    modules = [wrap(stage, bundle, dims, cfg, device, log) for stage in stages]
    # the parameters as the wrappers left them (ZeRO 2/3 replaces them with sharded ones)
    tied_here = [param for name, param in bundle.model.named_parameters() if name in tied]
    pipeline = Pipeline(modules, stage_ids, layout, device, dims.mesh["pp"].get_group(), p.pp_schedule,
                        plan.pp_microbatches, output_loss, tied_here, tie_group=tied_stage_group(tied, dims, rank))
    return bundle.model, pipeline


def layer_times(names, build_stage, output_loss, sample: dict, bundle: ModelBundle, device: torch.device):
    """Collective: each layer's measured forward + backward seconds, averaged over every rank so that all
    ranks split the model the same way (tp peers measure their shards together)."""
    seconds = measure_layer_times(build_stage, len(names), sample, output_loss, device, bundle.loss_context)
    total = torch.tensor(seconds, dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return (total / dist.get_world_size()).tolist()


def wrap(model: torch.nn.Module, bundle: ModelBundle, dims: ParallelDims, cfg: Config, device: torch.device,
         log: CollectiveLog | None) -> torch.nn.Module:
    """Activation checkpointing, compile, then ZeRO / data parallelism around one model (or stage)."""
    if cfg.precision.activation_checkpointing:
        types = bundle.block_types
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, types))
    if cfg.train.compile:
        model = torch.compile(model)
    if cfg.parallel.zero >= 2:
        model = apply_fsdp(model, bundle, dims.mesh["dp"], cfg)
    elif dims.dp > 1 and (dims.tp > 1 or dims.pp > 1):
        # DDP holds no DTensors, and it decides at forward time whether a backward all-reduces, which a
        # pipeline schedule's interleaved forwards and backwards break
        model = apply_replicate(model, bundle.block_types, dims.mesh["dp"])
    elif dims.dp > 1:
        group = dims.mesh["dp"].get_group() if dims.world_size > dims.dp else None
        model = apply_data_parallel(model, device, group, log)
    return model


def tied_stage_group(tied: list[str], dims: ParallelDims, rank: int):
    """Collective (every rank creates every group): for a model whose weights are tied across its ends
    (a GPT's embedding and output head), the group of the first and the last pipeline stage of this
    rank's (dp, tp) position, which add up that weight's gradients; None when nothing is tied."""
    if not tied:
        return None
    mine = None
    for dp in range(dims.dp):
        for tp in range(dims.tp):
            ranks = [dims.rank_of(pp=0, dp=dp, tp=tp), dims.rank_of(pp=dims.pp - 1, dp=dp, tp=tp)]
            group = dist.new_group(ranks)
            if rank in ranks:
                mine = group
    return mine


def _names_by_param(model: torch.nn.Module) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(name)
    return out
