"""The plan of one config: its model traced once on the meta device, every candidate layout checked
and predicted, the valid ones ranked by predicted step time; a layout that does not fit in the memory
given is rejected with the figure."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from shoal.config import Config
from shoal.data.sources import build_source
from shoal.errors import UserError
from shoal.hardware import HardwareProfile
from shoal.layout import resolve_layout
from shoal.models.meta import on_meta
from shoal.models.moe import routed_params
from shoal.models.registry import build_model
from shoal.models.tp_plan import split_parameters
from shoal.parallel.state_bytes import (
    ModelShape,
    expert_split,
    numel,
    rank_params,
    shape_of,
    shard_bytes,
    stage_params,
)
from shoal.plan.cost import MicroBatchCost, affine, trace_micro_batch, trace_optimizer_step
from shoal.plan.enumerate import Candidate, candidates
from shoal.plan.predict import (
    MoEExchange,
    Prediction,
    autocast_dtype,
    in_flight,
    predict_memory,
    predict_time,
    sixteen_bit_scale,
)
from shoal.training.build import freeze

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2 ** 10, "mib": 2 ** 20,
          "gib": 2 ** 30, "tib": 2 ** 40}


def parse_bytes(text: str, flag: str = "--memory") -> int:
    """'80GB' (10^9), '80GiB' (2^30), '512MB', '1e9' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise UserError(f"{flag} {text!r}: expected a size such as 80GB, 80GiB or 512MB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


@dataclass
class Planned:
    candidate: Candidate
    prediction: Prediction | None = None
    reason: str | None = None  # rejected: why

    @property
    def ok(self) -> bool:
        return self.reason is None


@dataclass
class Model:
    """The config's model on meta, and what predictions read of it."""

    cfg: Config
    bundle: object
    source: object
    shape: ModelShape
    costs: dict[tuple, MicroBatchCost] = field(default_factory=dict)  # by (micro-batch, autocast dtype)
    opt_ops: object = None
    data_bytes: int = 0  # tensors the data source holds in every worker
    # per pipeline split and rank: its stages' parameters (many layouts share a split: a plan for 1,024
    # workers rebuilt them thousands of times)
    stages: dict[tuple, list] = field(default_factory=dict)
    layers: object = None  # the model as pipeline layers, made once
    # per autocast dtype, the micro-batch sizes traced so far, and (from the third) their costs at any size,
    # where they are affine (cost.affine's function; False: not affine, trace every size)
    traced: dict = field(default_factory=dict)
    at: dict = field(default_factory=dict)
    # attention as the trace runs it: fused (flash), or materialised with this dropout; dropout where the
    # model runs none; dropout as a GPU runs it (cost._Attention)
    fused_attention: bool = True
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    cuda: bool = False
    # the parameters tensor parallelism splits, by the model's tp plan (tp_plan.split_parameters: a Hugging Face
    # model's attention and MLP layers, shoal's GPT all but its norms, positions and row-parallel biases); None:
    # a model that does not say, every matrix
    tp_split: list | None = None

    @classmethod
    def build(cls, cfg: Config, fused_attention: bool = True, attention_dropout: float = 0.0,
              hidden_dropout: float = 0.0, cuda: bool = False) -> Model:
        """`fused_attention=False`: price the model as a stack without fused attention runs it; `cuda`: as
        torch runs it on a GPU (its dropout keeps a 1-byte mask)."""
        source = build_source(cfg.data, getattr(cfg.model, "seq_len", None), cfg.train.seed)
        with on_meta():
            bundle = build_model(cfg.model, source.spec)
        freeze(bundle.model, cfg.train.freeze)
        split = split_parameters(bundle)
        shape = shape_of(bundle.model, bundle.block_types, split)
        model = cls(cfg, bundle, source, shape, fused_attention=fused_attention,
                    attention_dropout=attention_dropout, hidden_dropout=hidden_dropout, cuda=cuda,
                    tp_split=split)
        model.opt_ops = trace_optimizer_step(bundle.model, cfg.train.optimizer, cfg.train.momentum,
                                             bool(cfg.train.grad_clip))
        model.data_bytes = sum(_nbytes(v) for v in vars(source).values())
        return model

    def cost(self, micro: int, autocast: torch.dtype | None = None) -> MicroBatchCost:
        """One micro-batch's costs, run in fp32 or under `autocast` (cost.trace_micro_batch): traced for the
        first three sizes asked, then taken from them where every figure is affine in the size (cost.affine:
        the same as a trace gives; a trace of a 70B GPT took ~0.8 s here, and a plan asks up to a dozen
        sizes)."""
        key = (micro, autocast)
        if key not in self.costs:
            traced = self.traced.setdefault(autocast, [])
            if self.at.get(autocast) is None and len(traced) >= 3:
                self.at[autocast] = affine(traced) or False
            if self.at.get(autocast):
                self.costs[key] = self.at[autocast](micro)
            else:
                batch = self.source.train_batch(torch.arange(micro))
                batch = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
                self.costs[key] = trace_micro_batch(self.bundle, batch, self.bundle.block_types,
                                                    self.fused_attention, self.attention_dropout,
                                                    self.hidden_dropout, self.cuda, self.tp_split, autocast)
                traced.append(self.costs[key])
        return self.costs[key]

    def stage_params(self, cfg: Config, pp_rank: int) -> list:
        """Parameters of pipeline rank `pp_rank`'s stages for `cfg`'s split."""
        p = cfg.parallel
        key = (p.pp, p.pp_schedule, p.pp_stages_per_rank, repr(p.pp_split), pp_rank)
        if key not in self.stages:
            if self.layers is None:
                self.layers = self.bundle.pipeline(self.bundle.model)
            self.stages[key] = stage_params(self.layers, p, pp_rank, self.shape.split)
        return self.stages[key]


def _nbytes(value) -> int:
    """Bytes of a tensor or numpy array a data source holds in memory (its tokens, its images); 0 for
    anything else, and for a memory-mapped token file (its pages are the file's: shared, evictable)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    import numpy as np

    return value.nbytes if isinstance(value, np.ndarray) and not isinstance(value, np.memmap) else 0


def predict(model: Model, cfg: Config, layout, profile: HardwareProfile | None,
            memory: int | None = None, imbalance: float = 1.0) -> Prediction:
    """Memory, then time (not priced for a layout above `memory`: it is rejected). `imbalance`: under parallel.ep,
    the most tokens a rank's experts take over the mean (1.0: balanced)."""
    p, d = cfg.parallel, layout.dims
    # shoal's runs are traced under autocast; a stack without fused attention (Megatron-LM's) keeps every
    # activation in 16 bits: the fp32 trace at half its bytes
    unfused = not model.fused_attention
    cost = model.cost(layout.micro_batch, None if unfused else autocast_dtype(profile, cfg.precision.dtype))
    act_scale = sixteen_bit_scale(profile, cfg.precision.dtype) if unfused else 1.0
    split = (p.pp, p.pp_schedule, p.pp_stages_per_rank, repr(p.pp_split))
    params = model.shape.once(("largest stage", *split), lambda: rank_params(
        model.shape, layout, p.pp_schedule, lambda r: model.stage_params(cfg, r)))
    total = numel(model.shape, params) or 1
    fraction = total / (numel(model.shape, model.shape.params) or 1) if d.pp > 1 else 1.0
    stages = p.pp_stages_per_rank if p.pp_schedule == "interleaved-1f1b" else 1
    # parallel.ep: a rank holds (ZeRO 0/1) or gathers (ZeRO 2/3, whose state is the whole model's over dp) its
    # experts only
    shape, params, held = expert_split(model.shape, params, p.ep, layout.zero)
    mem = predict_memory(shape, params, cost, layout, optimizer=cfg.train.optimizer,
                         momentum=cfg.train.momentum, checkpointing=cfg.precision.activation_checkpointing,
                         schedule=p.pp_schedule, profile=profile, stage_fraction=fraction,
                         data_bytes=model.data_bytes if profile is not None and profile.device == "cpu" else 0,
                         dtype=cfg.precision.dtype, act_scale=act_scale,
                         stages_per_rank=stages, sequence_parallel=p.sequence_parallel, held=held,
                         busiest=int(expert_activations(cfg, layout.micro_batch, imbalance) * (
                             in_flight(layout, p.pp_schedule, stages) if d.pp > 1 else 1)))
    if profile is None or (memory is not None and mem.get("device", mem["peak"]) > memory):
        return Prediction(mem, {"compute": None, "comm": None, "bubble": None, "step": None})
    # a rank's gradients and parameters whole (its tp part: what the model's tp plan leaves whole counts whole)
    grad_bytes = shard_bytes(shape, params, 1, False, d.tp, shape.element_size, "grads")
    full = shard_bytes(shape, params, 1, False, d.tp, shape.element_size, "params")
    t = predict_time(shape, cost, model.opt_ops, layout, profile, dtype=cfg.precision.dtype,
                     checkpointing=cfg.precision.activation_checkpointing, schedule=p.pp_schedule,
                     stages_per_rank=stages, grad_bytes=grad_bytes, param_bytes_full=full,
                     reduce_dtype=cfg.precision.reduce_dtype, act_scale=act_scale, compiled=cfg.train.compile,
                     ep=p.ep, exchange=moe_exchange(cfg, layout.micro_batch),
                     experts=(expert_share(cfg, cost), imbalance), gathered=context_exchange(cfg, layout))
    return Prediction(mem, t)


def context_exchange(cfg: Config, layout) -> tuple[int, int]:
    """What parallel.cp gathers on a rank per micro-batch (parallel/context.py): (attention layers of its stage, the
    bytes of its keys and values, its 1 / cp of each sequence, in the compute dtype); (0, 0) without cp. From
    shoal's GPT's keys or a transformers config's (its key and value heads); (0, 0) for a model that says neither."""
    m = cfg.model
    if layout.cp == 1 or m.name not in ("gpt", "hf"):
        return 0, 0
    element = 4 if cfg.precision.dtype == "fp32" else 2
    if m.name == "hf":
        from shoal.models.hf import hf_config

        c = hf_config(m)
        heads = c.num_attention_heads
        width = getattr(c, "num_key_value_heads", None) or heads
        layers, kv = c.num_hidden_layers, width * (getattr(c, "head_dim", None) or c.hidden_size // heads)
    else:
        layers, kv = m.n_layer, m.d_model
    layers = -(-layers // layout.dims.pp)  # under a pipeline, a stage's
    return layers, 2 * layout.micro_batch * (m.seq_len // layout.cp) * kv * element


def expert_activations(cfg: Config, micro: int, imbalance: float) -> int:
    """Under parallel.ep, the bytes the busiest rank's experts keep for backward beyond a balanced step's: that rank
    receives `imbalance` times the mean of the routed rows (micro x seq_len x top_k), and keeps for each an input
    row of d_model and three of the expert width (the gate's and up's outputs, their product), in the compute
    dtype, in every MoE layer (under a pipeline, of a stage, for each micro-batch in flight: the caller's; under
    activation checkpointing, in the one block being recomputed). 0 without ep, where each rank computes its own
    tokens whatever the balance."""
    m, ex = cfg.model, moe_exchange(cfg, micro)
    if cfg.parallel.ep == 1 or ex is None:
        return 0
    layers = 1 if cfg.precision.activation_checkpointing else ex.layers
    element = ex.row_bytes // m.d_model  # the compute dtype's, as the rows travel
    return int(ex.rows * (imbalance - 1.0) * (m.d_model + 3 * m.hidden()) * element * layers)


def expert_share(cfg: Config, cost: MicroBatchCost) -> float:
    """The share of a micro-batch's FLOPs that a mixture of experts' routed experts compute: the weights of each
    token's top_k experts in every MoE layer (models/moe.py, which counts the model's FLOPs the same way), 6 FLOPs
    a weight and token in forward and backward; 0 for a model without experts."""
    m = cfg.model
    if getattr(m, "experts", None) is None or not cost.ops.flops:
        return 0.0
    return min(1.0, 6.0 * cost.micro_batch * m.seq_len * routed_params(m, m.top_k) / cost.ops.flops)


def moe_exchange(cfg: Config, micro: int) -> MoEExchange | None:
    """What parallel.ep moves in each MoE layer per micro-batch on a rank: every token's top_k choices, a d_model
    row each in the compute dtype (parallel/experts.py); under a pipeline in the MoE layers of one stage (as the
    split balances them: evenly, the larger share first). None: a model without experts."""
    m = cfg.model
    if getattr(m, "experts", None) is None:
        return None
    element = 4 if cfg.precision.dtype == "fp32" else 2
    return MoEExchange(-(-(m.n_layer - m.dense_layers) // cfg.parallel.pp), micro * m.seq_len * m.top_k,
                       m.d_model * element, m.experts, cast=element == 2)


def predict_config(cfg: Config, world: int, profile: HardwareProfile | None, cuda: bool = False,
                   model: Model | None = None) -> Prediction:
    """The prediction for the layout `cfg` itself sets (--check)."""
    model = model or Model.build(cfg, cuda=cuda)
    return predict(model, cfg, resolve_layout(cfg, world, cuda), profile)


def plan(cfg: Config, world: int, profile: HardwareProfile | None, memory: int | None,
         cuda: bool = False, micro_batches: list[int] | None = None, fused_attention: bool = True,
         attention_dropout: float = 0.0, hidden_dropout: float = 0.0, imbalance: float = 1.0,
         model: Model | None = None) -> list[Planned]:
    """Every candidate, the valid ones first by predicted step time (then by peak memory); attention and
    dropout as Model.build takes them (`model`: built already); `imbalance` as predict takes it."""
    model = model or Model.build(cfg, fused_attention, attention_dropout, hidden_dropout, cuda)
    out = []
    nodes = profile.nnodes if profile is not None else 1
    for c in candidates(cfg, world, model.bundle, model.source, cuda, micro_batches, nodes):
        if c.reason:
            out.append(Planned(c, reason=c.reason))
            continue
        pred = predict(model, c.cfg, c.layout, profile, memory, imbalance)
        reason = None
        if memory is not None and pred.fit_bytes > memory:
            reason = (f"does not fit: {human_bytes(pred.fit_bytes)} per rank predicted, "
                      f"--memory {human_bytes(memory)}")
        out.append(Planned(c, pred, reason))

    return sorted(out, key=ranking)


def ranking(pl: Planned) -> tuple:
    """The order of a plan: valid layouts first, those with a predicted step time before any without one
    (never ranked above what can be timed), by step time; those without (a profile with neither curves
    nor a network) by compute time alone, then by peak memory."""
    step = pl.prediction.step_time if pl.prediction else None
    t = step if step is not None else pl.prediction.time["compute"] if pl.prediction else None
    return (not pl.ok, pl.prediction is None, step is None, t if t is not None else float("inf"),
            pl.prediction.fit_bytes if pl.prediction else 0)
