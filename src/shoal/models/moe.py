"""Mixture of experts: shoal's decoder (models/gpt.py) whose MLPs are mixtures of E experts, each token routed to
its top k (token choice), as DeepSeek-V3, Qwen3-MoE and Mixtral train.

A layer (MoE) is a router, the experts and optional shared experts (a SwiGLU MLP every token passes, DeepSeek's
"shared experts"); the first `dense_layers` blocks keep the dense MLP, as DeepSeek-V3's first three do.

- Routing: the router's logits (a linear map without bias) give scores, softmax over the experts (Mixtral, Qwen)
  or a sigmoid per expert (DeepSeek-V3); each token takes the k experts of highest score (plus the balancing
  bias, below), weighted by their scores, normalised to sum to 1 unless `normalize_top_k` is off.
- Experts: SwiGLU MLPs (gate, up, down), their weights stacked (E, in, out). The tokens are sorted by expert and
  each matrix product runs as one grouped GEMM over the experts (torch._grouped_mm, with offsets) where the device
  and shapes allow it, otherwise as one batched product over the experts' tokens padded to the largest count
  (equal within fp32 rounding: tests/unit/test_moe.py). Dropless by default: every token reaches its k experts.
  With `capacity_factor`, an expert takes at most floor(factor x T x k / E) of a sequence's T tokens' choices,
  in token order; the rest of that token's choice is dropped (its residual stream passes).
- Balance: Switch/GShard's auxiliary loss, E x sum_i f_i P_i (f_i: the share of the choices expert i received,
  P_i: its mean routing probability), or DeepSeek-V3's loss-free balancing: a bias per expert, added to the
  scores only to choose, moved after each optimizer step by `bias_rate` towards the experts that received fewer
  than their share of the step's tokens (counted over the data-parallel ranks: every replica moves alike).
  Optional router z-loss (ST-MoE): the squared log-sum-exp of each token's logits.

Both losses are taken per sequence and summed over them, as the language-modelling loss is summed over tokens
([Note: loss contract] in models/spec.py: each sequence's term is weighted by its T tokens, so after the division
by the global batch's tokens the coefficient multiplies the mean over sequences): a sum over sequences is the
same however the global batch is split into ranks and micro-batches, so every layout can equal one process.
They are added to the training loss in the model's forward; validation reports the language-modelling loss alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from shoal.compat import GROUPED_MM
from shoal.errors import UserError
from shoal.models import gpt
from shoal.models.spec import DataSpec, ModelBundle, PipelineLayers


class MoEConfig(gpt.GPTConfig):
    """shoal's decoder (the gpt keys) with mixture-of-experts MLPs."""

    data_kinds: ClassVar = ("tokens",)
    name: Literal["moe"] = "moe"
    experts: int = Field(8, ge=1)
    """Routed experts per MoE layer."""
    top_k: int = Field(2, ge=1)
    """Experts each token is routed to."""
    expert_hidden: int | None = Field(None, ge=1)
    """Hidden width of each expert's SwiGLU MLP; default 4 x d_model / top_k (a token's active expert width as
    a dense MLP's)."""
    shared_experts: int = Field(0, ge=0)
    """Experts every token passes (one SwiGLU MLP of shared_experts x expert_hidden), beside the routed ones."""
    dense_layers: int = Field(0, ge=0)
    """The first this many blocks keep a dense MLP (DeepSeek-V3: 3)."""
    score: Literal["softmax", "sigmoid"] = "softmax"
    """Routing scores: softmax over the experts (Mixtral, Qwen) or a sigmoid per expert (DeepSeek-V3)."""
    normalize_top_k: bool = True
    """Scale each token's k weights to sum to 1."""
    capacity_factor: float | None = Field(None, gt=0)
    """None: dropless. Else an expert takes at most floor(capacity_factor x seq_len x top_k / experts) of a
    sequence's choices, in token order; the choices over it are dropped."""
    balance: Literal["aux_loss", "bias", "none"] = "aux_loss"
    """Load balancing: the auxiliary loss (Switch, GShard), DeepSeek-V3's loss-free bias, or none."""
    aux_loss_coef: float = Field(0.01, ge=0)
    """The auxiliary loss's coefficient (balance = "aux_loss")."""
    bias_rate: float = Field(1e-3, ge=0)
    """How far each expert's bias moves per step (balance = "bias")."""
    z_loss_coef: float = Field(0.0, ge=0)
    """The router z-loss's coefficient (0: off; ST-MoE uses 1e-3)."""
    grouped_mm: bool | Literal["auto"] = "auto"
    """The experts' products as one grouped GEMM: "auto" where the device and shapes allow it; false: the batched
    product everywhere (the same result within fp32 rounding)."""

    @model_validator(mode="after")
    def _routable(self) -> MoEConfig:
        if self.top_k > self.experts:
            raise ValueError(f"model.top_k ({self.top_k}) is above model.experts ({self.experts}): each token picks "
                             f"top_k different experts; lower top_k or raise experts")
        if self.dense_layers >= self.n_layer:
            raise ValueError(f"model.dense_layers ({self.dense_layers}) leaves none of model.n_layer "
                             f"({self.n_layer}) blocks with experts; lower dense_layers or use model.name = \"gpt\"")
        if self.capacity_factor is not None and self.capacity() == 0:
            need = self.experts / (self.seq_len * self.top_k)
            raise ValueError(f"model.capacity_factor = {self.capacity_factor} gives each expert 0 of a sequence's "
                             f"{self.seq_len} x {self.top_k} choices: every token would be dropped; raise it to at "
                             f"least {need:.3g} (or leave it unset: dropless)")
        return self

    def routed_experts(self) -> tuple[int, str]:
        return self.experts, "model.experts"

    def capacity(self) -> int | None:
        """Choices an expert takes of one sequence's (None: dropless)."""
        if self.capacity_factor is None:
            return None
        return int(self.capacity_factor * self.seq_len * self.top_k / self.experts)

    def hidden(self) -> int:
        return self.expert_hidden or max(1, 4 * self.d_model // self.top_k)


def grouped_mm_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch._grouped_mm takes x (M, K) @ w (E, K, N) here: a CPU in fp32 or bf16, or a GPU of compute
    capability 9.0 or newer in bf16; rows of 16-byte multiples (its kernels' alignment)."""
    if GROUPED_MM is None or x.dtype != w.dtype:
        return False
    if x.device.type == "cpu":
        ok = x.dtype in (torch.float32, torch.bfloat16)
    elif x.device.type == "cuda":
        ok = x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    else:
        ok = False
    return ok and all(n * x.element_size() % 16 == 0 for n in (w.shape[1], w.shape[2]))


def shape_only(x: torch.Tensor) -> bool:
    """A tensor without values: the planner's trace (meta, or fake under FakeTensorMode: plan/cost.py)."""
    from torch._subclasses.fake_tensor import is_fake

    return x.is_meta or is_fake(x)


def expert_matmul(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, counts: torch.Tensor,
                  grouped: bool) -> torch.Tensor:
    """Rows of `x` sorted by expert (expert e's are rows offsets[e-1]:offsets[e]) times their expert's matrix
    w[e] (E, K, N): one grouped GEMM, or one batched product over the rows padded per expert to the largest
    count (which reads that count on the host; in the planner's trace, where there are no counts to read, the
    rows as if spread evenly)."""
    if grouped and x.shape[0]:  # no rows (an expert-parallel rank sent none): the batched path's empty product
        return GROUPED_MM(x, w, offs=offsets)
    experts = w.shape[0]
    most = -(-x.shape[0] // experts) if shape_only(x) else int(counts.max()) if x.shape[0] else 0
    starts = offsets - counts
    slot = torch.arange(x.shape[0], device=x.device) - torch.repeat_interleave(starts, counts, output_size=x.shape[0])
    which = torch.repeat_interleave(torch.arange(experts, device=x.device), counts, output_size=x.shape[0])
    padded = x.new_zeros(experts, most, x.shape[1]).index_put((which, slot), x)
    return torch.bmm(padded, w)[which, slot]


class Experts(nn.Module):
    """E SwiGLU MLPs, their weights stacked: gate and up (E, d_model, hidden), down (E, hidden, d_model)."""

    def __init__(self, experts: int, d_model: int, hidden: int, grouped: bool | str):
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(experts, d_model, hidden))
        self.w_up = nn.Parameter(torch.empty(experts, d_model, hidden))
        self.w_down = nn.Parameter(torch.empty(experts, hidden, d_model))
        self.grouped = grouped

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`x`: rows sorted by expert, `counts` (E,) rows per expert."""
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        x = in_compute_dtype(x)
        gate, up, down = (local_weight(w, x.dtype) for w in (self.w_gate, self.w_up, self.w_down))
        grouped = grouped_choice(self.grouped, x, gate, down)
        h = F.silu(expert_matmul(x, gate, offsets, counts, grouped)) * expert_matmul(x, up, offsets, counts, grouped)
        return expert_matmul(h, down, offsets, counts, grouped)


def in_compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """Rows for the experts under autocast in its dtype, as it runs a linear layer (it leaves the experts' products
    alone); else as they are."""
    kind = x.device.type
    if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
        return x.to(torch.get_autocast_dtype(kind))
    return x


def local_weight(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An experts' weight in `dtype`; under expert parallelism a DTensor (parallel/experts.py): its local part, this
    rank's experts."""
    return getattr(w, "to_local", lambda: w)().to(dtype)


def grouped_choice(setting: bool | str, x: torch.Tensor, first: torch.Tensor, last: torch.Tensor) -> bool:
    """Whether the products run as grouped GEMMs (model.grouped_mm): x (M, K) times `first` (E, K, N), and the
    hidden rows times `last` (E, N, K), where the device and shapes allow it under "auto"; never in the planner's
    trace."""
    return not shape_only(x) and (setting is True or (
        setting == "auto" and grouped_mm_fits(x, first) and grouped_mm_fits(x, last.transpose(1, 2))))


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(d_model, hidden, bias=False)
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class MoE(nn.Module):
    """A mixture-of-experts MLP (the module doc). After a training forward: `aux` (its balance and z-losses,
    summed over sequences, or None) and `counts` (E,): the choices each expert received, summed over the
    training forwards since the last optimizer step (what the loss-free bias moves by), or None before any."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.k, self.score, self.normalize = cfg.top_k, cfg.score, cfg.normalize_top_k
        self.balance, self.aux_coef, self.z_coef, self.rate = cfg.balance, cfg.aux_loss_coef, cfg.z_loss_coef, \
            cfg.bias_rate
        self.cap = cfg.capacity()
        self.router = nn.Linear(cfg.d_model, cfg.experts, bias=False)
        self.experts = Experts(cfg.experts, cfg.d_model, cfg.hidden(), cfg.grouped_mm)
        self.shared = SwiGLU(cfg.d_model, cfg.shared_experts * cfg.hidden()) if cfg.shared_experts else None
        # (rows sorted by expert, rows per expert) -> the experts' outputs on the experts' ranks (parallel/experts.py
        # ExpertParallel, not a module); None: here, by `experts`
        self.dispatch = None
        self.register_buffer("expert_bias", torch.zeros(cfg.experts))  # balance = "bias": saved with the model
        # not a buffer: DDP broadcasts rank 0's buffers before each forward, which would replace every rank's counts
        self.counts: torch.Tensor | None = None
        self.stepped: dict[int, torch.Tensor] = {}  # the counts of the last two steps, by step (metrics read them)
        self.aux: torch.Tensor | None = None
        self.carry: CarriedLosses | None = None  # in a pipeline stage: the losses go into the backward through it

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, C) -> (logits (B, T, E) fp32, scores (B, T, E), chosen (B, T, k), their weights (B, T, k))."""
        logits = self.router(x).float()
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        biased = scores + self.expert_bias if self.balance == "bias" else scores
        chosen = biased.topk(self.k, dim=-1, sorted=False).indices
        weights = scores.gather(-1, chosen)
        if self.normalize and self.k > 1:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, scores, chosen, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        logits, scores, chosen, weights = self.route(x)
        experts = scores.shape[-1]
        # the planner's trace has no values to route by: every choice kept, spread evenly over the experts, and
        # nothing counted
        planned = shape_only(x)
        carried = None
        if self.training:
            per_seq = torch.zeros(B, experts, device=x.device).scatter_add_(
                1, chosen.reshape(B, -1), torch.ones(B, T * self.k, device=x.device))  # (B, E): choices received
            aux = self._losses(logits, scores, per_seq)  # as the first time, where checkpointing runs it again
            # activation checkpointing runs the forward again inside the backward (the autograd engine's task id is
            # -1 outside one): its choices were counted, and its losses taken into the loss, the first time
            if torch._C._current_graph_task_id() == -1:
                if self.carry is not None:  # a pipeline stage's: kept by the CarriedLosses
                    carried = None if planned else (aux, per_seq.sum(0))
                else:
                    self.aux = aux
                    if not planned:
                        self.counts = per_seq.sum(0) + (0 if self.counts is None else self.counts)
        flat = chosen.reshape(-1)  # (B T k): token b t's choices at (b T + t) k + j
        capped = self.cap is not None and not planned
        kept = self._within_capacity(chosen) if capped else torch.ones_like(flat, dtype=torch.bool)
        order = torch.argsort(torch.where(kept, flat, experts), stable=True)[:int(kept.sum()) if capped else None]
        counts = spread(order.numel(), experts, x.device) if planned else torch.bincount(flat[order], minlength=experts)
        rows = x.reshape(B * T, C)[order // self.k]
        out = (self.dispatch or self.experts)(rows, counts) * weights.reshape(-1)[order, None].to(x.dtype)
        mixed = x.new_zeros(B * T * self.k, C).index_copy(0, order, out).view(B, T, self.k, C).sum(2)
        out = mixed + self.shared(x) if self.shared is not None else mixed
        return out if carried is None else self.carry.add(self, out, *carried)

    def _within_capacity(self, chosen: torch.Tensor) -> torch.Tensor:
        """(B T k,) whether each choice is within its expert's capacity in its sequence (earlier tokens first)."""
        B, T, k = chosen.shape
        experts = self.router.out_features
        key = (torch.arange(B, device=chosen.device)[:, None, None] * experts + chosen).reshape(-1)
        order = torch.argsort(key, stable=True)
        first = torch.searchsorted(key[order], key[order], right=False)  # each group's first place in sorted order
        rank = torch.empty_like(order).index_copy_(0, order, torch.arange(key.numel(), device=key.device) - first)
        return rank < self.cap

    def _losses(self, logits: torch.Tensor, scores: torch.Tensor, per_seq: torch.Tensor) -> torch.Tensor | None:
        """The balance and z-losses, per sequence, each weighted by its T tokens and summed (the module doc)."""
        _, T, E = scores.shape
        total = None
        if self.balance == "aux_loss" and self.aux_coef:
            share = per_seq / (T * self.k)  # (B, E): f_i
            probs = (scores / scores.sum(-1, keepdim=True)).mean(1)  # (B, E): P_i
            total = self.aux_coef * E * T * (share * probs).sum()
        if self.z_coef:
            z = self.z_coef * logits.logsumexp(-1).square().sum()
            total = z if total is None else total + z
        return total

    @torch.no_grad()
    def move_bias(self, step: int = 0) -> None:
        """After the update of step `step`: DeepSeek-V3's bias update, each expert's bias up by `rate` if it
        received fewer than the mean, down if more (its counts already summed over the data-parallel ranks);
        the counts kept as that step's, and started again."""
        if self.counts is None:
            return
        if self.balance == "bias":
            self.expert_bias += self.rate * torch.sign(self.counts.mean() - self.counts)
        self.keep(step, self.counts)
        self.counts = None

    def keep(self, step: int, counts: torch.Tensor) -> None:
        """`counts` as those of step `step`, beside the step before's (the loop may log a step after the next)."""
        self.stepped = {k: v for k, v in self.stepped.items() if k >= step - 1} | {step: counts}


def spread(n: int, experts: int, device) -> torch.Tensor:
    """`n` rows over `experts` as evenly as they go (the first n % experts get one more)."""
    return torch.full((experts,), n // experts, device=device) + (torch.arange(experts, device=device) < n % experts)


class MoEGPT(gpt.GPT):
    """gpt.GPT whose blocks from `dense_layers` on have an MoE in place of the MLP; its training loss adds the
    layers' balance and z-losses."""

    def __init__(self, cfg: MoEConfig, vocab_size: int):
        super().__init__(cfg, vocab_size)
        for block in list(self.blocks)[cfg.dense_layers:]:
            block.mlp = MoE(cfg)
        for name, p in self.named_parameters():
            if name.endswith(("experts.w_gate", "experts.w_up", "shared.gate.weight", "shared.up.weight",
                              "router.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02)
            elif name.endswith(("experts.w_down", "shared.down.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def forward(self, idx: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        out = super().forward(idx, target)
        if target is not None and self.training:
            for layer in self.moe_layers():
                if layer.aux is not None:
                    out = out + _like(layer.aux.to(out.dtype), out)
                layer.aux = None
        return out


class CarriedLosses:
    """The balance and z-losses and the counts of the MoE layers of a pipeline's stages. A stage hands the next its
    activations only, and only the last stage takes a loss, so each layer's losses enter the backward through its
    output (Megatron-Core's aux-loss scaler): the output passes unchanged, and its backward gives the losses the
    gradient the schedule gives the last stage's loss (the step's scale, [Note: loss contract]), as if added to it.
    What each forward took is kept until the schedule is done: the schedule's first call runs each stage once more,
    before the micro-batches, to learn its shapes, and that forward is left out of the loss and the counts."""

    def __init__(self):
        self.scale: torch.Tensor | float = 1.0
        self.seen: dict[int, tuple[MoE, list]] = {}  # by layer: (layer, [(its losses, its counts) per forward])

    def start(self, scale: torch.Tensor | float) -> None:
        """A step's schedule begins; its losses are scaled by `scale`."""
        self.scale, self.seen = scale, {}

    def add(self, layer: MoE, out: torch.Tensor, losses: torch.Tensor | None, counts: torch.Tensor) -> torch.Tensor:
        self.seen.setdefault(id(layer), (layer, []))[1].append((None if losses is None else losses.detach(), counts))
        return out if losses is None else _Carry.apply(out, losses, self.scale)

    def taken(self, forwards: int, device) -> torch.Tensor:
        """After the schedule: the sum of the losses of each layer's last `forwards` forwards (the micro-batches),
        zero for a stage without MoE layers; their counts added to each layer's (MoE.counts)."""
        total = torch.zeros((), device=device)
        for layer, entries in self.seen.values():
            for losses, counts in entries[-forwards:]:
                total = total if losses is None else total + losses.float()
                layer.counts = counts + (0 if layer.counts is None else layer.counts)
        self.seen = {}
        return total


class _Carry(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out: torch.Tensor, losses: torch.Tensor, scale) -> torch.Tensor:
        ctx.scale, ctx.like = scale, losses.detach()
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones_like(ctx.like) * ctx.scale, None


def _like(aux: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """A layer's losses as the language-modelling loss is held: under tensor parallelism that is a DTensor,
    replicated over the tp ranks (loss_parallel's), and each tp rank computed the same losses."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(loss, DTensor):
        return aux
    return DTensor.from_local(aux, loss.device_mesh, [Replicate()] * loss.device_mesh.ndim, run_check=False)


@dataclass
class Stages:
    """Under a pipeline, what bias_balance needs besides the whole model: this rank's stages (their MoE layers are
    the ones it trains), a sum over the pipeline's stages (in place), and the device."""

    held: nn.Module
    total: Callable[[torch.Tensor], object]
    device: torch.device


def bias_balance(model: nn.Module, all_reduce: Callable[[torch.Tensor], object] | None = None,
                 step: Callable[[], int] = lambda: 0, read: Callable[[], bool] = lambda: True,
                 stages: Stages | None = None):
    """The optimizer's step post-hook of a model with MoE layers (None without): after each update every layer's
    counts summed in place by `all_reduce` (over the data-parallel ranks, whose replicas must move alike; None:
    this process alone), then its bias moved and the counts kept as those of step `step()` (MoE.move_bias).
    Without the loss-free bias the sums are only read by the metrics: `read()` says whether this step's are (a
    logged step, alike on every rank); on the others each rank keeps its own counts, and no collective runs.
    Under a pipeline (`stages`) a rank trains its stages' layers only; on the steps read, every layer's sums are
    gathered from their stages, for the metrics."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers:
        return None
    here = layers if stages is None else [m for m in stages.held.modules() if isinstance(m, MoE)]
    moves = any(m.balance == "bias" for m in layers)

    @torch.no_grad()
    def after_step(*_) -> None:
        if all_reduce is not None and here and (moves or read()):  # every rank stepped (a layer without counts
            # took no training forward here)
            counts = torch.stack([torch.zeros_like(m.expert_bias) if m.counts is None else m.counts for m in here])
            all_reduce(counts)
            for m, c in zip(here, counts, strict=True):
                m.counts = c
        done = step()
        for m in here:
            m.move_bias(done)
        if stages is not None and read():
            gather_stages(layers, here, stages, done)
    return after_step


def gather_stages(layers: list[MoE], here: list[MoE], stages: Stages, done: int) -> None:
    """Each layer's counts of step `done`, kept by the rank of its stage, summed into every rank's copy."""
    mine = {id(m) for m in here}
    full = torch.zeros(len(layers), layers[0].router.out_features, device=stages.device)
    for i, m in enumerate(layers):
        if id(m) in mine and done in m.stepped:
            full[i] = m.stepped[done]
    stages.total(full)
    for m, c in zip(layers, full, strict=True):
        if id(m) not in mine:
            m.keep(done, c)


def expert_figures(model: nn.Module, step: int) -> dict:
    """What metrics.jsonl records of step `step` (1-based) of a model with MoE layers ({} without, or before its
    counts): per layer, the choices each expert received over the global batch, and the imbalance (the most any
    expert received over the mean); under expert parallelism also the ranks' (the most any ep rank's experts
    received over the mean: what the others wait for). Reads them from the device: for logged steps only."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    counts = [m.stepped.get(step) for m in layers]
    if not counts or any(c is None for c in counts):
        return {}
    per_layer = torch.stack(counts).tolist()
    out = {"expert_tokens": [[int(n) for n in layer] for layer in per_layer],
           "expert_imbalance": [imbalance(layer) for layer in per_layer]}
    ep = getattr(layers[0].dispatch, "ep", 1)  # parallel/experts.py's ExpertParallel: rank r holds the r-th E / ep
    if ep > 1:
        local = len(per_layer[0]) // ep
        out["ep_imbalance"] = [imbalance([sum(layer[r * local:(r + 1) * local]) for r in range(ep)])
                               for layer in per_layer]
    return out


def imbalance(received: list[float]) -> float | None:
    """The most any received over the mean (1.0: even); None where none received any."""
    return round(max(received) / (sum(received) / len(received)), 4) if sum(received) else None


def routed_params(cfg: MoEConfig, experts: int) -> int:
    """The weights of `experts` routed experts (SwiGLU: three d_model x hidden matrices) in every MoE layer."""
    return experts * 3 * cfg.d_model * cfg.hidden() * (cfg.n_layer - cfg.dense_layers)


def idle_params(cfg: MoEConfig) -> int:
    """The expert weights a token does not pass through: of each MoE layer's experts, all but top_k."""
    return routed_params(cfg, cfg.experts - cfg.top_k)


def flops(model: MoEGPT, cfg: MoEConfig) -> float:
    """Training FLOPs of one sequence (gpt.flops), counting of each MoE layer's experts the top_k a token uses."""
    return gpt.flops(model, cfg) - 6.0 * idle_params(cfg) * cfg.seq_len


def build(cfg: MoEConfig, spec: DataSpec) -> ModelBundle:
    model = MoEGPT(cfg, gpt.padded_vocab(cfg, spec))
    return ModelBundle(model, gpt.lm_loss, gpt.count_tokens, block_types=(gpt.Block,), items_name="tokens",
                       tensor_parallel=tensor_parallel, tp_split=gpt.tp_split, pipeline=pipeline_layers,
                       flops_per_sample=flops(model, cfg), loss_in_forward=True,
                       active_params=sum(p.numel() for p in model.parameters()) - idle_params(cfg))


def tensor_parallel(model, tp: int, mesh=None, sequence_parallel: bool = False):
    """Tensor parallelism as the GPT's (gpt_parallel.py: attention's heads, the dense blocks' MLPs, the embedding
    and head split over the tp ranks), with each MoE layer whole on every tp rank: the ranks hold the same tokens
    after attention's all-reduce, so each routes and computes them alike (their experts' gradients come out
    equal, as the norms' do), and its outputs and losses are those of one process."""
    if sequence_parallel:
        raise UserError('parallel.sequence_parallel with model.name = "moe" is not built yet: its MoE layers take '
                        "the whole sequence on each tp rank; set parallel.sequence_parallel = false")
    return gpt.tensor_parallel(model, tp, mesh, sequence_parallel)


def pipeline_layers(model: MoEGPT) -> PipelineLayers:
    """The model as the GPT's layers (gpt_parallel.py), each MoE block's cost counting its router, shared experts
    and top_k of its experts (forward FLOPs per token); its layers' losses carried into the backward through
    their outputs (CarriedLosses), the stages without the model's forward that adds them to the loss."""
    layers = gpt.pipeline_layers(model)
    carried = CarriedLosses()
    costs = list(layers.costs)
    for i, block in enumerate(model.blocks):
        if isinstance(block.mlp, MoE):
            block.mlp.carry = carried
            experts = block.mlp.experts
            costs[1 + i] += 2 * block.mlp.k * sum(w.shape[1] * w.shape[2] for w in (experts.w_gate, experts.w_up,
                                                                                   experts.w_down))
    return layers._replace(costs=costs, carried=carried)
