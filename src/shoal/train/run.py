"""Assemble one rank's training run from a validated config, run it, and write its results.

Order: data source -> model (same seed on every rank) -> parallelize -> optimizer, schedule,
precision -> resume from a checkpoint -> sampler and prefetcher -> loop (with checkpoint and
heartbeat hooks) -> final weights and summary.json (rank 0).
"""

from __future__ import annotations

import dataclasses
import json
import signal
import statistics
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import shoal
from shoal import signals
from shoal.checkpoint.export import export_weights
from shoal.checkpoint.manager import CheckpointManager, load_checkpoint
from shoal.checkpoint.manifest import list_checkpoints, step_dir_name
from shoal.checkpoint.resume import check_compatible, find_resume_point, restore_rng_for
from shoal.checkpoint.state import CHECKPOINT_FORMAT, TRAIN_STATE, read_json, write_json
from shoal.comm.watchdog import CollectiveLog
from shoal.config import Config
from shoal.data.loader import Prefetcher
from shoal.data.sampler import GlobalBatchSampler
from shoal.data.sources import build_source
from shoal.dist import DistEnv
from shoal.errors import TrainingError, UserError
from shoal.metrics.sinks import MetricsSinks
from shoal.models.meta import has_transient_buffers, materialize, on_meta
from shoal.models.registry import build_model, count_parameters
from shoal.parallel.apply import check_parallelizable, parallelize
from shoal.plan import RunPlan, make_plan
from shoal.train.bad_steps import BadStepPolicy
from shoal.train.loop import TrainState, train_loop
from shoal.train.optim import build_optimizer, build_scheduler
from shoal.train.precision import Precision

PROGRESS = "progress.json"  # rank 0's heartbeat: the last completed step and when


def build_data_and_model(cfg: Config, plan: RunPlan, device: str = "cpu", init: bool = True):
    """The data source and the model bundle; also used before launch (on the meta device) to check
    that they fit together without allocating the weights. `init=False`: the weights are allocated
    but not computed, for a resume that is about to load them."""
    source = build_source(cfg.data, getattr(cfg.model, "seq_len", None))
    if source.num_val < plan.dims.dp:
        raise UserError(f"the validation split has {source.num_val} samples, fewer than dp ({plan.dims.dp}); "
                        f"raise data.val_fraction")
    if device == "meta" or not init:
        with on_meta():
            bundle = build_model(cfg.model, source.spec)
        if device != "meta":
            if has_transient_buffers(bundle.model):  # state a checkpoint does not hold: build it normally
                return build_data_and_model(cfg, plan, device)
            materialize(bundle.model, device)
    else:
        with torch.device(device):
            bundle = build_model(cfg.model, source.spec)
    check_parallelizable(bundle, cfg)
    return source, bundle


def run_training(cfg: Config, run_dir: Path, env: DistEnv, resume: str = "auto",
                 log: CollectiveLog | None = None) -> dict:
    """Train on this rank; returns the run summary (identical on every rank)."""
    t_start = time.perf_counter()
    plan = make_plan(cfg, env.world_size)
    dims = plan.dims
    resume_path = agree_resume_point(run_dir, env, resume)
    torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
    source, bundle = build_data_and_model(cfg, plan, init=resume_path is None)
    log = log or CollectiveLog()
    # one pipeline micro-batch, for timing the layers (parallel.pp_balance = "time")
    sample = source.train_batch(torch.arange(plan.per_rank_batch // plan.pp_microbatches)) if dims.pp > 1 else None
    model, pipeline = parallelize(bundle, dims, cfg, env.device, env.rank, plan, log, sample)
    torch.manual_seed(cfg.train.seed + 1 + env.rank)  # dropout etc. differ per rank, reproducibly
    optimizer = build_optimizer(bundle.model, cfg.train,
                                shard_group=dims.mesh["dp"].get_group() if cfg.parallel.zero == 1 else None)
    dp_rank = dims.coords(env.rank)["dp"]
    dp_group = dims.mesh["dp"].get_group() if dims.world_size > dims.dp else None
    precision = Precision(cfg.precision.dtype, env.device)
    bad_steps = BadStepPolicy(cfg.train.on_bad_step, cfg.train.max_bad_steps, scaled=precision.scaler is not None)
    state = TrainState(cfg, plan, bundle, model, optimizer, build_scheduler(optimizer, cfg.train), precision,
                       GlobalBatchSampler(source.num_train, cfg.train.global_batch_size, cfg.train.seed),
                       source, env.device, dp_rank, dp_group,
                       counts_loss=dims.coords(env.rank)["tp"] == 0 and (pipeline is None or pipeline.last),
                       pipeline=pipeline, bad_steps=bad_steps, log=log)
    is_main = env.rank == 0
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(cfg.to_toml(), encoding="utf-8")
    recovery = resume_state(state, resume_path, run_dir, env)
    ckpt = CheckpointManager(run_dir, cfg.checkpoint, env.rank, env.world_size, log)
    state.hooks.append(lambda m, last: save_if_due(ckpt, state, m["step"], last))
    state.rollback = lambda data_step: rollback(state, ckpt, run_dir, env, data_step)
    state.before_update = ckpt.wait_staged
    if is_main:
        heartbeat = run_dir / PROGRESS
        state.hooks.append(lambda m, last: write_json(heartbeat, {"step": m["step"], "time": m["time"]}))

    def make(step: int):
        return [source.train_batch(i) for i in
                state.sampler.local_micro_batches(step, dp_rank, dims.dp, cfg.train.micro_batch_size)]

    sinks = MetricsSinks(run_dir if is_main else None, cfg.train.steps, state.sampler.step,
                         bundle.items_name, cfg.metrics.tensorboard, cfg.metrics.progress)
    n_params = count_parameters(bundle.model)
    items_per_sample = getattr(cfg.model, "seq_len", 1) if bundle.items_name == "tokens" else 1
    shape = plan.describe(cfg, bundle.items_name, items_per_sample)
    sinks.print(f"[bold]shoal[/] {cfg.model.name}: {n_params:,} parameters; {shape}")
    if pipeline is not None:
        sinks.print(pipeline.layout.describe(dims.pp, plan.pp_microbatches, cfg.parallel.pp_schedule))
    sinks.print(f"data {cfg.data.source}: {source.num_train:,} training / {source.num_val:,} validation samples; "
                f"run dir {run_dir}")
    if recovery and recovery["checkpoint"]:
        sinks.print(f"resumed from {recovery['checkpoint']} (step {recovery['resumed_from_step']})")
    elif recovery:
        sinks.print(f"restart {recovery['restart']}: no checkpoint yet, starting from step 0")
    state.stop_requested = signals.requested
    try:
        finished = train_loop(state, lambda start: Prefetcher(make, start, cfg.data.prefetch), sinks)
        if not finished:  # asked to stop: keep the work done so far, then leave
            step = state.sampler.step
            # decided from what every rank knows alike (not the filesystem, which rank 0 may still be sealing)
            if not ckpt.stats or ckpt.stats[-1]["step"] != step:
                save_if_due(ckpt, state, step, last=True)
            ckpt.close()
            saved = run_dir / "checkpoints" / step_dir_name(step)
            signum = signals.requested() or signal.SIGTERM  # another rank got the signal: say it was SIGTERM
            raise signals.Interrupted(signum, step, str(saved) if saved.exists() else None)
        ckpt.close()  # an async save in flight is part of the run
    finally:
        sinks.close()
    summary = summarize(state, n_params, time.perf_counter() - t_start, env, recovery, run_dir)
    summary["checkpoints"] = ckpt.stats
    if cfg.checkpoint.final_weights and pipeline is not None:
        if is_main:  # each rank holds some stages: the final checkpoint holds them all (sealed by now)
            export_weights(run_dir, run_dir / "model.safetensors", step=state.sampler.step)
    elif cfg.checkpoint.final_weights:
        save_final_weights(cfg, source, bundle.model, run_dir / "model.safetensors", is_main)
    if is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return summary


def agree_resume_point(run_dir: Path, env: DistEnv, resume: str) -> Path | None:
    """Collective: the checkpoint every rank resumes from (rank 0 picks it), or None."""
    if env.rank == 0:
        path = find_resume_point(run_dir, resume)
        env.store.set("resume_from", str(path) if path else "")
    value = env.store.get("resume_from").decode()
    return Path(value) if value else None


def save_final_weights(cfg: Config, source, model: torch.nn.Module, path: Path, is_main: bool) -> None:
    """Collective when the parameters are sharded: rank 0 writes the whole model, as the single-process
    model would save it (safetensors, tied weights once)."""
    from safetensors.torch import save_model  # handles tied weights (GPT's embedding/head)

    if isinstance(model, FSDPModule) or any(isinstance(p, DTensor) for p in model.parameters()):
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not is_main:
            return
        with on_meta():
            plain = build_model(cfg.model, source.spec).model
        materialize(plain, "cpu").load_state_dict(full)
        model = plain
    if is_main:
        save_model(model, str(path))


def resume_state(state: TrainState, path: Path | None, run_dir: Path, env: DistEnv) -> dict | None:
    """Collective: restore the checkpoint at `path`, if any. Returns what the summary reports about the
    recovery (None on a fresh start)."""
    progress = read_json(run_dir / PROGRESS, {})
    failure = {"restart": env.restart_count, "failed_after_step": progress.get("step"),
               "failed_at": progress.get("time")}
    if path is None:  # a fresh start; after an elastic restart with no checkpoint yet, all steps are redone
        return ({"checkpoint": None, "resumed_from_step": 0, "restore_s": 0.0, "restore_started_at": time.time(),
                 **failure} if env.restart_count else None)
    t0, started = time.perf_counter(), time.time()
    train_state = check_compatible(state.cfg, path)
    same_rng = restore_from(state, path, train_state, env)
    state.bad_steps.load_state_dict(train_state["bad_steps"])
    return {"checkpoint": str(path), "resumed_from_step": state.sampler.step, "rng_restored": same_rng,
            "restore_s": time.perf_counter() - t0, "restore_started_at": started, **failure}


def restore_from(state: TrainState, path: Path, train_state: dict, env: DistEnv) -> bool:
    """Collective: model, optimizer, data position, schedule, scaler and RNG as saved at `path`."""
    load_checkpoint(path, state.bundle.model, state.optimizer)
    try:
        state.sampler.load_state_dict(train_state["sampler"])
    except ValueError as e:
        raise UserError(f"cannot resume from {path}: {e}") from None
    state.scheduler.load_state_dict(train_state["scheduler"])
    # the learning rate the schedule is at (a sharded optimizer's outer groups are not in its saved state)
    for group, lr in zip(state.optimizer.param_groups, state.scheduler.get_last_lr(), strict=True):
        group["lr"] = lr
    if state.precision.scaler is not None and train_state.get("scaler"):
        state.precision.scaler.load_state_dict(train_state["scaler"])
    return restore_rng_for(path, env.rank, env.world_size, state.cfg.train.seed, state.sampler.step)


def rollback(state: TrainState, ckpt: CheckpointManager, run_dir: Path, env: DistEnv, bad_data_step: int) -> None:
    """Collective: back to the newest checkpoint, never to train on data step `bad_data_step` again."""
    ckpt.wait()
    key = f"rollback_{state.bad_steps.rollbacks}"
    if env.rank == 0:
        valid = [c for c in list_checkpoints(run_dir / "checkpoints") if c.valid]
        env.store.set(key, str(valid[-1].path) if valid else "")
    value = env.store.get(key).decode()
    if not value:
        raise TrainingError('train.on_bad_step = "rollback" found no checkpoint to go back to; save one earlier '
                            '(checkpoint.interval) or use "skip"')
    path = Path(value)
    restore_from(state, path, read_json(path / TRAIN_STATE), env)
    state.sampler.skip_data_step(bad_data_step)


def save_if_due(ckpt: CheckpointManager, state: TrainState, step: int, last: bool) -> None:
    if ckpt.due(step, last):
        ckpt.save(step, state.bundle.model, state.optimizer, {
            "format": CHECKPOINT_FORMAT, "step": step, "sampler": state.sampler.state_dict(),
            "scheduler": state.scheduler.state_dict(),
            "scaler": state.precision.scaler.state_dict() if state.precision.scaler else None,
            "bad_steps": state.bad_steps.state_dict(), "config": state.cfg.to_toml(),
            "data_spec": dataclasses.asdict(state.source.spec)})
    ckpt.poll()


def summarize(state: TrainState, n_params: int, total_s: float, env: DistEnv, recovery: dict | None,
              run_dir: Path) -> dict:
    h, items = state.history, state.bundle.items_name
    speeds = [m[f"{items}_per_s"] for m in h[1:]] or [m[f"{items}_per_s"] for m in h]  # step 1 warms up
    vals = [m for m in h if "val_loss" in m]
    dims = state.plan.dims
    recoveries = read_json(run_dir / "recoveries.json", [])
    if recovery and h:
        # time lost to the failure: from the last step completed before it to the first step after it
        recovery = {**recovery, "steps_redone": (recovery["failed_after_step"] or 0) - recovery["resumed_from_step"],
                    "seconds_lost": h[0]["time"] - recovery["failed_at"] if recovery["failed_at"] else None,
                    "breakdown_s": recovery_breakdown(recovery, h[0]["time"])}
        recoveries.append(recovery)
        if env.rank == 0:
            write_json(run_dir / "recoveries.json", recoveries)
    return {
        "model": state.cfg.model.name,
        "parameters": n_params,
        "world_size": dims.world_size, "dp": dims.dp, "tp": dims.tp, "pp": dims.pp,
        "steps": h[-1]["step"] if h else state.sampler.step,
        "final_loss": h[-1]["loss"] if h else None,
        "best_loss": min(m["loss"] for m in h) if h else None,
        **({k: v for k, v in vals[-1].items() if k.startswith("val_")} if vals else {}),
        "best_val_loss": min(m["val_loss"] for m in vals) if vals else None,
        f"mean_{items}_per_s": statistics.fmean(speeds) if speeds else None,
        "median_step_time_s": statistics.median(m["step_time_s"] for m in h) if h else None,
        "peak_memory_bytes": max((m.get("peak_memory_bytes", 0) for m in h), default=0),
        "total_time_s": total_s,
        "bad_steps": state.bad_steps.total,
        "rollbacks": state.bad_steps.rollbacks,
        "restarts": env.restart_count,
        "recoveries": recoveries,
        "memory_per_rank": state.memory_per_rank,
    }


def recovery_breakdown(recovery: dict, first_step_at: float) -> dict:
    """Where a recovery's seconds went: until this process started (failure detection, stopping the
    old workers, spawning), its start-up (imports, rendezvous, model), the restore, the first step."""
    restored_at = recovery["restore_started_at"] + recovery["restore_s"]
    return {"respawn": shoal.STARTED_AT - recovery["failed_at"] if recovery["failed_at"] else None,
            "startup": recovery["restore_started_at"] - shoal.STARTED_AT,
            "restore": recovery["restore_s"],
            "first_step": first_step_at - restored_at}
