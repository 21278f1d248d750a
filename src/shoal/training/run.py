"""One rank's run, one object for `shoal train` (train.py: a Run and its loop) and `shoal.Session`
(session.py: a thin adapter over a Run), in the order a run goes through:

    build    assemble.py: the model laid out by the strategy, its optimizer, number format, checkpoints,
             the Stepper, the sampler, every stateful part registered for checkpoints; then the loop's
             Trainer over them (its metrics sinks, step profile, traces, hooks)
    restore  Run.restore: a checkpoint, checked against the config first
    step     the Trainer's loop (train.py) or a Session's step(); each begins with Trainer.begin_step
    save     Run.save: a checkpoint of the step reached
    close    Run.close: the step left unread, a save in flight, the metrics sinks; then Run.finish:
             the final weights and summary.json
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shoal.checkpoint.export import export_weights
from shoal.checkpoint.manager import CheckpointManager, load_checkpoint
from shoal.checkpoint.manifest import step_dir_name
from shoal.checkpoint.resume import check_compatible
from shoal.checkpoint.train_state import TrainState, read_train_state
from shoal.comm.collectives import Comm
from shoal.comm.model_waits import time_model_waits
from shoal.comm.phase import Phase
from shoal.config import Config
from shoal.data.sampler import GlobalBatchSampler
from shoal.dist import DistEnv
from shoal.layout import Layout
from shoal.metrics.profile import FlopSource, Profiler, bubble_fraction, start_profiler, summarize_profile
from shoal.models.spec import ModelBundle
from shoal.parallel.precision import keep_implementation
from shoal.rundir import RunDir
from shoal.training.loop import Trainer
from shoal.training.step import Stepper
from shoal.training.strategy import Strategy
from shoal.training.summary import failure_info, summarize


@dataclass(frozen=True)
class Start:
    """Where a rank's run starts from, and what it was given: the config, the layout, the data source
    (data/sources.py; a Session's: the user's, of which nothing is known), the run dir, the process group,
    the hang report's phase, the strategy. A Session's runs (its models) share one."""

    cfg: Config
    layout: Layout
    source: object
    dir: RunDir
    env: DistEnv
    comm: Comm
    phase: Phase
    strategy: Strategy


@dataclass(kw_only=True)
class Run:
    start: Start
    bundle: ModelBundle
    n_params: int
    step: Stepper  # the laid-out model, its optimizer, schedule and number format
    sampler: GlobalBatchSampler  # its position is the run's step count
    state: TrainState  # every stateful part, for checkpoints
    resume_path: Path | None  # the checkpoint to resume from (None: a fresh start)
    checkpoints: CheckpointManager
    trainer: Trainer | None = None  # the loop over these parts (assemble.trainer); a Session's second model has none
    started: float = field(default_factory=time.perf_counter)

    # what the run was given, by the names its code reads (each the Start's)
    cfg = property(lambda self: self.start.cfg)
    layout = property(lambda self: self.start.layout)
    source = property(lambda self: self.start.source)
    dir = property(lambda self: self.start.dir)
    env = property(lambda self: self.start.env)
    comm = property(lambda self: self.start.comm)
    strategy = property(lambda self: self.start.strategy)

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0

    def restore(self, path: Path, keep: tuple[str, ...] = (), describes: tuple[str, ...] | None = None,
                fresh: str = "--resume never or another --run-dir") -> dict:
        """Collective: the checkpoint at `path`, once its config is seen to describe this run (the keys of
        `describes` match; None: the model's and the data's, checkpoint/resume.py; else one line naming the key,
        the value that resumes it, and `fresh`: how to start over). Every registered part but those in `keep`
        is restored. Returns what the summary reports."""
        t0, started = time.perf_counter(), time.time()
        check_compatible(self.cfg, path, describes, fresh)
        same_rng = self.reload(path, keep)
        return {"checkpoint": str(path), "resumed_from_step": self.sampler.step, "rng_restored": same_rng,
                "restore_s": time.perf_counter() - t0, "restore_started_at": started,
                **failure_info(self.dir, self.env.restart_count)}

    def reload(self, path: Path, keep: tuple[str, ...] = ()) -> bool:
        """Collective: every registered part as saved at `path` (but those in `keep`); returns whether the
        RNG streams are the saved ones."""
        state, env = self.state, self.env
        load_checkpoint(path, state.model, state.optimizer, self.comm)
        keep_implementation(state.optimizer)
        return state.restore(path, read_train_state(path), env.rank, env.world_size, self.cfg.train.seed, keep)

    def save(self, step: int | None = None) -> Path:
        """Collective: a checkpoint of step `step` (default: the step reached), written in the background
        where checkpoint.async_save says so; returns its folder."""
        step = self.sampler.step if step is None else step
        data_spec = dataclasses.asdict(self.source.spec)
        self.checkpoints.save(step, self.state, self.state.capture(step, self.cfg.to_toml(), data_spec))
        return self.dir.checkpoints / step_dir_name(step)

    def profiler(self, flops: FlopSource | None) -> tuple[Profiler, str]:
        """metrics.profile: the step profile's profiler and the line saying what MFU is measured against.
        `flops`: where a sample's FLOPs come from (None: not known, no MFU)."""
        cfg, layout, comm = self.cfg, self.layout, self.comm
        dims, p = layout.dims, cfg.parallel
        axes = tuple(a for a, n in (("dp", dims.dp), ("tp", dims.tp), ("pp", dims.pp), ("ep", p.ep), ("cp", p.cp))
                     if n > 1)
        time_model_waits(comm.log, "tp" if dims.tp > 1 else "dp", pipeline=dims.pp > 1)
        return start_profiler(cfg.metrics, cfg.precision.dtype, self.env.device, flops,
                              axes=axes + (("world",) if comm.world_size > 1 else ()),
                              bubble=bubble_fraction(dims.pp, layout.pp_microbatches,
                                                     p.pp_stages_per_rank if p.pp_schedule == "interleaved-1f1b"
                                                     else 1),
                              world_size=comm.world_size, global_batch=cfg.train.global_batch_size,
                              start_step=self.sampler.step)

    def close(self) -> None:
        """The end of training: the step left unread (if any) read, a save in flight written, the step trace
        and the metrics sinks closed."""
        trainer = self.trainer
        trainer.flush(None)
        if trainer.watch.trace:
            trainer.watch.trace.close()
        if trainer.watch.syncs:
            trainer.watch.syncs.close()
        self.strategy.finish()  # no step or save follows
        self.checkpoints.close()
        trainer.sinks.close()

    def summary(self, *, recovery: dict | None = None, start_step: int = 0, model_name: str | None = None,
                n_params: int | None = None) -> dict:
        """summary.json's numbers (the same on every rank): the loop's record, the recovery `recovery` (None: a
        fresh start), the checkpoints, the garbage collector, the step profile, what the strategy reports."""
        trainer = self.trainer
        summary = summarize(trainer.record, trainer.items_name, model_name=model_name or self.cfg.model.name,
                            n_params=self.n_params if n_params is None else n_params, dims=self.layout.dims,
                            total_s=time.perf_counter() - self.started, restart_count=self.env.restart_count,
                            recovery=recovery, run=self.dir, is_main=self.is_main,
                            bad_steps=self.step.bad_steps.state_dict(), start_step=start_step)
        summary.update(checkpoints=self.checkpoints.stats, **trainer.collector.summary())
        if self.bundle.active_params is not None:  # a mixture of experts: what one token passes through
            summary["active_parameters"] = self.bundle.active_params
        if trainer.watch.syncs:  # metrics.host_syncs: where the host waited, most first
            summary["host_sync_sites"] = dict(trainer.watch.syncs.sites.most_common(8))
        if self.bundle.built_whole:  # its build could not be recorded: every rank built the whole model
            summary["model_built_whole"] = self.bundle.built_whole
        if trainer.watch.profile:
            summary["profile"] = summarize_profile(trainer.record.history)
        summary.update(self.strategy.report())
        return summary

    def finish(self, summary: dict, weights: bool = True,
               plain_model: Callable[[], torch.nn.Module] | None = None) -> None:
        """Collective: run_dir/model.safetensors (where checkpoint.final_weights and `weights` say so), then
        summary.json (rank 0)."""
        if weights and self.cfg.checkpoint.final_weights:
            self.final_weights(plain_model)
        if self.is_main:
            self.dir.summary.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")

    def final_weights(self, plain_model: Callable[[], torch.nn.Module] | None) -> None:
        """Collective: run_dir/model.safetensors, the whole model as the one-process model would save it: the
        live module where a rank holds it whole; else gathered from the shards, into `plain_model()` (tied
        weights saved once) or as gathered (None: a Session's model, which shoal cannot build); where no rank
        holds the whole model (pipeline stages), exported from the final checkpoint."""
        from safetensors.torch import save_file, save_model

        par, is_main = self.step.par, self.is_main
        if plain_model is None and not par.holds_whole():
            full = par.full_state()
            if is_main:
                save_file({k: v.contiguous() for k, v in full.items()}, str(self.dir.weights))
            return
        model = par.whole_model(plain_model, is_main)
        if is_main and model is not None:
            save_model(model, str(self.dir.weights))
        elif is_main:
            export_weights(self.dir.path, self.dir.weights, step=self.sampler.step)
