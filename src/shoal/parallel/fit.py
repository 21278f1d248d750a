"""Does a model fit a layout? Checked before any worker starts, on the meta device (only shapes are
looked at), and kept light: the launcher imports it without the strategies' libraries. Its shapes
(tensor-parallel sizes, pipeline split, blocks to checkpoint), then its memory: the model state one rank
holds, by the planner's arithmetic (state_bytes.py), against what its device has."""

from __future__ import annotations

import dataclasses
import math

from shoal import hardware
from shoal.config import Config, ParallelConfig, PrecisionConfig
from shoal.errors import UserError
from shoal.layout import Layout
from shoal.models.spec import ModelBundle
from shoal.parallel.pipeline import split_stages
from shoal.parallel.state_bytes import (
    ModelShape,
    bundle_shape,
    copies,
    expert_split,
    largest_unit,
    rank_params,
    stage_params,
    state_bytes,
)
from shoal.topology import ParallelDims


def check_model_fits(bundle: ModelBundle, model_name: str, parallel: ParallelConfig,
                     precision: PrecisionConfig, memo: dict | None = None) -> None:
    """Refuse, before any worker starts, what parallelize() could not do for this model (on the meta
    device: only shapes are looked at). `memo`: answers kept per the keys they depend on, for one bundle
    asked of many layouts (shoal plan asks the same split for every ZeRO stage and micro-batch)."""
    if memo is None:
        return _check_model_fits(bundle, model_name, parallel, precision)
    p = parallel
    key = (p.tp, p.sequence_parallel, p.pp, p.pp_schedule, p.pp_stages_per_rank, repr(p.pp_split),
           precision.activation_checkpointing)
    if key not in memo:
        try:
            _check_model_fits(bundle, model_name, parallel, precision)
            memo[key] = None
        except UserError as e:
            memo[key] = str(e)
    if memo[key] is not None:
        raise UserError(memo[key])


def zero_shards(layout: Layout) -> bool:
    """Does FSDP2 shard the parameters: ZeRO 2/3 over a replica of more than one rank (apply.wrap)."""
    return layout.zero >= 2 and layout.shard_ranks > 1


def check_shardable(bundle: ModelBundle, layout: Layout) -> None:
    """ZeRO 2/3 shards each parameter along its first dimension with FSDP2, which refuses a parameter that has
    none (a ReZero gate or a logit scale made with torch.tensor(0.0)): refused here, before any worker starts."""
    if not zero_shards(layout):
        return
    scalars = [name for name, p in bundle.model.named_parameters() if p.dim() == 0]
    if scalars:
        raise UserError(f"parallel.zero = {layout.zero} shards every parameter along its first dimension (FSDP2), "
                        f"and {scalars[0]} is a scalar; make it a tensor of one element (torch.tensor([x]) or "
                        f"x.reshape(1)), or set parallel.zero = 1")


def _check_model_fits(bundle: ModelBundle, model_name: str, parallel: ParallelConfig,
                      precision: PrecisionConfig) -> None:
    tp, pp = parallel.tp, parallel.pp
    if tp > 1:
        if bundle.tensor_parallel is None:
            raise UserError(f'parallel.tp = {tp}, but model "{model_name}" cannot be split by tensor parallelism '
                            f"(its ModelBundle.tensor_parallel is unset); set parallel.tp = 1")
        bundle.tensor_parallel(bundle.model, tp, sequence_parallel=parallel.sequence_parallel)  # sizes only
    if pp > 1:
        if bundle.pipeline is None:
            raise UserError(f'parallel.pp = {pp}, but model "{model_name}" cannot be split into pipeline stages '
                            f"(its ModelBundle.pipeline is unset); set parallel.pp = 1")
        layers = bundle.pipeline(bundle.model)
        split_stages(layers.names, layers.costs, pp, parallel.pp_schedule, parallel.pp_stages_per_rank,
                     parallel.pp_split)
    if precision.activation_checkpointing and not bundle.block_types:
        raise UserError(
            f'precision.activation_checkpointing = true, but model "{model_name}" names no blocks to '
            f"checkpoint (ModelBundle.block_types); set it to false"
        )


def check_memory_fits(bundle: ModelBundle, cfg: Config, layout: Layout, local_workers: int | None,
                      memo: dict) -> None:
    """Refuse a layout whose model state clearly cannot fit one rank's device: the largest rank's parameters,
    gradients and optimizer state as the layout shards them, and the largest transient on top (rank_memory),
    against its GPU's total memory, or on the CPU this node's available memory over its `local_workers` (None:
    not checked: a worker that joins a running job sees memory its peers already hold). Activations are not
    guessed: a layout that passes may still run out. Not checked: a parameter server's layout (its servers
    hold the state), where parallel.memory_check = false, or where the device's memory cannot be read.
    `memo`: the model's shape and pipeline stages, across layouts. Each parameter is counted as the model's
    tp plan splits it (state_bytes.bundle_shape: a Hugging Face model's embeddings and head are whole on
    every tp rank)."""
    if layout.servers or not cfg.parallel.memory_check:
        return
    tp = layout.dims.tp > 1  # the split is read only where it counts
    if ("shape", tp) not in memo:
        memo["shape", tp] = bundle_shape(bundle, tp)
    shape = memo["shape", tp]

    def stage_of(r: int) -> list:
        p = cfg.parallel
        key = ("stage", tp, p.pp, p.pp_schedule, p.pp_stages_per_rank, repr(p.pp_split), r)
        if key not in memo:
            if "layers" not in memo:  # the model as pipeline layers, made once
                memo["layers"] = bundle.pipeline(bundle.model)
            memo[key] = stage_params(memo["layers"], p, r, shape.split)
        return memo[key]

    params = rank_params(shape, layout, cfg.parallel.pp_schedule, stage_of)
    need = rank_memory(shape, params, layout, cfg)
    if cfg.parallel.offload:  # ZeRO 2/3 on CUDA (layout.py): the state in CPU memory, what is gathered on the GPU
        checks = [({"copies": need.pop("copies")}, device_memory("cuda", local_workers)),
                  (need, device_memory("cpu", local_workers))]
    else:
        checks = [(need, device_memory(layout.device, local_workers))]
    for parts, has in checks:
        if has is not None and sum(parts.values()) > has[0]:
            raise UserError(_refusal(shape, params, cfg, layout, parts, has))


def check_whole_start(bundle: ModelBundle, why: str, local_workers: int | None) -> None:
    """A model whose build cannot be recorded (training/build.py, `why`) is built whole on the CPU by every
    worker at the start, before its layout shards it: refused when this node's available memory cannot hold a
    whole fp32 copy for each of its `local_workers` (None: not checked)."""
    has = device_memory("cpu", local_workers)
    whole = sum(t.numel() * t.element_size() for t in (*bundle.model.parameters(), *bundle.model.buffers()))
    if has is not None and whole > has[0]:
        raise UserError(f"the model's build cannot be recorded on the meta device ({why}), so each worker builds "
                        f"all {_gib(whole)} of it in CPU memory at the start, but {has[1]}; make the build "
                        f"recordable, or start fewer workers per node")


def rank_memory(shape: ModelShape, params: list, layout: Layout, cfg: Config) -> dict[str, int]:
    """Bytes one rank holding `params` keeps of the model state (params, grads, optimizer: state_bytes.py,
    ZeRO sharding over a replica's ranks under local SGD) and `copies`, the largest transient on top: ZeRO
    0/1 under bf16 / fp16 autocast's 16-bit weight matrices; ZeRO 2 every block gathered (state_bytes.copies)
    and one unit's unsharded gradients; ZeRO 3 the largest unit gathered with its gradients (a block, or the
    root: the layers outside blocks), in the gather's dtype. fp8 computes the rest in bf16, and its linear layers'
    weights gathered in float8 (precision.fp8_all_gather) are counted as bf16: an upper bound."""
    dtype = "bf16" if cfg.precision.dtype == "fp8" else cfg.precision.dtype
    shard, tp = layout.shard_ranks, layout.dims.tp
    shape, params, held = expert_split(shape, params, cfg.parallel.ep, layout.zero)
    need = state_bytes(*held, layout, optimizer=cfg.train.optimizer, momentum=cfg.train.momentum, shard=shard)
    gathered = 2 if dtype in ("bf16", "fp16") else shape.element_size
    if layout.zero == 3:
        need["copies"] = largest_unit(shape, params, tp, gathered) + largest_unit(shape, params, tp, gathered, "grads")
    else:
        need["copies"] = copies(shape, params, layout, dtype, need["params"])
        if layout.zero == 2:
            need["copies"] += largest_unit(shape, params, tp, gathered, "grads")
    return need


def device_memory(device: str, local_workers: int | None) -> tuple[int, str] | None:
    """(bytes one rank may hold, the device in words): a GPU's total memory (the smallest GPU of the node,
    shared by the workers that share it: gloo lets several take one), or the node's available memory over
    its workers; None where it cannot be told (no NVML, no /proc/meminfo, a CPU's workers not known)."""
    if device == "cuda":
        gpus = hardware.gpu_memory()
        if not gpus:
            return None
        name, total = min(gpus, key=lambda g: g[1])
        share = math.ceil(local_workers / len(gpus)) if local_workers else 1
        shared = f", shared by {share} workers" if share > 1 else ""
        return total // share, f"its GPU has {_gib(total)} ({name}{shared})"
    available = hardware.available_memory() if local_workers else None
    if available is None:
        return None
    return available // local_workers, (f"this node has {_gib(available)} available, {_gib(available / local_workers)} "
                                        f"for each of its {local_workers} workers")


def _refusal(shape: ModelShape, params: list, cfg: Config, layout: Layout, parts: dict[str, int],
             has: tuple[int, str]) -> str:
    """The one line: the layout, what one rank needs and of what, what the device has, and what would fit."""
    d, p, t = layout.dims, cfg.parallel, cfg.train
    half = "bf16" if cfg.precision.dtype == "fp8" else cfg.precision.dtype  # what autocast copies weights to
    names = {"params": "parameters", "grads": "gradients",
             "optimizer": "AdamW state" if t.optimizer == "adamw" else "SGD momentum",
             # ZeRO 2/3: blocks, or the layers outside them (a large vocabulary's embeddings and head)
             "copies": f"{half} weight copies" if layout.zero < 2 else "gathered for compute"}
    what = ", ".join(f"{names[k]} {_gib(v)}" for k, v in parts.items() if v)
    where = "of CPU memory under parallel.offload = true" if p.offload and "params" in parts else ""
    fixes = []
    if layout.zero < 3 and layout.shard_ranks > 1 and not p.offload:
        z3 = sum(rank_memory(shape, params, dataclasses.replace(layout, zero=3), cfg).values())
        if z3 <= has[0]:
            fixes.append(f"parallel.zero = 3 needs {_gib(z3)}")
    one = dataclasses.replace(layout, dims=ParallelDims(1, 1, 1, 1), zero=0, replicas=1)
    whole = sum(state_bytes(shape, shape.params, one, optimizer=t.optimizer, momentum=t.momentum).values())
    fixes.append(f"a larger parallel.tp or parallel.pp, or more {'GPUs' if layout.device == 'cuda' else 'nodes'} (the "
                 f"state is {_gib(whole)} in all: fully sharded, at least {math.ceil(whole / max(has[0], 1))} ranks "
                 f"of {_gib(has[0])})")
    if layout.device == "cuda" and not p.offload:
        fixes.append("parallel.offload = true with ZeRO 2/3 (the state in CPU memory)")
    return (f"parallel.zero = {layout.zero} on dp {d.dp} x tp {d.tp} x pp {d.pp}: one rank needs "
            f"{_gib(sum(parts.values()))} {where or 'for the model state'} ({what}), but {has[1]}; activations come "
            f"on top, so no micro-batch size makes it fit: {', or '.join(fixes)}; parallel.memory_check = false "
            f"starts it anyway")


def _gib(n: float) -> str:
    return f"{n / 2 ** 30:.2f} GiB"
