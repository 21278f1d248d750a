"""Assemble one rank's training run from a checked config, run it, and write its results.

Order: model (same seed on every rank) -> parallelize -> optimizer, schedule, precision -> the run's
stateful parts registered for checkpoints -> resume -> sampler and prefetcher -> loop (with
checkpoint and heartbeat hooks) -> final weights and summary.json (rank 0).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from pathlib import Path

import torch

from shoal import ps_launch, signals
from shoal.checkpoint.export import export_weights
from shoal.checkpoint.manager import CheckpointManager, load_checkpoint
from shoal.checkpoint.manifest import step_dir_name
from shoal.checkpoint.resume import check_compatible, find_resume_point, newest_valid
from shoal.checkpoint.train_state import TrainState, read_train_state
from shoal.comm.collectives import Comm
from shoal.comm.model_waits import time_model_waits
from shoal.comm.phase import Phase
from shoal.config import Config
from shoal.data.loader import Prefetcher
from shoal.data.sampler import GlobalBatchSampler
from shoal.dist import DistEnv
from shoal.errors import TrainingError
from shoal.layout import Layout
from shoal.metrics.profile import bubble_fraction, start_profiler, summarize_profile
from shoal.metrics.sinks import MetricsSinks
from shoal.metrics.trace import StepTrace
from shoal.models.meta import on_meta
from shoal.models.registry import build_model
from shoal.models.spec import count_parameters
from shoal.parallel.apply import make_sync, parallelize
from shoal.parallel.balance import ComputeClock, ThroughputBalance
from shoal.parallel.precision import Precision
from shoal.parallel.zero import local_optimizer
from shoal.rundir import RunDir, read_json, write_json
from shoal.training.async_loop import async_train_loop, make_unit
from shoal.training.bad_steps import BadStepPolicy
from shoal.training.build import build_on, freeze, plain_model
from shoal.training.loop import Hooks, Record, Trainer, train_loop
from shoal.training.optim import Schedule, optimizer_groups
from shoal.training.summary import failure_info, fresh_start, summarize


def run_job(cfg: Config, layout: Layout, source, run_dir: Path, env: DistEnv, comm: Comm, resume: str = "auto",
            phase: Phase | None = None) -> dict:
    """This rank's part of the job: training, or, under sync.mode = "parameter-server", serving
    (the last layout.servers ranks). Training ranks then see a world of their own: their collectives
    run on a group without the servers. Returns the summary (servers: what they served)."""
    if not layout.servers:
        return run_training(cfg, layout, source, run_dir, env, comm, resume, phase)
    n = layout.dims.world_size
    role = ps_launch.role()
    if role:  # asynchronous, each role a job of its own (ps_launch.py): they meet in server 0's store
        store = ps_launch.open_store(role == "server" and env.rank == 0, cfg.parallel.timeout_s)
        if role == "server":
            from shoal.training.serve import serve

            return serve(cfg, source.spec, env.rank, list(range(n)), None, comm, run_dir, resume, store=store)
        slot = int(os.environ[ps_launch.SLOT])  # the slot is the worker's rank in the run
        return run_training(cfg, layout, source, run_dir, dataclasses.replace(env, rank=slot), comm, resume, phase,
                            ps_store=store, ps_reopen=lambda: ps_launch.open_store(False, cfg.parallel.timeout_s))
    workers = comm.new_group(list(range(n)))  # collective: every rank creates every group
    servers = comm.new_group(list(range(n, n + layout.servers)))
    # asynchronous: each worker's collectives (its step's flags, its validation) are its own
    alone = [comm.new_group([w]) for w in range(n)] if cfg.ps.mode == "async" else None
    if env.rank >= n:
        from shoal.training.serve import serve

        return serve(cfg, source.spec, env.rank - n, list(range(n)), servers, comm, run_dir, resume)
    world = comm.within(alone[env.rank], 1) if alone else comm.within(workers, n)
    return run_training(cfg, layout, source, run_dir, dataclasses.replace(env, world_size=world.world_size), world,
                        resume, phase)


def run_training(cfg: Config, layout: Layout, source, run_dir: Path, env: DistEnv, comm: Comm,
                 resume: str = "auto", phase: Phase | None = None, ps_store=None, ps_reopen=None) -> dict:
    """Train on this rank; returns the run summary (identical on every rank). `source`: the data
    source the preflight built."""
    t_start = time.perf_counter()
    run, dims, is_main = RunDir(run_dir), layout.dims, env.rank == 0
    phase = phase or Phase()
    resume_path = comm.agree("resume_from", lambda: str(find_resume_point(run.checkpoints, resume) or ""))
    # an asynchronous server's workers hold nothing worth saving: the servers resume and save alone
    # (train/serve_checkpoint.py), and a worker pulls what they hold
    async_worker = bool(layout.servers) and cfg.ps.mode == "async"
    resume_path = Path(resume_path) if resume_path and not async_worker else None
    torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
    bundle = build_on(cfg.model, source.spec, init=resume_path is None)
    freeze(bundle.model, cfg.train.freeze)
    n_params = count_parameters(bundle.model)
    # one pipeline micro-batch, for timing the layers (parallel.pp_balance = "time")
    sample = source.train_batch(torch.arange(layout.per_rank_batch // layout.pp_microbatches)) if dims.pp > 1 else None
    sync = None if layout.servers else make_sync(cfg.sync, cfg.comm, comm, last_step=cfg.train.steps)
    par = parallelize(bundle, layout, cfg.parallel, cfg.precision, cfg.train.compile, env.device, env.rank, comm,
                      sync=sync, sample=sample, ps=cfg.ps, ps_store=ps_store, ps_reopen=ps_reopen)
    if not cfg.train.compile:  # a compiled model runs its layers as one graph
        phase.track(par.model, bundle.block_types)
    torch.manual_seed(cfg.train.seed + 1 + env.rank)  # dropout etc. differ per rank, reproducibly
    optimizer_class, groups, hyper = optimizer_groups(par.model.parameters(), cfg.train)
    optimizer = par.build_optimizer(groups, optimizer_class, **hyper)
    schedule = Schedule(optimizer, cfg.train)
    precision = Precision(cfg.precision.dtype, env.device)
    bad_steps = BadStepPolicy(cfg.train.on_bad_step, cfg.train.max_bad_steps, scaled=precision.scaler is not None)
    sampler = GlobalBatchSampler(source.num_train, cfg.train.global_batch_size, cfg.train.seed)
    balance = None
    if cfg.balance.mode == "throughput":  # a new split waits until the batches prefetched before it are used
        balance = ThroughputBalance(cfg.train.global_batch_size, dims.dp, par.dp_rank, cfg.balance.interval,
                                    cfg.data.prefetch + 1, comm, par.dp_group, ComputeClock(par.model, env.device),
                                    env.device)
    # a parameter server's worker holds no optimizer state: the servers save it
    state = TrainState(par.model, None if layout.servers else local_optimizer(optimizer), {
        "sampler": sampler, "scheduler": schedule, "scaler": precision, "bad_steps": bad_steps, "sync": par.sync,
        **({"balance": balance} if balance else {})}, replicas_differ=layout.replicas > 1)
    trainer = Trainer(cfg.train, cfg.metrics, par, optimizer, schedule, precision, sampler, source, comm, bad_steps,
                      bundle.count_fn, bundle.items_name, env.device, phase, balance)
    profile_line = None
    if cfg.metrics.profile:
        trainer.profile, profile_line = profiler(cfg, layout, bundle, source, env, comm, sampler.step)
    if cfg.metrics.trace_steps:
        trainer.trace = StepTrace(cfg.metrics.trace_steps, run.traces, env.rank, env.device)
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        run.config.write_text(cfg.to_toml(), encoding="utf-8")
    recovery = resume_from(state, resume_path, cfg, run, env, comm)
    if sampler.step >= cfg.train.steps and run.summary.exists():  # finished before: leave its results as they are
        par.finish()
        return {**read_json(run.summary), "already_finished": True, "steps": sampler.step}
    # a parameter server writes its optimizer state inside the workers' save: those saves block
    ckpt_cfg = cfg.checkpoint.model_copy(update={"async_save": False, "enabled": cfg.checkpoint.enabled
                                                 and not async_worker}) if layout.servers else cfg.checkpoint
    ckpt = CheckpointManager(run.checkpoints, ckpt_cfg, comm, before_write=par.before_save)
    data_spec = dataclasses.asdict(source.spec)

    def save_if_due(m: dict, last: bool, by_time: bool) -> None:
        if ckpt.due(m["step"], last, by_time):
            ckpt.save(m["step"], state, state.capture(m["step"], cfg, data_spec))
        ckpt.poll()

    def rollback(bad_data_step: int) -> None:
        """Collective: back to the newest checkpoint, never to train on data step `bad_data_step` again."""
        ckpt.wait()
        path = comm.agree("rollback", lambda: str(newest_valid(run.checkpoints) or ""))
        if not path:
            raise TrainingError('train.on_bad_step = "rollback" found no checkpoint to go back to; save one '
                                'earlier (checkpoint.interval) or use "skip"')
        restore(state, Path(path), cfg, env, comm, keep=("bad_steps",))  # counting rollbacks goes on
        sampler.skip_data_step(bad_data_step)

    hooks = Hooks(stop_requested=signals.requested, save_wanted=ckpt.wants_save, before_update=ckpt.wait_staged,
                  rollback=rollback, after_step=[save_if_due])
    if is_main:
        hooks.after_step.append(lambda m, last, _: write_json(run.progress, {"step": m["step"], "time": m["time"]}))

    def make(step: int):
        shares = balance.split_for(step) if balance else None
        return [source.train_batch(i, sampler.data_step(step)) for i in
                sampler.local_micro_batches(step, par.dp_rank, dims.dp, cfg.train.micro_batch_size, shares)]

    sinks = MetricsSinks(run_dir if is_main else None, cfg.train.steps, sampler.step, bundle.items_name,
                         cfg.metrics.tensorboard, cfg.metrics.progress)
    announce(sinks, cfg, layout, par, bundle, n_params, source, run_dir, recovery)
    if profile_line:
        sinks.print(profile_line)
    record = Record()
    start_step = sampler.step
    try:
        if async_worker:
            def unit_batches(unit: int):
                return make_unit(sampler, source, unit, dims.dp, cfg.train)

            finished = async_train_loop(trainer, hooks, unit_batches, sinks, record, dims.dp, is_main)
        else:
            finished = train_loop(trainer, hooks, lambda start: Prefetcher(make, start, cfg.data.prefetch), sinks,
                                  record)
        if not finished:  # asked to stop: keep the work done so far, then leave
            step = sampler.step
            # decided from what every rank knows alike (not the filesystem, which rank 0 may still be sealing)
            if ckpt.cfg.enabled and (not ckpt.stats or ckpt.stats[-1]["step"] != step):
                ckpt.save(step, state, state.capture(step, cfg, data_spec))
            par.finish()  # no step or save follows (a parameter server's loop ends)
            ckpt.close()
            saved = run.checkpoints / step_dir_name(step)
            signum = signals.requested() or signal.SIGTERM  # another rank got the signal: say it was SIGTERM
            raise signals.Interrupted(signum, step, str(saved) if saved.exists() else None)
        par.finish()
        ckpt.close()  # an async save in flight is part of the run
    finally:
        sinks.close()
    summary = summarize(record.history, bundle.items_name, cfg.model.name, n_params, dims,
                        time.perf_counter() - t_start, env.restart_count, recovery, run, is_main,
                        bad_steps.state_dict(), record.memory_per_rank, start_step)
    summary["checkpoints"] = ckpt.stats
    if trainer.profile:
        summary["profile"] = summarize_profile(record.history)
    summary.update({f"initial_{k}": v for k, v in record.initial_val.items()})
    summary.update(par.report())
    if cfg.checkpoint.final_weights:
        write_final_weights(par, cfg, source.spec, run, is_main, sampler.step)
    if is_main:
        run.summary.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return summary


def profiler(cfg: Config, layout: Layout, bundle, source, env: DistEnv, comm: Comm, start_step: int):
    """metrics.profile: the step profile's profiler and the line saying what MFU is measured against."""
    dims, p = layout.dims, cfg.parallel
    axes = tuple(a for a, n in (("dp", dims.dp), ("tp", dims.tp), ("pp", dims.pp)) if n > 1)
    time_model_waits(comm.log, "tp" if dims.tp > 1 else "dp", pipeline=dims.pp > 1)
    bubble = bubble_fraction(dims.pp, layout.pp_microbatches,
                             p.pp_stages_per_rank if p.pp_schedule == "interleaved-1f1b" else 1)

    def meta_model():  # shapes only: what FlopCounterMode needs
        with on_meta():
            b = build_model(cfg.model, source.spec)
        return b.model, b.loss_fn

    return start_profiler(cfg.metrics.peak, cfg.metrics.straggler_ratio, cfg.precision.dtype, env.device,
                          axes + (("world",) if comm.world_size > 1 else ()), bubble, comm.world_size,
                          cfg.train.global_batch_size, start_step, bundle.flops_per_sample, meta_model,
                          source.train_batch(torch.arange(min(cfg.train.micro_batch_size, source.num_train))))


def announce(sinks: MetricsSinks, cfg: Config, layout: Layout, par, bundle, n_params: int, source, run_dir: Path,
             recovery: dict | None) -> None:
    """The start-up lines: the model, every derived value of the layout, the data, the run dir."""
    items_per_sample = getattr(cfg.model, "seq_len", 1) if bundle.items_name == "tokens" else 1
    trainable = sum(p.numel() for p in bundle.model.parameters() if p.requires_grad)
    frozen = f" ({trainable:,} trainable)" if trainable < n_params else ""  # train.freeze, model.lora
    sinks.print(f"[bold]shoal[/] {cfg.model.name}: {n_params:,} parameters{frozen}; "
                f"{layout.describe(cfg, bundle.items_name, items_per_sample)}")
    if par.describe():
        sinks.print(par.describe())
    sinks.print(f"data {cfg.data.source}: {source.num_train:,} training / {source.num_val:,} validation samples; "
                f"run dir {run_dir}")
    if recovery and recovery["checkpoint"]:
        sinks.print(f"resumed from {recovery['checkpoint']} (step {recovery['resumed_from_step']})")
    elif recovery:
        sinks.print(f"restart {recovery['restart']}: no checkpoint yet, starting from step 0")


def resume_from(state: TrainState, path: Path | None, cfg: Config, run: RunDir, env: DistEnv,
                comm: Comm) -> dict | None:
    """Collective: restore the checkpoint at `path`, if any. Returns what the summary reports about the
    recovery (None on a fresh start)."""
    if path is None:  # a fresh start; after an elastic restart with no checkpoint yet, all steps are redone
        return fresh_start(run, env.restart_count)
    t0, started = time.perf_counter(), time.time()
    check_compatible(cfg, path)
    same_rng = restore(state, path, cfg, env, comm)
    return {"checkpoint": str(path), "resumed_from_step": state.parts["sampler"].step, "rng_restored": same_rng,
            "restore_s": time.perf_counter() - t0, "restore_started_at": started,
            **failure_info(run, env.restart_count)}


def restore(state: TrainState, path: Path, cfg: Config, env: DistEnv, comm: Comm, keep: tuple[str, ...] = ()) -> bool:
    """Collective: every registered part as saved at `path` (but those in `keep`); returns whether the
    RNG streams are the saved ones."""
    load_checkpoint(path, state.model, state.optimizer, comm)
    return state.restore(path, read_train_state(path), env.rank, env.world_size, cfg.train.seed, keep)


def write_final_weights(par, cfg: Config, spec, run: RunDir, is_main: bool, step: int) -> None:
    """run_dir/model.safetensors: the whole model as the one-process model would save it (tied weights
    once), gathered from the ranks or, when no rank holds it whole, exported from the final checkpoint."""
    from safetensors.torch import save_model  # handles tied weights (GPT's embedding/head)

    model = par.whole_model(lambda: plain_model(cfg.model, spec), is_main)
    if is_main:
        if model is not None:
            save_model(model, str(run.weights))
        else:
            export_weights(run.path, run.weights, step=step)
