"""The training loop: batch -> forward/backward (accumulated) -> clip -> step -> metrics.

Strategy details (how gradients are synchronized, how the model is split) live in parallel/; this
file only asks for a micro-batch's sync context.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from shoal.comm.watchdog import CollectiveLog
from shoal.config import Config
from shoal.data.loader import Prefetcher
from shoal.data.sampler import GlobalBatchSampler
from shoal.metrics.memory import STATE_KINDS, model_state_bytes, peak_memory_bytes
from shoal.metrics.sinks import MetricsSinks
from shoal.metrics.timers import StepTimer
from shoal.models.registry import Batch, ModelBundle
from shoal.parallel.data import grad_sync
from shoal.parallel.zero import local_optimizer
from shoal.plan import RunPlan
from shoal.train.bad_steps import BadStepPolicy
from shoal.train.precision import Precision


@dataclass
class TrainState:
    cfg: Config
    plan: RunPlan
    bundle: ModelBundle
    model: torch.nn.Module  # what forward is called on (DDP-wrapped when dp > 1)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    precision: Precision
    sampler: GlobalBatchSampler
    source: object
    device: torch.device
    dp_rank: int
    dp_group: object = None  # None: the default group
    counts_loss: bool = True  # this rank's loss enters the global loss (not a tensor-parallel peer's copy)
    pipeline: object = None  # parallel.pipeline.Pipeline when pp > 1
    bad_steps: BadStepPolicy = None
    rollback: Callable[[int], None] | None = None  # reload the newest checkpoint, skipping a data step
    log: CollectiveLog = field(default_factory=CollectiveLog)  # collectives entered, for hang reports
    stop_requested: Callable[[], int] = lambda: 0  # nonzero when this process was asked to stop
    before_update: Callable[[], None] = lambda: None  # runs before the optimizer changes the weights
    memory_due: bool = False  # measure the model state's bytes in this step (a logged step)
    memory_per_rank: list[dict] = field(default_factory=list)  # the last measurement, rank by rank
    history: list[dict] = field(default_factory=list)  # per-step metrics, kept on every rank
    # called after every step with (metrics, is_last_step): checkpoints, heartbeats (see train/run.py)
    hooks: list[Callable[[dict, bool], None]] = field(default_factory=list)


def to_device(batch: Batch, device: torch.device) -> Batch:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


class _Pending:
    """An async collective whose completion is also written to the collective log."""

    def __init__(self, work, rec: dict):
        self.work, self.rec = work, rec

    def wait(self) -> None:
        self.work.wait()
        CollectiveLog.done(self.rec)


def all_reduce(t: torch.Tensor, state: TrainState, op=dist.ReduceOp.SUM, async_op: bool = False,
               world: bool = False):
    """All-reduce over the dp group (or every rank), recorded for hang diagnosis (comm/watchdog.py)."""
    group = None if world else state.dp_group
    pending = _Pending(dist.all_reduce(t, op=op, group=group, async_op=True),
                       state.log.enter("all_reduce", "world" if world else "dp", [t]))
    if async_op:
        return pending
    pending.wait()
    return t


def plain(t: torch.Tensor) -> torch.Tensor:
    """A loss computed on DTensors (a vocab-parallel output) as an ordinary, replicated tensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def clip_grad_norm(params: list[tuple[torch.Tensor, bool]], max_norm: float, pp_group=None) -> float:
    """torch's clip_grad_norm_ over a model whose gradients are plain tensors and DTensors on
    different meshes (tensor-parallel layers on dp x tp, replicated ones on dp only, ...): tensors of
    different kinds cannot share one foreach kernel, so each kind's norm is taken apart and the total
    combined; with pipeline stages, summed over the stages. `params`: (parameter, counted in the norm)
    (a weight tied across stages is counted on one of them). Returns the total norm."""
    groups: dict[object, list[tuple[torch.Tensor, bool]]] = {}
    for p, counted in params:
        groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append((p, counted))
    squares = torch.zeros((), dtype=torch.float64)
    for group in groups.values():
        grads = [p.grad for p, counted in group if counted]
        if grads:
            squares = squares + plain(torch.nn.utils.get_total_norm(grads)).double().cpu() ** 2
    if pp_group is not None:  # on the training device: NCCL reduces no CPU tensors
        device = params[0][0].grad.device if params else torch.device("cpu")
        squares = squares.to(device)
        dist.all_reduce(squares, group=pp_group)
        squares = squares.cpu()
    total = squares.sqrt()
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_([p for p, _ in group], max_norm, total.float().to(group[0][0].grad.device))
    return total.item()


def norm_params(state: TrainState) -> list[tuple[torch.Tensor, bool]]:
    """Parameters with gradients, and whether each counts in the gradient norm: a weight tied across
    pipeline stages counts on the first stage only."""
    skip = set()
    if state.pipeline is not None and state.pipeline.tie_group is not None and not state.pipeline.first:
        skip = {id(p) for p in state.pipeline.tied}
    return [(p, id(p) not in skip) for p in state.model.parameters() if p.grad is not None]


def sync_tied(state: TrainState) -> None:
    """Add up the gradients of weights tied across the first and last stage, so both copies take the
    same step."""
    p = state.pipeline
    if p.tie_group is None or not (p.first or p.last):
        return
    for param in p.tied:
        if isinstance(param.grad, DTensor) and param.grad.placements != param.placements:
            # a vocab-parallel embedding's gradient comes back replicated: lay it out like the weight
            # (a local slice), so that both stages add tensors of the same shape
            param.grad = param.grad.redistribute(placements=param.placements)
        grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        with state.log.record("all_reduce", "tied weights, first and last stage", [grad]):
            dist.all_reduce(grad, group=p.tie_group)


def train_step(state: TrainState, micro_batches: list[Batch], timer: StepTimer) -> dict:
    """One optimizer step over this rank's micro-batches. Returns the global loss, gradient norm and
    item count. See [Note: loss contract] in models/registry.py for the scaling."""
    bundle, model, precision = state.bundle, state.model, state.precision
    batches = [to_device(mb, state.device) for mb in micro_batches]
    # items (tokens or samples) in the whole global batch: summed over ranks while the first forward runs
    n_items = torch.stack([bundle.count_fn(b) for b in batches]).sum().double().to(state.device)
    pending = all_reduce(n_items, state, async_op=True)
    loss_sum = torch.zeros((), device=state.device, dtype=torch.float64)
    if state.pipeline is not None:  # the micro-batches flow through the pipeline's schedule instead
        pending.wait()
        whole = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
        scale = state.plan.dims.dp / n_items.float()
        with bundle.loss_context(), precision.autocast():
            loss_sum += plain(state.pipeline.run(whole, scale)).double()
        sync_tied(state)
        batches = []
    for i, batch in enumerate(batches):
        with grad_sync(model, sync=i == len(batches) - 1), bundle.loss_context():
            with precision.autocast():
                loss = plain(bundle.loss_fn(model, batch))
            if i == 0:
                pending.wait()
                # DDP averages over dp: multiply that back, then divide by the global item count
                scale = state.plan.dims.dp / n_items.float()
            precision.backward(loss * scale)
        loss_sum += loss.detach().double()
    timer.mark("forward_backward_s")

    # the loss, and whether any rank was asked to stop (signals.py): one all-reduce over all ranks,
    # overlapping the clip. Tensor-parallel peers hold the same loss: only the first one contributes it.
    mine = loss_sum if state.counts_loss else torch.zeros_like(loss_sum)
    flags = torch.stack([mine, torch.tensor(float(state.stop_requested() > 0), dtype=torch.float64,
                                            device=state.device)])
    pending = all_reduce(flags, state, async_op=True, world=True)
    precision.unscale(state.optimizer)
    grad_norm = clip_grad_norm(norm_params(state), state.cfg.train.grad_clip or math.inf,
                               state.pipeline and state.plan.dims.mesh["pp"].get_group())
    pending.wait()
    loss = (flags[0] / n_items).item()
    bad = state.bad_steps.is_bad(loss, grad_norm)  # the same verdict on every rank: both values are global
    if bad:
        precision.skip(state.optimizer)
    else:
        state.before_update()  # e.g. an async checkpoint still copying the weights
        precision.step(state.optimizer)
        state.scheduler.step()
    held = model_state_bytes(state.bundle.model, local_optimizer(state.optimizer)) if state.memory_due else None
    state.optimizer.zero_grad(set_to_none=True)
    timer.mark("optimizer_s")
    return {"loss": loss, "grad_norm": grad_norm, "items": int(n_items.item()), "bad": bad,
            "stop": flags[1].item() > 0, "held": held}


@torch.no_grad()
def evaluate(state: TrainState) -> dict[str, float]:
    """Metrics over the first `val_batches` global batches of the held-out set, split over dp ranks."""
    cfg, source = state.cfg, state.source
    model = state.model.module if isinstance(state.model, torch.nn.parallel.DistributedDataParallel) else state.model
    # a sharded model gathers parameters in every forward: every rank must run as many as the others
    sharded = isinstance(model, FSDPModule)
    was_training = model.training
    model.train(False)  # evaluation mode: no dropout, BatchNorm uses running statistics
    totals: dict[str, list[torch.Tensor]] = {}
    B, micro, dp = cfg.train.global_batch_size, cfg.train.micro_batch_size, state.plan.dims.dp
    for b in range(cfg.train.val_batches):
        if b * B >= source.num_val:
            break
        idx = torch.arange(b * B, min((b + 1) * B, source.num_val))
        if state.pipeline is not None:
            add_to(totals, pipeline_eval(state, idx.tensor_split(dp)[state.dp_rank]))
            continue
        chunks = [c for c in idx.tensor_split(dp)[state.dp_rank].split(micro) if len(c)]
        n_forwards = math.ceil(math.ceil(len(idx) / dp) / micro)  # the most any rank runs
        if sharded and len(chunks) < n_forwards:
            pad = idx[:1]
            with state.precision.autocast(), state.bundle.loss_context():
                for _ in range(n_forwards - len(chunks)):  # results unused: only the collectives count
                    state.bundle.eval_fn(model, to_device(source.val_batch(pad), state.device))
        for chunk in chunks:
            with state.precision.autocast(), state.bundle.loss_context():
                out = state.bundle.eval_fn(model, to_device(source.val_batch(chunk), state.device))
            add_to(totals, out)
    model.train(was_training)
    # no backward follows to free what the forwards gathered (ZeRO 2 keeps it after forward); under pp
    # the sharded modules are the pipeline's stages
    for root in state.pipeline.modules if state.pipeline is not None else [model]:
        for m in root.modules():
            if isinstance(m, FSDPModule):
                m.reshard()
    keys = sorted(totals)
    # over every rank, each total counted once: tensor-parallel peers and earlier pipeline stages add 0
    flat = torch.stack([v for k in keys for v in totals[k]])
    flat = all_reduce((flat if state.counts_loss else torch.zeros_like(flat)).to(state.device), state, world=True).cpu()
    return {f"val_{k}": (flat[2 * i] / flat[2 * i + 1]).item() for i, k in enumerate(keys)}


def gather_memory(state: TrainState, held: dict[str, int]) -> list[dict]:
    """Every rank's model-state bytes and peak memory (one small all-gather over the world)."""
    mine = torch.tensor([float(held[k]) for k in STATE_KINDS] + [float(peak_memory_bytes(state.device))],
                        dtype=torch.float64, device=state.device)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    with state.log.record("all_gather", "world, memory accounting"):
        dist.all_gather(out, mine)
    return [{"rank": r, **{k: int(v) for k, v in zip((*STATE_KINDS, "peak"), t.tolist(), strict=True)}}
            for r, t in enumerate(out)]


def add_to(totals: dict[str, list[torch.Tensor]], out: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    for k, (s, n) in out.items():
        acc = totals.setdefault(k, [torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)])
        acc[0] += plain(s).double().cpu()
        acc[1] += plain(n).double().cpu()


def pipeline_eval(state: TrainState, mine: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Validation loss of this rank's share of a validation batch, through the pipeline (forward only).
    The schedule takes whole per-rank batches: a short share is padded with samples whose targets
    are -1, which the loss and the item count leave out."""
    batch = state.source.val_batch(mine if len(mine) else torch.zeros(1, dtype=torch.long))
    if not len(mine):
        batch["target"] = torch.full_like(batch["target"], -1)
    short = state.plan.per_rank_batch - len(batch["target"])
    if short:
        pad = {k: v[:1].expand(short, *v.shape[1:]) for k, v in batch.items()}
        pad["target"] = torch.full_like(pad["target"], -1)
        batch = {k: torch.cat([batch[k], pad[k]]) for k in batch}
    batch = to_device(batch, state.device)
    with state.precision.autocast(), state.bundle.loss_context():
        loss = state.pipeline.run(batch, None)
    return {"loss": (loss, state.bundle.count_fn(batch))}


def train_loop(state: TrainState, make_loader: Callable[[int], Prefetcher], sinks: MetricsSinks) -> bool:
    """Train until train.steps; returns False when the ranks agreed to stop early (a signal)."""
    cfg = state.cfg
    items_name = state.bundle.items_name
    timer = StepTimer(state.device)
    loader = make_loader(state.sampler.step)
    try:
        while state.sampler.step < cfg.train.steps:
            step = state.sampler.step
            timer.start()
            micro_batches = loader.next()
            timer.mark("data_wait_s")
            lr = state.optimizer.param_groups[0]["lr"]
            state.memory_due = (step + 1) % cfg.metrics.log_interval == 0 or step + 1 == cfg.train.steps
            out = train_step(state, micro_batches, timer)
            if out["bad"] and state.bad_steps.record_bad(step + 1, out["loss"], out["grad_norm"]) == "rollback":
                loader.close()
                state.rollback(state.sampler.data_step(step))  # back to the checkpoint, minus this batch
                sinks.print(f"step {step + 1}: loss {out['loss']}; rolled back to step {state.sampler.step}")
                loader = make_loader(state.sampler.step)
                continue
            if not out["bad"]:
                state.bad_steps.record_good()
            state.sampler.step = step + 1
            after_step(state, step + 1, lr, out, timer, sinks, items_name)
            if out["stop"]:
                return False
    finally:
        loader.close()
    return True


def after_step(state: TrainState, done: int, lr: float, out: dict, timer: StepTimer, sinks: MetricsSinks,
               items_name: str) -> None:
    """Metrics, validation and hooks of step `done` (1-based: steps completed)."""
    cfg = state.cfg
    m = {"step": done, "time": time.time(), "loss": out["loss"], "lr": lr, "grad_norm": out["grad_norm"],
         f"{items_name}_per_s": out["items"] / timer.total, "step_time_s": timer.total, **timer.phases}
    if out["bad"]:
        m["skipped"] = True
        sinks.print(f"step {done}: loss {out['loss']}, gradient norm {out['grad_norm']}: update skipped")
    last = done == cfg.train.steps
    if out["held"] is not None:
        state.memory_per_rank = gather_memory(state, out["held"])
        m["peak_memory_bytes"] = max(r["peak"] for r in state.memory_per_rank)
        # the largest rank's: the one that runs out first
        m.update({f"{k}_bytes": max(r[k] for r in state.memory_per_rank) for k in STATE_KINDS})
    if last or (cfg.train.val_interval and done % cfg.train.val_interval == 0):
        m.update(evaluate(state))
        sinks.print(f"step {done}: " + ", ".join(f"{k} {v:.4f}" for k, v in m.items() if k.startswith("val_")))
    state.history.append(m)
    sinks.step(m)
    if "peak_memory_bytes" in m or "skipped" in m or any(k.startswith("val_") for k in m):
        sinks.log(m)
    for hook in state.hooks:
        hook(m, last)
