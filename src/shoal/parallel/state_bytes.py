"""The bytes of model state one rank holds under a layout, from the parameters' shapes alone: pure
arithmetic, shared by the preflight's memory check (parallel/fit.py) and the planner's memory model
(plan/predict.py, which adds activations, the data and the heap). Each parameter is counted where it lives:
  params      tp splits the parameters the model's tp plan splits (ModelBundle.tp_split; for a Hugging Face
              model its attention and MLP layers, not the embeddings, norms or head) and leaves the rest whole
              on every tp rank; pp keeps the rank's stages' layers; ZeRO 2/3 (FSDP2) shard every tensor's
              first dimension over dp (rank 0's chunk is the ceiling)
  grads       as params for ZeRO 2/3; whole (this rank's tp/pp part) for ZeRO 0/1; none when frozen
  optimizer   AdamW: 2 fp32 moments + a one-element step per parameter; SGD: the momentum buffer;
              ZeRO 1 gives whole parameters to ranks greedily by size (ZeroRedundancyOptimizer), 2/3 shard
  copies      the parameters' copies compute uses: ZeRO 2 keeps every block gathered from forward to
              backward, ZeRO 3 two blocks (one prefetched), in the gather's dtype (16 bits under bf16);
              ZeRO 0/1 under bf16 / fp16: autocast's 16-bit copy of every weight matrix, kept for backward
Parameters, gradients and optimizer state are fp32 whatever precision.dtype: shoal keeps fp32 master
weights and computes in 16 bits through autocast and FSDP2's mixed precision (parallel/precision.py).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from shoal.config import ParallelConfig
from shoal.layout import Layout
from shoal.models.meta import on_meta
from shoal.models.spec import ModelBundle
from shoal.models.tp_plan import split_parameters
from shoal.parallel.pipeline import split_stages

Param = tuple[int, int, int, bool, bool]  # (numel, first dimension, ndim, trainable, split by tp)


@dataclass
class ModelShape:
    """What the arithmetic needs of the model: each parameter as (numel, first dimension, ndim, trainable,
    split by tp), grouped by where it is (per block, or outside), and each pipeline stage's parameters.
    `split`: the ids of the parameters tp splits, for the stages described later (None: every matrix)."""

    params: list[Param]
    block_params: list[list[Param]]
    stage_params: dict[tuple[int, int], list[Param]] = field(default_factory=dict)
    element_size: int = 4
    split: frozenset[int] | None = None
    memo: dict = field(default_factory=dict, repr=False, compare=False)  # figures of parameter lists, once each

    def __post_init__(self):
        # a record without the split (a Session's, plan/check.py: 4 fields) takes it as `param` does
        if any(len(p) == 4 for ps in (self.params, *self.block_params) for p in ps):
            self.params = [param(*p) for p in self.params]
            self.block_params = [[param(*p) for p in b] for b in self.block_params]

    def grouped(self, params: list) -> list[tuple[Param, int]]:
        """`params` as its distinct (numel, first dimension, ndim, trainable, split) and how many of each: a model's
        blocks repeat a dozen shapes, and a plan asks thousands of layouts for their bytes. Kept per list
        (the list is held with it, so that its id stays its own)."""
        key = ("grouped", id(params))
        if key not in self.memo:
            self.memo[key] = (params, list(Counter(params).items()))
        return self.memo[key][1]

    def once(self, key: tuple, make):
        """`make()`, kept under `key`: a figure many layouts share."""
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]


def expert_local(shape: ModelShape, ep: int) -> ModelShape:
    """`shape` as one rank of parallel.ep holds it: each MoE layer's expert tensors (models/moe.py's Experts, the
    model's only three-dimensional parameters, (experts, ., .)) with experts / ep of their experts; the rest whole.
    Under ZeRO 2/3 the experts are sharded further over the ranks that hold the same ones (dp / ep of them), which
    leaves a rank experts / dp of them, as the whole shape sharded over dp counts: there this shape counts only what
    is gathered for compute."""
    if ep == 1:
        return shape
    return shape.once(("ep", ep), lambda: ModelShape(_experts_local(shape.params, ep),
                                                       [_experts_local(b, ep) for b in shape.block_params],
                                                       element_size=shape.element_size, split=shape.split))


def _experts_local(params: list[Param], ep: int) -> list[Param]:
    return [(n // ep, dim0 // ep, ndim, trainable, split) if ndim == 3 else (n, dim0, ndim, trainable, split)
            for n, dim0, ndim, trainable, split in params]


def expert_split(shape: ModelShape, params: list, ep: int, zero: int) -> tuple[ModelShape, list, tuple]:
    """Under parallel.ep: (the shape a rank computes with, its parameters, (shape, parameters) its model state is
    counted from). `params`: the rank's (a pipeline's: its stages'). Compute sees a rank's experts only
    (expert_local); the state is those experts under ZeRO 0/1, and the rank's parameters whole, sharded over dp as
    state_bytes counts them, under ZeRO 2/3. ep 1: `shape` and `params` for all three."""
    if ep == 1:
        return shape, params, (shape, params)
    local, mine = expert_local(shape, ep), _experts_local(params, ep)
    return local, mine, (shape, params) if zero >= 2 else (local, mine)


def param(numel: int, dim0: int, ndim: int, trainable: bool, split: bool | None = None) -> Param:
    """One parameter as ModelShape holds it; `split` None: not known (a model that does not say what its tp plan
    splits, ModelBundle.tp_split; a Session's record), taken as split where it is a matrix (ndim >= 2)."""
    return numel, dim0, ndim, bool(trainable), ndim >= 2 if split is None else bool(split)


def describe(params, split: frozenset[int] | None = None) -> list[Param]:
    """Parameters as ModelShape holds them; tied weights count once. `split`: the ids of those tensor
    parallelism splits (None: not known, as `param` takes it)."""
    seen, out = set(), []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(param(p.numel(), p.shape[0] if p.dim() else 1, p.dim(), p.requires_grad,
                             None if split is None else id(p) in split))
    return out


def shape_of(model, block_types: tuple, split=None) -> ModelShape:
    """`model`'s ModelShape (on any device; the meta one costs nothing), its blocks those of `block_types`;
    `split`: the parameters tensor parallelism splits (None: every matrix)."""
    ids = None if split is None else frozenset(id(p) for p in split)
    blocks = [m for m in model.modules() if block_types and isinstance(m, block_types)]
    return ModelShape(describe(model.parameters(), ids), [describe(b.parameters(), ids) for b in blocks], split=ids)


def bundle_shape(bundle: ModelBundle, tp_split: bool = True) -> ModelShape:
    """The ModelShape of a bundle's model, each parameter split by tp as its tp plan splits it
    (tp_plan.split_parameters). `tp_split=False`: for layouts without tp, where the split does not count (a GPT's
    plan imports DTensor's parallel styles, which the launcher's preflight then need not)."""
    return shape_of(bundle.model, bundle.block_types, split_parameters(bundle) if tp_split else None)


def stage_params(layers, parallel: ParallelConfig, pp_rank: int, split: frozenset[int] | None = None) -> list[Param]:
    """Parameters of pipeline rank `pp_rank`'s stages under `parallel`'s split of `layers` (the model's
    PipelineLayers), each stage built on the meta device; `split` as describe takes it (a stage holds the
    model's own parameters: ModelShape.split)."""
    p = parallel
    stages = split_stages(layers.names, layers.costs, p.pp, p.pp_schedule, p.pp_stages_per_rank, p.pp_split)
    out = []
    for k in range(stages.stages_per_rank):
        with on_meta():
            out += describe(layers.build_stage(*stages.bounds(pp_rank + k * p.pp)).parameters(), split)
    return out


def shard_bytes(shape: ModelShape, params, shard: int, zero_sharded: bool, tp: int, esize: int, what: str) -> int:
    """Bytes of `params` on the largest rank: those the model's tp plan splits divided by tp (the rest whole
    on every tp rank), then (ZeRO 2/3) the first dimension chunked over `shard` ranks, rank 0's chunk the
    ceiling. `what`: "params" all of them, "grads" the trainable ones, "matrices" those of two dimensions
    or more."""
    total = 0
    for (numel, dim0, ndim, trainable, split), count in shape.grouped(params):
        if (what == "grads" and not trainable) or (what == "matrices" and ndim < 2):
            continue
        rest = numel // max(dim0, 1)
        d0 = dim0 // tp if (tp > 1 and split) else dim0
        if zero_sharded and shard > 1:
            d0 = math.ceil(d0 / shard)
        total += count * d0 * rest * esize
    return total


def zero1_max(params, dp: int, tp: int, per_element: int, per_param: int) -> int:
    """ZeroRedundancyOptimizer: parameters sorted by size, each to the least loaded rank."""
    loads = [0] * dp
    for numel in sorted((n for n, _, _, t, _ in params if t), reverse=True):
        i = loads.index(min(loads))
        loads[i] += numel * per_element + per_param
    return max(loads)


def numel(shape: ModelShape, params: list, trainable: bool = False) -> int:
    """Elements of `params` (`trainable`: of those that train)."""
    return sum(g[0] * count for g, count in shape.grouped(params) if g[3] or not trainable)


def rank_params(shape: ModelShape, layout: Layout, schedule: str, stage_of) -> list:
    """Parameters of the largest pp rank (its stages), or all."""
    if layout.dims.pp == 1:
        return shape.params
    return max((stage_of(r) for r in range(layout.dims.pp)), key=lambda ps: numel(shape, ps))


def state_bytes(shape: ModelShape, params: list, layout: Layout, *, optimizer: str, momentum: float,
                shard: int | None = None) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state on the largest rank holding `params` (its tp / pp
    part of the model), ZeRO sharding over `shard` ranks (default the layout's: dp, a replica's ranks under
    local SGD, a shard group's under HSDP)."""
    d, zero, es = layout.dims, layout.zero, shape.element_size
    shard = layout.shard_ranks if shard is None else shard
    sharded = zero >= 2
    p_bytes = shard_bytes(shape, params, shard, sharded, d.tp, es, "params")
    g_bytes = shard_bytes(shape, params, shard, sharded, d.tp, es, "grads")
    moments = 2 if optimizer == "adamw" else (1 if momentum else 0)
    step_bytes = 4 if optimizer == "adamw" else 0  # AdamW's step: a one-element fp32 tensor per parameter
    n_trainable = sum(count for g, count in shape.grouped(params) if g[3])
    if zero == 1:
        opt = shape.once(("zero1", id(params), shard, d.tp, moments * es, step_bytes), lambda: zero1_max(
            [(n // d.tp if d.tp > 1 and s else n, d0, nd, t, s) for n, d0, nd, t, s in params],
            shard, 1, moments * es, step_bytes))
    else:
        opt = g_bytes * moments + n_trainable * step_bytes
    return {"params": p_bytes, "grads": g_bytes, "optimizer": opt}


def copies(shape: ModelShape, params: list, layout: Layout, dtype: str, p_bytes: int) -> int:
    """Bytes of the parameters' copies that compute uses: ZeRO 2 keeps every block gathered from forward to
    backward, ZeRO 3 two blocks (one prefetched); ZeRO 0/1 in 16 bits autocast's copies."""
    d, zero, es, half = layout.dims, layout.zero, shape.element_size, dtype in ("bf16", "fp16")
    if zero >= 2:
        # FSDP2 gathers in the compute dtype under bf16 (precision.sharded_mixed_precision): a 16-bit copy
        gs = 2 if half else es
        if zero == 2:
            return shard_bytes(shape, params, 1, False, d.tp, gs, "params") - (p_bytes if gs == es else 0)
        return 2 * largest_block(shape, d.tp, gs)
    # autocast casts each weight matrix to 16 bits once per autocast region and the layer keeps the copy for
    # backward: a 16-bit copy of the rank's matrices lives from forward to backward
    return shard_bytes(shape, params, 1, False, d.tp, 2, "matrices") if half else 0


def largest_block(shape: ModelShape, tp: int, esize: int) -> int:
    """Bytes of the largest block's whole parameters (its tp part) at `esize` bytes an element: what ZeRO 3
    gathers at once."""
    return shape.once(("block", tp, esize), lambda: max(
        (shard_bytes(shape, b, 1, False, tp, esize, "params") for b in shape.block_params), default=0))


def largest_unit(shape: ModelShape, params: list, tp: int, esize: int, what: str = "params") -> int:
    """Bytes of the largest unit ZeRO 2/3 gathers whole (`what` as shard_bytes takes it; its tp part, at `esize`
    bytes an element): a block, or the root, which is `params` outside the blocks (all of them for a model
    that names no blocks: FSDP2 then gathers the whole model at once)."""
    def make() -> int:
        in_blocks = Counter(p for b in shape.block_params for p in b)
        root = list((Counter(params) - in_blocks).elements())
        return max(shard_bytes(shape, u, 1, False, tp, esize, what) for u in [*shape.block_params, root])

    return shape.once(("unit", id(params), tp, esize, what), lambda: (params, make()))[1]  # held: its id stays its own
