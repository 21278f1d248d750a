"""Turn a single-device model into the model each rank trains, in one fixed order:

    float8 layers -> tensor parallel -> pipeline split -> activation checkpointing -> torch.compile
        -> ZeRO / data parallel -> the loss function compiled over the wrapped module

A model built on the meta device (bundle.deferred) goes through the same steps as shapes only, and is made
real once sharded: after ZeRO 2/3 or a DTensor replica wrapped it, each rank allocates and fills only its
share (materialize.py); DDP, which broadcasts and buckets real tensors, gets it filled just before.

Sharding goes first because the later steps wrap what they see: checkpointing and compile must see
the sharded modules, and the data-parallel wrapper must see the final parameters it synchronizes. The
loss function is compiled last (compiled_loss), so that the loss is in the compiled region too; under a
pipeline each stage is compiled and the schedule takes the loss.
ZeRO 2/3 (FSDP2) takes the place of DDP; ZeRO 1 is DDP plus a sharded optimizer (zero.py). With
pipeline parallelism the split comes before the wrappers, so each stage gets its own.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
from torch.distributed.fsdp import FSDPModule

from shoal.comm.codecs import make_codec
from shoal.comm.collectives import Comm
from shoal.config import CommConfig, ParallelConfig, PrecisionConfig, SyncConfig
from shoal.config.training import CUDA_GRAPH_MODES, compile_mode
from shoal.layout import Layout
from shoal.models.spec import LossFn, ModelBundle, PipelineLayers
from shoal.parallel.context import ContextParallel
from shoal.parallel.data import replicate_ddp, replicate_dtensor
from shoal.parallel.experts import expert_parallel
from shoal.parallel.float8 import WeightScales, float8_training
from shoal.parallel.local_sgd import PeriodicSync
from shoal.parallel.materialize import Materializer
from shoal.parallel.parallelized import Parallelized
from shoal.parallel.pipeline import Pipeline, StageSplit, StageUnion, measure_layer_times, split_stages
from shoal.parallel.pipelined import PipelinedModel
from shoal.parallel.precision import sharded_mixed_precision
from shoal.parallel.sync import EveryStep, StepSync
from shoal.parallel.zero import shard_parameters
from shoal.topology import ParallelDims


def make_sync(sync: SyncConfig, comm_cfg: CommConfig, comm: Comm, last_step: int = 0) -> StepSync:
    """The step synchronisation sync.mode names, with comm.compression's codec; `last_step`: the run's
    last step (periodic syncs also sync there)."""
    codec = make_codec(comm_cfg.compression, comm, comm_cfg.topk_ratio, comm_cfg.powersgd_rank,
                       comm_cfg.error_feedback)
    if sync.mode == "every-step":
        return EveryStep(codec)
    inner = EveryStep(make_codec("none", comm))  # within a replica of several ranks: every step, uncompressed
    outer = (sync.outer_lr, sync.outer_momentum) if sync.mode == "diloco" else (1.0, 0.0)
    return PeriodicSync(sync.mode, sync.every, codec, *outer, last_step=last_step, inner=inner,
                        fragments=sync.fragments, delay=sync.fragment_delay, alpha=sync.fragment_alpha,
                        warmup=sync.warmup_steps)


def replica_meshes(layout: Layout, mesh, dp_group, device_type: str):
    """(the mesh a data-parallel wrapper spans or None for no wrapper, the group periodic syncs run over
    or None for the default group): every step, the dp axis of `mesh`; local SGD / DiLoCo with each dp rank a
    replica, no wrapper and the dp group; with replicas of several ranks (data parallelism only), a
    (replica, shard) mesh over the world: the wrapper spans a replica's ranks, syncs run across."""
    dims = layout.dims
    if layout.replicas == 1:
        return dims.shard_mesh(mesh) if layout.zero >= 2 else mesh["dp"], dp_group
    if layout.replicas == dims.dp:
        return None, dp_group
    from torch.distributed.device_mesh import init_device_mesh

    grid = init_device_mesh(device_type, (layout.replicas, dims.dp // layout.replicas),
                            mesh_dim_names=("replica", "shard"))
    return grid["shard"], grid["replica"].get_group()


def wrapper_group(mesh, world_size: int, dp_group):
    """The group a data-parallel wrapper's own collectives run over: None for the default group (no wrapper, or
    one over every rank), HSDP's 2-D mesh's whole dp group, else its mesh's group."""
    if mesh is None or mesh.size() == world_size:
        return None
    return mesh.get_group() if mesh.ndim == 1 else dp_group


def parallelize(bundle: ModelBundle, layout: Layout, *, parallel: ParallelConfig, precision: PrecisionConfig,
                compile: bool | str, device: torch.device, rank: int, comm: Comm, sync: StepSync | None = None,
                sample: dict | None = None) -> Parallelized:
    """This rank's share of `bundle.model`, wrapped for `layout` (`compile`: train.compile). `sample`: one pipeline
    micro-batch, to time the layers with (parallel.pp_balance = "time"). `sync`: by default every step, uncompressed."""
    dims = layout.dims
    sync = sync or make_sync(SyncConfig(), CommConfig(), comm)
    real = Materializer(bundle.deferred, device)  # a model built whole: nothing to fill
    model = bundle.model if bundle.deferred is not None else bundle.model.to(device)
    model = float8_training(model, precision, device, dims.tp, layout.zero)  # before any wrapper (float8.py)
    mesh = dims.device_mesh(device.type)  # collective; the model's wrappers keep what they use of it
    loss_context = (bundle.tensor_parallel(model, dims.tp, mesh["tp"], sequence_parallel=parallel.sequence_parallel)
                    or contextlib.nullcontext) if dims.tp > 1 else contextlib.nullcontext
    coords = dims.coords(rank)
    dp_group = mesh["dp"].get_group() if dims.world_size > dims.dp else None
    inner_mesh, outer_group = replica_meshes(layout, mesh, dp_group, device.type)
    inner_group = wrapper_group(inner_mesh, dims.world_size, dp_group)
    experts, expert_units = expert_parallel(model, parallel.ep, mesh, comm, layout.zero)  # before the wrappers

    def wrapped(m: torch.nn.Module) -> torch.nn.Module:
        return wrap(m, bundle.block_types, dims, dp_mesh=inner_mesh, dp_group=inner_group, zero=layout.zero,
                    parallel=parallel, precision=precision, compile=compile, device=device, sync=sync, comm=comm,
                    filled_later=bundle.uninitialised, fill=real.fill,
                    units=[u for u in expert_units if any(u[0] is sub for sub in m.modules())])  # a stage's own

    common = {"comm": comm, "sync": sync, "device": device, "dp_rank": coords["dp"], "dp": dims.dp,
              "dp_group": dp_group, "zero_group": inner_group, "loss_context": loss_context, "zero": layout.zero,
              "context": context_parallel(mesh, layout.cp, comm), **experts}
    if dims.pp == 1:
        module = wrapped(model)
        real.fill(model)
        sync.attach(model, outer_group, layout.replicas)
        # tensor-parallel peers compute the same loss: only the first one's counts
        return Parallelized(model, module, with_compiled_loss(bundle, compile), owns_loss=coords["tp"] == 0,
                            sharded=isinstance(module, FSDPModule), scales=WeightScales.of(model, comm), **common)

    layers = bundle.pipeline(model)
    split, stage_ids = stage_split(layers, parallel, dims, coords["pp"], sample, loss_context, device, comm)
    # weights with several names (tied) are kept under their first name on every stage that holds them
    # (found before the wrappers below replace parameters)
    tied = [names[0] for names in _names_by_param(model).values() if len(names) > 1]
    stages = [layers.build_stage(*split.bounds(i)) for i in stage_ids]
    for stage in stages:  # what the data-parallel wrapper leaves alone (parallel.ep's experts), named as in the model
        stage._ddp_params_and_buffers_to_ignore = getattr(model, "_ddp_params_and_buffers_to_ignore", ())
    union = StageUnion(stages)  # this rank's stages under the whole model's names
    modules = [wrapped(stage) for stage in stages]
    real.fill(union)
    # the parameters as the wrappers left them (ZeRO 2/3 replaces them with sharded ones)
    tied_here = [param for name, param in union.named_parameters() if name in tied]
    sync.attach(union, outer_group, layout.replicas)
    stage_group = mesh["pp"].get_group()
    pipeline = Pipeline(modules, stage_ids, split, device, stage_group, parallel.pp_schedule,
                        layout.pp_microbatches, layers.output_loss, layers.carried)
    return PipelinedModel(union, union, bundle, pipeline=pipeline, stage_group=stage_group, tied=tied_here,
                          tie_group=tied_stage_group(tied, dims, rank, comm), per_rank_batch=layout.per_rank_batch,
                          count_fn=bundle.count_fn, pp=dims.pp, schedule=parallel.pp_schedule,
                          owns_loss=coords["tp"] == 0 and pipeline.last, scales=WeightScales.of(union, comm),
                          sharded=any(isinstance(m, FSDPModule) for m in modules), **common)


def context_parallel(mesh, cp: int, comm: Comm) -> ContextParallel | None:
    """Collective: parallel.cp's groups, the run's mesh's dp axis split into (dp / cp) x cp (consecutive dp ranks
    share sequences; under tp each tp rank has its own), and this rank's; None where cp is 1."""
    if cp == 1:
        return None
    from shoal.compat import split_mesh_axis

    groups = split_mesh_axis(mesh, "dp", (mesh["dp"].size() // cp, cp), ("sequences", "cp"))
    return ContextParallel(comm, groups["cp"].get_group(), cp, groups["cp"].get_local_rank())


def stage_split(layers: PipelineLayers, parallel: ParallelConfig, dims: ParallelDims, pp_rank: int,
                sample: dict | None, loss_context, device: torch.device, comm: Comm) -> tuple[StageSplit, list[int]]:
    """Collective when the layers are timed (parallel.pp_balance = "time"): the split into stages, by the layers'
    declared costs or their measured times, and this rank's stages."""
    costs, basis = layers.costs, "forward FLOPs"
    if parallel.pp_balance == "time" and not parallel.pp_split:
        costs, basis = layer_times(layers, sample, loss_context, device, comm), "time"
    split = split_stages(layers.names, costs, dims.pp, parallel.pp_schedule, parallel.pp_stages_per_rank,
                         parallel.pp_split, basis)
    return split, [pp_rank + k * dims.pp for k in range(split.stages_per_rank)]


def with_compiled_loss(bundle: ModelBundle, compile: bool | str) -> ModelBundle:
    """`bundle` with its loss function compiled as train.compile says (unchanged when it is false, or when
    the model takes its loss in its compiled forward). Compiling a loss function over a DDP-wrapped model
    traces into DDP's forward, which dynamo may not enter (DDP marks its `_inside_ddp_forward` so): three
    graph breaks a micro-batch on every rank; with the loss in the model's forward, DDP's forward runs as
    Python and the model's one compiled frame holds the loss, with DDP's bucketing of the graph."""
    if not compile or bundle.loss_in_forward:
        return bundle
    return dataclasses.replace(bundle, loss_fn=compiled_loss(bundle.loss_fn, compile_mode(compile)))


def compiled_loss(loss_fn: LossFn, mode: str) -> LossFn:
    """`loss_fn(module, batch)` compiled with torch.compile's `mode`, over whichever module it is given, as
    torchtitan compiles its loss beside the model: the loss and its fp32 upcast run in the compiled region.
    Dynamo inlines a compiled model into it (the model and the loss one graph) and breaks the graph at
    DDP's and FSDP2's forward hooks: the model's own compiled forward runs between them, the loss in the
    graph after. The model stays compiled on its own for evaluation and pipeline stages."""
    compiled = torch.compile(loss_fn, mode=mode)
    if mode not in CUDA_GRAPH_MODES:
        return compiled

    def captured(module: torch.nn.Module, batch: dict) -> torch.Tensor:
        # each micro-batch's forward and backward run before the next one's forward: a step for the CUDA
        # graphs, whose next replay overwrites their outputs (the loss is copied out of them)
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(module, batch).clone()

    return captured


def layer_times(layers, sample: dict, loss_context, device: torch.device, comm: Comm) -> list[float]:
    """Collective: each layer's measured forward + backward seconds, averaged over every rank so that all
    ranks split the model the same way (tp peers measure their shards together)."""
    seconds = measure_layer_times(layers.build_stage, len(layers.names), sample, layers.output_loss, device,
                                  loss_context)
    total = comm.all_reduce(torch.tensor(seconds, dtype=torch.float64, device=device), label="world, layer times")
    return (total / comm.world_size).tolist()


def wrap(model: torch.nn.Module, block_types: tuple[type, ...], dims: ParallelDims, *, dp_mesh, dp_group, zero: int,
         parallel: ParallelConfig, precision: PrecisionConfig, compile: bool | str, device: torch.device,
         sync: StepSync, comm: Comm, filled_later: bool = False, fill=None, units=()) -> torch.nn.Module:
    """Activation checkpointing, compile, then ZeRO / data parallelism over `dp_mesh` (None: no
    wrapper; `dp_group`: its group, None for the default group) around one model (or stage).
    `filled_later`: the weights are loaded after this (a checkpoint, a live peer): not broadcast now.
    `fill(module)`: makes a meta model real, called here where the wrapper needs real tensors (DDP).
    `units`: ZeRO 2/3's units over meshes of their own (zero.py shard_parameters)."""
    if precision.activation_checkpointing:
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, block_types))
    if compile:
        model = torch.compile(model, mode=compile_mode(compile))
    if dp_mesh is None or dp_mesh.size() == 1:
        return model
    if zero >= 2:
        model = shard_parameters(model, block_types, dp_mesh, zero, sharded_mixed_precision(precision),
                                 parallel.offload, units)
    elif dims.tp > 1 or dims.pp > 1:
        # DDP holds no DTensors, and it decides at forward time whether a backward all-reduces, which a
        # pipeline schedule's interleaved forwards and backwards break
        model = replicate_dtensor(model, block_types, dp_mesh)
    else:
        if fill is not None:
            fill(model)
        model = replicate_ddp(model, device, dp_group, init_sync=not filled_later)
    sync.install(model, dp_group, comm.log)
    return model


def tied_stage_group(tied: list[str], dims: ParallelDims, rank: int, comm: Comm):
    """Collective (every rank creates every group): for a model whose weights are tied across its ends
    (a GPT's embedding and output head), the group of the first and the last pipeline stage of this
    rank's (dp, tp) position, which add up that weight's gradients; None when nothing is tied."""
    if not tied:
        return None
    mine = None
    for dp in range(dims.dp):
        for tp in range(dims.tp):
            ranks = [dims.rank_of(pp=0, dp=dp, tp=tp), dims.rank_of(pp=dims.pp - 1, dp=dp, tp=tp)]
            group = comm.new_group(ranks)
            if rank in ranks:
                mine = group
    return mine


def _names_by_param(model: torch.nn.Module) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(name)
    return out
