"""The training loop: batch -> forward/backward -> sync -> clip -> step -> metrics.

How the model is laid out and how gradients are synchronised is the Parallelized object's business
(parallel/); the loop reads the same for every layout.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shoal.comm.collectives import Comm
from shoal.comm.phase import Phase
from shoal.config import MetricsConfig, TrainConfig
from shoal.data.loader import Prefetcher
from shoal.data.sampler import GlobalBatchSampler
from shoal.metrics.memory import STATE_KINDS, model_state_bytes, peak_memory_bytes
from shoal.metrics.profile import Profiler
from shoal.metrics.sinks import MetricsSinks
from shoal.metrics.timers import StepTimer
from shoal.metrics.trace import StepTrace
from shoal.models.spec import Batch
from shoal.parallel.balance import ThroughputBalance
from shoal.parallel.parallelized import Parallelized
from shoal.parallel.precision import Precision
from shoal.parallel.zero import local_optimizer
from shoal.training.bad_steps import BadStepPolicy
from shoal.training.evaluate import evaluate
from shoal.training.flags import StepFlags
from shoal.training.optim import Schedule


@dataclass
class Trainer:
    """What the loop trains with (assembled by train/run.py)."""

    train: TrainConfig
    metrics: MetricsConfig
    par: Parallelized
    optimizer: torch.optim.Optimizer
    schedule: Schedule
    precision: Precision
    sampler: GlobalBatchSampler
    source: object  # data/sources.py: train_batch, val_batch, num_val
    comm: Comm
    bad_steps: BadStepPolicy
    count_fn: Callable[[Batch], torch.Tensor]
    items_name: str
    device: torch.device
    phase: Phase = field(default_factory=Phase)
    balance: ThroughputBalance | None = None  # balance.mode = "throughput": the batch split over dp
    profile: Profiler | None = None  # metrics.profile: the step profile (metrics/profile.py)
    trace: StepTrace | None = None  # metrics.trace_steps


@dataclass
class Hooks:
    """What the run around the loop adds to it (train/run.py): checkpoints, signals, heartbeats."""

    stop_requested: Callable[[], int] = lambda: 0  # nonzero when this process was asked to stop
    save_wanted: Callable[[], bool] = lambda: False  # this rank's clock says a checkpoint is due
    before_update: Callable[[], None] = lambda: None  # runs before the optimizer changes the weights
    rollback: Callable[[int], None] | None = None  # reload the newest checkpoint, skipping a data step
    # after every step, with (metrics, is_last_step, checkpoint agreed due by time)
    after_step: list[Callable[[dict, bool, bool], None]] = field(default_factory=list)


@dataclass
class Record:
    """What the loop leaves behind, the same on every rank."""

    history: list[dict] = field(default_factory=list)  # per-step metrics
    memory_per_rank: list[dict] = field(default_factory=list)  # the last measurement, rank by rank
    initial_val: dict = field(default_factory=dict)  # train.eval_on_start: validation before step 1


def to_device(batch: Batch, device: torch.device) -> Batch:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def train_step(t: Trainer, hooks: Hooks, micro_batches: list[Batch], timer: StepTimer, measure_memory: bool) -> dict:
    """One optimizer step over this rank's micro-batches. Returns the global loss, gradient norm, item
    count and the ranks' shared decisions. See [Note: loss contract] in models/spec.py for the scaling."""
    par = t.par
    sent = t.comm.sync_bytes
    batches = [to_device(mb, t.device) for mb in micro_batches]
    # items (tokens or samples) in the whole global batch: summed over dp while the first forward runs
    n_items = torch.stack([t.count_fn(b) for b in batches]).sum().double().to(t.device)
    counted = t.comm.all_reduce(n_items, group=par.dp_group, label="dp", async_op=True)
    scale = []

    def grad_scale() -> torch.Tensor:  # gradient averaging divides by dp: multiply it back, divide by the count
        if not scale:
            scale.append(par.dp / counted.wait().float())
        return scale[0]

    t.phase.outside("forward/backward")  # the model's layers refine it (comm/phase.py)
    if t.balance:
        t.balance.start()
    loss_sum = par.forward_backward(batches, grad_scale, t.precision)
    if t.balance:
        t.balance.measured(t.sampler.step)
    par.after_backward()
    timer.mark("forward_backward_s")

    t.phase.outside("optimizer step")
    t.precision.unscale(t.optimizer)
    flags = StepFlags(t.comm, t.device)

    def agree(norm: torch.Tensor) -> None:  # one all-reduce for every shared decision, overlapping the clip
        flags.start(loss_sum if par.owns_loss else torch.zeros_like(loss_sum), stop=hooks.stop_requested() > 0,
                    bad_norm=not math.isfinite(norm.item()), save=hooks.save_wanted())

    norm = par.clip_grad_norm(t.train.grad_clip or math.inf, before_clip=agree)
    agreed = flags.result()
    loss = agreed.loss_sum / n_items.item()
    # the same verdict on every rank: both inputs are global
    bad = t.bad_steps.is_bad(loss, math.nan if agreed.bad_norm else norm.item())
    if bad:
        t.precision.skip(t.optimizer)
    else:
        hooks.before_update()  # e.g. an async checkpoint still copying the weights
        t.precision.step(t.optimizer)
        t.schedule.step()
        par.after_step(t.sampler.step + 1)
    held = model_state_bytes(par.model, local_optimizer(t.optimizer)) if measure_memory else None
    t.optimizer.zero_grad(set_to_none=True)
    timer.mark("optimizer_s")
    return {"loss": loss, "grad_norm": norm.item(), "items": int(n_items.item()), "bad": bad, "stop": agreed.stop,
            "save": agreed.save, "held": held, "comm_bytes": t.comm.sync_bytes - sent}


def gather_memory(t: Trainer, held: dict[str, int], compute_s: float | None = None) -> list[dict]:
    """Every rank's model-state bytes and peak memory (one small all-gather over the world), and with
    `compute_s` every rank's mean compute per step since the last logged step (the step profile)."""
    extra = [compute_s] if compute_s is not None else []
    mine = torch.tensor([float(held[k]) for k in STATE_KINDS] + [float(peak_memory_bytes(t.device))] + extra,
                        dtype=torch.float64, device=t.device)
    out = t.comm.all_gather(mine, label="world, memory accounting")
    kinds = (*STATE_KINDS, "peak")
    rows = [{"rank": r, **{k: int(v) for k, v in zip(kinds, x.tolist()[:len(kinds)], strict=True)}}
            for r, x in enumerate(out)]
    if extra:
        for row, x in zip(rows, out, strict=True):
            row["compute_s"] = x[-1].item()
    return rows


def train_loop(t: Trainer, hooks: Hooks, make_loader: Callable[[int], Prefetcher], sinks: MetricsSinks,
               record: Record) -> bool:
    """Train until train.steps; returns False when the ranks agreed to stop early (a signal)."""
    # with the profile on, the timer also reads the collective log's waits at each mark
    timer = StepTimer(t.device, t.comm.log if t.profile else None)
    if t.train.eval_on_start and t.sampler.step == 0:
        record.initial_val = validate(t, sinks, 0)
    loader = make_loader(t.sampler.step)
    try:
        while t.sampler.step < t.train.steps:
            step = t.sampler.step
            t.phase.begin_step(step + 1)
            if t.trace:
                t.trace.before(step + 1)
            timer.start()
            micro_batches = loader.next()
            timer.mark("data_wait_s")
            lr = t.optimizer.param_groups[0]["lr"]
            logged = (step + 1) % t.metrics.log_interval == 0 or step + 1 == t.train.steps
            out = train_step(t, hooks, micro_batches, timer, measure_memory=logged)
            if out["bad"] and t.bad_steps.record_bad(step + 1, out["loss"], out["grad_norm"]) == "rollback":
                loader.close()
                hooks.rollback(t.sampler.data_step(step))  # back to the checkpoint, minus this batch
                sinks.print(f"step {step + 1}: loss {out['loss']}; rolled back to step {t.sampler.step}")
                loader = make_loader(t.sampler.step)
                continue
            if not out["bad"]:
                t.bad_steps.record_good()
            t.sampler.step = step + 1
            if t.trace:
                t.trace.after(step + 1)
            after_step(t, hooks, step + 1, lr, out, timer, sinks, record)
            if out["stop"]:
                return False
    finally:
        loader.close()
        if t.trace:
            t.trace.close()
    return True


def after_step(t: Trainer, hooks: Hooks, done: int, lr: float, out: dict, timer: StepTimer, sinks: MetricsSinks,
               record: Record) -> None:
    """Metrics, validation and hooks of step `done` (1-based: steps completed)."""
    m = step_metrics(t, done, lr, out, timer)
    if t.balance:  # before the checkpoint hooks: a split agreed now is saved with this step
        m.update(t.balance.after_step(done))
    if out["bad"]:
        m["skipped"] = True
        sinks.print(f"step {done}: loss {out['loss']}, gradient norm {out['grad_norm']}: update skipped")
    last = done == t.train.steps
    if out["held"] is not None:
        record.memory_per_rank = gather_memory(t, out["held"], t.profile.take_compute() if t.profile else None)
        if t.profile:
            m.update(t.profile.stragglers([r.pop("compute_s") for r in record.memory_per_rank], done))
            if "straggler_rank" in m:
                sinks.print(f"rank {m['straggler_rank']}: compute {m['straggler_ratio']:.1f}x the median of the "
                            f"other ranks (steps {m['straggler_steps'][0]}-{done})")
        m["peak_memory_bytes"] = max(r["peak"] for r in record.memory_per_rank)
        # the largest rank's: the one that runs out first
        m.update({f"{k}_bytes": max(r[k] for r in record.memory_per_rank) for k in STATE_KINDS})
    if last or (t.train.val_interval and done % t.train.val_interval == 0):
        m.update(validate(t, sinks, done))
    record.history.append(m)
    sinks.step(m)
    if "peak_memory_bytes" in m or "skipped" in m or any(k.startswith("val_") for k in m):
        sinks.log(m)
    t.phase.outside("checkpoint and hooks")
    for hook in hooks.after_step:
        hook(m, last, out["save"])


def step_metrics(t: Trainer, done: int, lr: float, out: dict, timer: StepTimer) -> dict:
    """What metrics.jsonl records of step `done` (validation aside)."""
    return {"step": done, "time": time.time(), "loss": out["loss"], "lr": lr, "grad_norm": out["grad_norm"],
            f"{t.items_name}_per_s": out["items"] / timer.total, "step_time_s": timer.total, **timer.phases,
            # bytes this rank sent to keep the replicas in sync: this step, and since this attempt started
            "comm_bytes": out["comm_bytes"], "comm_bytes_total": t.comm.sync_bytes, **t.par.step_metrics(),
            **(t.profile.step(timer.phases, timer.exposed, timer.total, share_of_batch(t, done)) if t.profile else {})}


def share_of_batch(t: Trainer, done: int) -> float:
    """This rank's share of step `done`'s samples against an even share (1.0 without balance.mode)."""
    if not t.balance:
        return 1.0
    split = t.balance.split_for(done - 1)
    return split[t.balance.dp_rank] * len(split) / sum(split)


def validate(t: Trainer, sinks: MetricsSinks, done: int) -> dict:
    """The validation metrics after step `done`, printed."""
    t.phase.outside("validation")
    val = evaluate(t.par, t.source, t.train, t.precision, t.comm, t.device)
    sinks.print(f"step {done}: " + ", ".join(f"{k} {v:.4f}" for k, v in val.items()))
    return val
