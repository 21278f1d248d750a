"""`shoal train` on one rank: a Run (run.py) and its loop, as the sequence it is:

    build      the config's model (same seed on every rank), then the one assembly of a Run (assemble.py)
    restore    the checkpoint to resume from, if any (or the state its generation holds: generation.py)
    loop       the Run's Trainer over the strategy's feed, with checkpoint and heartbeat hooks
    finish     summary.json's numbers, the final weights, summary.json (rank 0)

Nothing here is particular to a layout or a way of training: what differs is asked of the Strategy.
"""

from __future__ import annotations

import signal
from pathlib import Path

import torch
import torch.distributed as dist

from shoal import signals
from shoal.checkpoint.manifest import step_dir_name
from shoal.checkpoint.resume import find_resume_point
from shoal.comm.collectives import Comm
from shoal.comm.phase import Phase
from shoal.config import Config
from shoal.data.loader import prefetch_depth
from shoal.dist import DistEnv
from shoal.layout import Layout
from shoal.metrics.memory import memory_mark, memory_since
from shoal.metrics.profile import FlopSource
from shoal.metrics.sinks import MetricsSinks
from shoal.models.meta import on_meta
from shoal.models.registry import build_model
from shoal.models.spec import count_parameters
from shoal.rundir import RunDir, read_json
from shoal.training.assemble import assemble, trainer
from shoal.training.build import build_deferred, freeze, plain_model
from shoal.training.collector import Collector
from shoal.training.feed import Steps
from shoal.training.generation import Generation
from shoal.training.loop import Ended
from shoal.training.optim import optimizer_groups
from shoal.training.run import Run, Start
from shoal.training.strategy import Strategy
from shoal.training.summary import fresh_start


def run_training(cfg: Config, layout: Layout, source, run_dir: Path, env: DistEnv, comm: Comm, *,
                 resume: str = "auto", phase: Phase | None = None, strategy: Strategy | None = None,
                 generation: Generation | None = None) -> dict:
    """Train on this rank; returns the run summary (identical on every rank). `source`: the data source
    the preflight built; `strategy`: how this rank trains (default: shoal's layouts); `generation`: the
    group's membership, asked at its hook points (generation.py; default: a fixed group)."""
    strategy = strategy or Strategy(cfg, layout, env.device, env.rank, comm)
    phase, generation = phase or Phase(), generation or Generation()
    mark = memory_mark(env.device)
    run = build(cfg, layout, source, RunDir(run_dir), env, comm, phase=phase, strategy=strategy,
                resume=resume, generation=generation)
    # on the rank's device: NCCL, a GPU run's only backend, takes no CPU tensor
    grown = torch.tensor(float(memory_since(env.device, mark)), device=env.device)
    start_memory = comm.all_reduce(grown, op=dist.ReduceOp.MAX, label="world, start memory")
    recovery = restore(run, generation)
    if run.sampler.step >= cfg.train.steps and run.dir.summary.exists():  # finished before: leave it be
        strategy.finish()
        return {**read_json(run.dir.summary), "already_finished": True, "steps": run.sampler.step}
    start_step = run.sampler.step
    lost: BaseException | None = None
    try:
        with generation.watching(phase):
            loop(run, recovery, generation)
    except Exception as e:
        lost = generation.lost(run, e)  # the group changes (a live run), or a peer failed and it goes on
        if lost is None:
            raise
    if lost is not None:  # raised here, outside the handler: nothing keeps the failed collective's frames
        raise lost
    summary = run.summary(recovery=recovery, start_step=start_step)
    generation.summarize(summary)
    summary["start_memory_bytes"] = int(start_memory)  # the most a rank's memory grew while it built its share
    run.finish(summary, plain_model=lambda: plain_model(cfg.model, source.spec))
    return summary


def build(cfg: Config, layout: Layout, source, run_dir: RunDir, env: DistEnv, comm: Comm, *, phase: Phase,
          strategy: Strategy, resume: str, generation: Generation) -> Run:
    """Collective: everything this rank's run is built from, before any checkpoint is read (a generation
    that holds its state reads none): the config's model, then the one assembly (assemble.py)."""
    in_memory = generation.holds_state()
    found = "" if in_memory else comm.agree("resume_from",
                                            lambda: str(find_resume_point(run_dir.checkpoints, resume) or ""))
    resume_path = Path(found) if found and strategy.restores else None
    torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
    bundle = build_deferred(cfg.model, source.spec, init=resume_path is None and not in_memory)
    freeze(bundle.model, cfg.train.freeze)
    # one pipeline micro-batch, for timing the layers (parallel.pp_balance = "time")
    sample = (source.train_batch(torch.arange(layout.per_rank_batch // layout.pp_microbatches))
              if layout.dims.pp > 1 else None)

    def optimizer(par):
        optimizer_class, groups, hyper = optimizer_groups(par.model.parameters(), cfg.train)
        return par.build_optimizer(groups, optimizer_class, **hyper)

    start = Start(cfg=cfg, layout=layout, source=source, dir=run_dir, env=env, comm=comm, phase=phase,
                  strategy=strategy)
    run = assemble(start, bundle, optimizer, n_params=count_parameters(bundle.model),
                   num_train=source.num_train or 1,  # a stream's (data/stream.py): its sampler only counts steps
                   resume_path=resume_path, sample=sample, regroup_wanted=generation.regroup_wanted)
    if generation.started is not None:
        run.started = generation.started
    return run


def restore(run: Run, generation: Generation) -> dict | None:
    """Collective: restore the checkpoint the run resumes from, if any (or the state the generation holds).
    Returns what the summary reports about the recovery (None on a fresh start, or from held state)."""
    if generation.holds_state():
        generation.restore(run)
        return None
    if run.resume_path is None:  # a fresh start; after an elastic restart with no checkpoint yet, all steps are redone
        return fresh_start(run.dir, run.env.restart_count)
    return run.restore(run.resume_path)


def loop(run: Run, recovery: dict | None, generation: Generation) -> None:
    """The Run's Trainer over the strategy's feed, checkpointing as it goes; raises signals.Interrupted when
    the ranks agreed to stop early (after saving), and the generation's exception when they agreed to change
    the group."""
    cfg, sampler = run.cfg, run.sampler
    line = trainer(run, items_name=run.bundle.items_name, profiler=lambda: run.profiler(model_flops(run)),
                   validates=run.strategy.validates)
    loop_ = run.trainer
    loop_.collector = Collector(cfg.train.gc_interval, freeze=generation.freezes_heap)
    if not generation.holds_state():  # a start (or, a live run lost before its first step, a start again)
        announce(run, loop_.sinks, recovery, line)
    generation.begin(run, loop_)
    try:
        steps = Steps(sampler, cfg.train.steps, batches(run), prefetch_depth(cfg.data.prefetch, run.source))
        ended = loop_.run(run.strategy.feed(steps, run.step.schedule))
        if ended is Ended.REGROUP:
            run.checkpoints.close()  # an async save in flight is part of the run
            raise generation.regroup(run)
        if ended is Ended.STOP:  # asked to stop: keep the work done so far, then leave
            stop(run)
        run.close()
    finally:
        loop_.sinks.close()


def model_flops(run: Run) -> FlopSource:
    """Where a sample's training FLOPs come from: the model's own count, else torch's FLOP counter over a
    meta-device build of the config's model on one micro-batch."""
    cfg, source = run.cfg, run.source

    def meta_model():  # shapes only: what FlopCounterMode needs
        with on_meta():
            b = build_model(cfg.model, source.spec)
        return b.model, b.loss_fn

    return FlopSource(per_sample=run.bundle.flops_per_sample, build=meta_model,
                      batch=source.train_batch(torch.arange(min(run.layout.micro_batch,
                                                                source.num_train or source.num_val))))


def announce(run: Run, sinks: MetricsSinks, recovery: dict | None, profile_line: str | None) -> None:
    """The start-up lines: the model, every derived value of the layout, the data, the run dir, the resume,
    what MFU is measured against."""
    cfg, bundle, source = run.cfg, run.bundle, run.source
    items_per_sample = getattr(cfg.model, "seq_len", 1) if bundle.items_name == "tokens" else 1
    trainable = sum(p.numel() for p in bundle.model.parameters() if p.requires_grad)
    frozen = f" ({trainable:,} trainable)" if trainable < run.n_params else ""  # train.freeze, model.lora
    sinks.print(f"[bold]shoal[/] {cfg.model.name}: {bundle.params_text(run.n_params)}{frozen}; "
                f"{run.layout.describe(cfg, bundle.items_name, items_per_sample)}")
    if bundle.built_whole:
        sinks.print(f"model built whole on every rank, not sharded at the start: {bundle.built_whole}")
    if run.step.par.describe():
        sinks.print(run.step.par.describe())
    held = (f"streamed, tokenized as training reads it; {source.num_val:,} validation windows"
            if getattr(source, "streamed", False) else
            f"{source.num_train:,} training / {source.num_val:,} validation samples")
    sinks.print(f"data {cfg.data.source}: {held}; run dir {run.dir.path}")
    if recovery and recovery["checkpoint"]:
        sinks.print(f"resumed from {recovery['checkpoint']} (step {recovery['resumed_from_step']})")
    elif recovery:
        sinks.print(f"restart {recovery['restart']}: no checkpoint yet, starting from step 0")
    if profile_line:
        sinks.print(profile_line)


def batches(run: Run):
    """make(step): this rank's micro-batches of training step `step` (its share of the global batch), made
    ready for the device and counted (Stepper.prepare), on the data thread."""
    sampler, source, balance = run.sampler, run.source, run.step.balance
    dp, micro = run.layout.batch_ranks, run.layout.micro_batch  # parallel.cp: a group's ranks share sequences
    stream = run.state.parts.get("stream")
    if stream is not None:  # data.streaming: this rank's next windows, in micro-batches
        def windows(step: int):
            w = stream.windows(step, run.layout.per_rank_batch)
            return run.step.prepare([run.source.batch(m) for m in w.split(micro)])

        return windows

    def make(step: int):
        shares = balance.split_for(step) if balance else None
        return run.step.prepare([source.train_batch(i, sampler.data_step(step))
                                 for i in sampler.local_micro_batches(step, run.step.par.data_rank, dp, micro, shares)])

    return make


def stop(run: Run) -> None:
    """The ranks agreed to stop early: save the step reached (unless saved), finish, raise Interrupted."""
    step, checkpoints = run.sampler.step, run.checkpoints
    # decided from what every rank knows alike (not the filesystem, which rank 0 may still be sealing)
    if checkpoints.cfg.enabled and (not checkpoints.stats or checkpoints.stats[-1]["step"] != step):
        run.save(step)
    run.close()
    saved = run.dir.checkpoints / step_dir_name(step)  # this save, or the one taken at this step already
    signum = signals.requested() or signal.SIGTERM  # another rank got the signal: say it was SIGTERM
    raise signals.Interrupted(signum, step, str(saved) if saved.exists() else None)
