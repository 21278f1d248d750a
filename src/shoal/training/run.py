"""One rank's training run, as the sequence it is:

    build      the model (same seed on every rank), laid out by the strategy (strategy.py), its optimizer,
               schedule and number format, the sampler, and every stateful part registered for checkpoints
    restore    the checkpoint to resume from, if any
    loop       the Trainer over the strategy's feed, with checkpoint and heartbeat hooks
    summarise  summary.json's numbers
    save       the final weights, and summary.json (rank 0)

Nothing here is particular to a layout or a way of training: what differs is asked of the Strategy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shoal import signals
from shoal.checkpoint.export import export_weights
from shoal.checkpoint.manager import CheckpointManager
from shoal.checkpoint.manifest import step_dir_name
from shoal.checkpoint.resume import check_compatible, find_resume_point
from shoal.comm.collectives import Comm
from shoal.comm.phase import Phase
from shoal.config import Config
from shoal.data.loader import prefetch_depth
from shoal.dist import DistEnv
from shoal.layout import Layout
from shoal.metrics.memory import memory_mark, memory_since
from shoal.metrics.profile import summarize_profile
from shoal.models.spec import count_parameters
from shoal.rundir import RunDir, read_json
from shoal.training.assemble import Start, assemble, reload
from shoal.training.assemble import trainer as assemble_trainer
from shoal.training.build import build_deferred, freeze, plain_model
from shoal.training.collector import Collector
from shoal.training.feed import Steps
from shoal.training.live import Live, Regroup, capture, copied, one_replica, peer_failed, pooled
from shoal.training.live import restore as restore_live
from shoal.training.loop import Hooks, Trainer
from shoal.training.optim import optimizer_groups
from shoal.training.parts import Parts, announce, profiler
from shoal.training.strategy import Strategy
from shoal.training.summary import failure_info, fresh_start, summarize


def run_training(cfg: Config, layout: Layout, source, run_dir: Path, env: DistEnv, comm: Comm, *,
                 resume: str = "auto", phase: Phase | None = None, strategy: Strategy | None = None,
                 live: Live | None = None) -> dict:
    """Train on this rank; returns the run summary (identical on every rank). `source`: the data source
    the preflight built; `strategy`: how this rank trains (default: shoal's layouts); `live`: this rank's
    part in a live elastic run, which raises Regroup when the group changes (training/live.py)."""
    t_start = live.started if live else time.perf_counter()
    strategy = strategy or Strategy(cfg, layout, env.device, env.rank, comm)
    phase = phase or Phase()
    mark = memory_mark(env.device)
    parts = build(cfg, layout, source, RunDir(run_dir), env, comm, phase=phase, strategy=strategy,
                  resume=resume, live=live)
    # on the rank's device: NCCL, a GPU run's only backend, takes no CPU tensor
    grown = torch.tensor(float(memory_since(env.device, mark)), device=env.device)
    start_memory = comm.all_reduce(grown, op=dist.ReduceOp.MAX, label="world, start memory")
    recovery = restore(parts, live)
    if parts.sampler.step >= cfg.train.steps and parts.run.summary.exists():  # finished before: leave it be
        strategy.finish()
        return {**read_json(parts.run.summary), "already_finished": True, "steps": parts.sampler.step}
    start_step = parts.sampler.step
    lost: Regroup | None = None
    try:
        with live.watching(phase) if live is not None else contextlib.nullcontext():
            trainer, checkpoints = loop(parts, recovery, live)
    except Regroup as e:  # at a step boundary: a member leaves, or a joiner waits
        lost = e
    except Exception as e:
        if live is None or not peer_failed(e):
            raise
        lost = Regroup(held_after_failure(parts, live), f"a peer failed ({str(e).splitlines()[0][:160]})")
    if lost is not None:  # raised here, outside the handler: nothing keeps the failed collective's frames
        raise lost
    summary = summarize(trainer.record, parts.bundle.items_name, model_name=cfg.model.name, n_params=parts.n_params,
                        dims=layout.dims, total_s=time.perf_counter() - t_start, restart_count=env.restart_count,
                        recovery=recovery, run=parts.run, is_main=parts.is_main,
                        bad_steps=trainer.step.bad_steps.state_dict(), start_step=start_step)
    if live:
        summary["membership"] = live.events
    summary.update(checkpoints=checkpoints.stats, **trainer.collector.summary())
    summary["start_memory_bytes"] = int(start_memory)  # the most a rank's memory grew while it built its share
    if parts.bundle.built_whole:  # its build could not be recorded: every rank built the whole model
        summary["model_built_whole"] = parts.bundle.built_whole
    if trainer.watch.profile:
        summary["profile"] = summarize_profile(trainer.record.history)
    summary.update(strategy.report())
    save(parts, summary)
    return summary


def held_after_failure(parts: Parts, live: Live):
    """The state a live run's survivor goes on from when a peer failed inside a step. Replicas that differ go
    back to where they were one model: the round's work died with the peer. Else the state at the last step
    this rank completed; where a collective after the update failed (a logged step's memory figures are
    gathered then), the weights, the optimizer and the schedule are at that step's end on every survivor (each
    took it once their flags were agreed), so that step counts as done, not the one before with its weights."""
    if parts.state.replicas_differ:
        return live.round
    parts.sampler.step = max(parts.sampler.step, parts.step.updated)
    return snapshot(parts)


def hold_rounds(parts: Parts, live: Live, on: Hooks) -> None:
    """Keep a copy of this rank's state wherever the replicas are one model (the start, if they are, and
    each synchronisation): where a live run of replicas that differ goes back to when a peer fails. None
    (the start, or a resume that began mid-round): back to the newest checkpoint, or the start."""
    live.round = copied(snapshot(parts)) if parts.step.par.in_sync(parts.sampler.step) else None

    def keep(m: dict, last: bool, by_time: bool) -> None:
        if parts.step.par.in_sync(m["step"]):
            live.round = copied(snapshot(parts))

    on.after_step.append(keep)


def snapshot(parts: Parts):
    """This rank's state at its last completed step, as a live run's Snapshot (training/live.py); None
    before its first: nothing is learned yet, and DCP's state dict of an optimizer that has not stepped
    would initialise its state by a step of lr 0, which AdamW counts (its bias correction is then one
    step off)."""
    step = parts.sampler.step
    if step == 0:
        return None
    return capture(parts.state, step, parts.cfg.to_toml(), dataclasses.asdict(parts.source.spec), parts.env.rank,
                   parts.env.world_size)


def build(cfg: Config, layout: Layout, source, run: RunDir, env: DistEnv, comm: Comm, *, phase: Phase,
          strategy: Strategy, resume: str, live: Live | None = None) -> Parts:
    """Collective: everything this rank's run is built from, before any checkpoint is read (a live run
    going on from a Snapshot reads none): the config's model, then the one assembly (assemble.py)."""
    in_memory = live is not None and live.held is not None
    found = "" if in_memory else comm.agree("resume_from",
                                            lambda: str(find_resume_point(run.checkpoints, resume) or ""))
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

    start = Start(cfg=cfg, layout=layout, source=source, run=run, env=env, comm=comm, phase=phase, strategy=strategy)
    return assemble(start, bundle, optimizer, n_params=count_parameters(bundle.model),
                    num_train=source.num_train or 1,  # a stream's (data/stream.py): its sampler only counts steps
                    resume_path=resume_path, sample=sample, regroup_wanted=live.regroup_wanted if live else None)


def restore(parts: Parts, live: Live | None = None) -> dict | None:
    """Collective: restore the checkpoint the run resumes from, if any (a live run: the Snapshot it goes on
    from). Returns what the summary reports about the recovery (None on a fresh start)."""
    path, run, env = parts.resume_path, parts.run, parts.env
    if live is not None and live.held is not None:
        # a failure's survivors merge their residuals for the new world (a planned change merged them already)
        snap = pooled(parts.comm, parts.state, live.held,
                      gives=live.held.meta.get("own", True) and not live.held.meta.get("pooled"), device=env.device)
        restore_live(parts.state, snap, env.rank, env.world_size, parts.cfg.train.seed, own=snap.meta.get("own", True))
        return None
    if path is None:  # a fresh start; after an elastic restart with no checkpoint yet, all steps are redone
        return fresh_start(run, env.restart_count)
    t0, started = time.perf_counter(), time.time()
    check_compatible(parts.cfg, path)
    same_rng = reload(parts, path)
    return {"checkpoint": str(path), "resumed_from_step": parts.sampler.step, "rng_restored": same_rng,
            "restore_s": time.perf_counter() - t0, "restore_started_at": started,
            **failure_info(run, env.restart_count)}


def loop(parts: Parts, recovery: dict | None, live: Live | None = None) -> tuple[Trainer, CheckpointManager]:
    """The Trainer over the strategy's feed, checkpointing as it goes; raises signals.Interrupted when the
    ranks agreed to stop early (after saving), and (a live run) Regroup when they agreed to change the
    group."""
    cfg, strategy, sampler, checkpoints = parts.cfg, parts.strategy, parts.sampler, parts.checkpoints
    trainer, profile_line = assemble_trainer(parts, items_name=parts.bundle.items_name,
                                             profiler=lambda: profiler(parts), validates=strategy.validates)
    sinks = trainer.sinks
    # a live run has frozen its start-up heap, and collects each ended generation itself (worker.py)
    trainer.collector = Collector(cfg.train.gc_interval, freeze=live is None)
    if live is not None:
        if parts.state.replicas_differ:
            hold_rounds(parts, live, trainer.hooks)
        if live.record is not None:  # the history of the generations before this one
            trainer.record = live.record
        live.record = trainer.record
    if live is None or live.held is None:  # a start (or, lost before the first step, a start again)
        announce(parts, sinks, recovery, profile_line)
    if live is not None and live.events:  # a new generation: what changed
        event = live.events[-1]
        sinks.print(event["line"])
        sinks.event({"step": sampler.step, "time": event["time"], "membership": event["line"], "world": event["world"]})
    try:
        steps = Steps(sampler, cfg.train.steps, batches(parts), prefetch_depth(cfg.data.prefetch, parts.source))
        ended = trainer.run(strategy.feed(steps, parts.step.schedule))
        if ended == "regroup":
            checkpoints.close()  # an async save in flight is part of the run
            raise Regroup(handed_over(parts), "the group changes: a member leaves or a joiner waits")
        if ended == "stop":  # asked to stop: keep the work done so far, then leave
            stop(parts, checkpoints)
        strategy.finish()
        checkpoints.close()  # an async save in flight is part of the run
    finally:
        sinks.close()
    return trainer, checkpoints


def handed_over(parts: Parts):
    """Collective over the old group at a planned change: the state this rank goes on from. Every member gives
    its residuals to the merge while the group still holds them all; where replicas differ, rank 0 hands its
    replica to the others, even when rank 0 is the member that leaves (training/live.py, one_replica)."""
    held = pooled(parts.comm, parts.state, snapshot(parts), gives=True, device=parts.env.device)
    return one_replica(parts.comm, held, parts.env.device) if parts.state.replicas_differ else held


def batches(parts: Parts):
    """make(step): this rank's micro-batches of training step `step` (its share of the global batch), made
    ready for the device and counted (Stepper.prepare), on the data thread."""
    sampler, source, balance = parts.sampler, parts.source, parts.step.balance
    dp, micro = parts.layout.dims.dp, parts.layout.micro_batch
    stream = parts.state.parts.get("stream")
    if stream is not None:  # data.streaming: this rank's next windows, in micro-batches
        def windows(step: int):
            w = stream.windows(step, parts.layout.per_rank_batch)
            return parts.step.prepare([{"input": m[:, :-1].contiguous(), "target": m[:, 1:].contiguous()}
                                       for m in w.split(micro)])

        return windows

    def make(step: int):
        shares = balance.split_for(step) if balance else None
        return parts.step.prepare([source.train_batch(i, sampler.data_step(step))
                                   for i in sampler.local_micro_batches(step, parts.step.par.dp_rank, dp, micro,
                                                                        shares)])

    return make


def stop(parts: Parts, checkpoints: CheckpointManager) -> None:
    """The ranks agreed to stop early: save the step reached (unless saved), finish, raise Interrupted."""
    step = parts.sampler.step
    # decided from what every rank knows alike (not the filesystem, which rank 0 may still be sealing)
    if checkpoints.cfg.enabled and (not checkpoints.stats or checkpoints.stats[-1]["step"] != step):
        checkpoints.save(step, parts.state, parts.state.capture(step, parts.cfg.to_toml(),
                                                                dataclasses.asdict(parts.source.spec)))
    parts.strategy.finish()  # no step or save follows
    checkpoints.close()
    saved = parts.run.checkpoints / step_dir_name(step)
    signum = signals.requested() or signal.SIGTERM  # another rank got the signal: say it was SIGTERM
    raise signals.Interrupted(signum, step, str(saved) if saved.exists() else None)


def save(parts: Parts, summary: dict) -> None:
    """run_dir/model.safetensors: the whole model as the one-process model would save it (tied weights
    once), gathered from the ranks or, when no rank holds it whole, exported from the final checkpoint;
    then summary.json (rank 0)."""
    from safetensors.torch import save_model  # handles tied weights (GPT's embedding/head)

    cfg, run, is_main = parts.cfg, parts.run, parts.is_main
    if cfg.checkpoint.final_weights:
        model = parts.step.par.whole_model(lambda: plain_model(cfg.model, parts.source.spec), is_main)
        if is_main and model is not None:
            save_model(model, str(run.weights))
        elif is_main:
            export_weights(run.path, run.weights, step=parts.sampler.step)
    if is_main:
        run.summary.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
