"""What one rank's run is built from (assemble.py makes them), and what is said and measured of them
at start: the start-up lines and the step profile's profiler."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from shoal.checkpoint.manager import CheckpointManager
from shoal.checkpoint.train_state import TrainState
from shoal.comm.collectives import Comm
from shoal.comm.model_waits import time_model_waits
from shoal.config import Config
from shoal.data.sampler import GlobalBatchSampler
from shoal.dist import DistEnv
from shoal.layout import Layout
from shoal.metrics.profile import FlopSource, Profiler, bubble_fraction, start_profiler
from shoal.metrics.sinks import MetricsSinks
from shoal.models.meta import on_meta
from shoal.models.registry import build_model
from shoal.models.spec import ModelBundle
from shoal.rundir import RunDir
from shoal.training.step import Stepper
from shoal.training.strategy import Strategy


@dataclass(kw_only=True)
class Parts:
    cfg: Config
    layout: Layout
    source: object  # data/sources.py
    run: RunDir
    env: DistEnv
    comm: Comm
    strategy: Strategy
    bundle: ModelBundle
    n_params: int
    step: Stepper  # the laid-out model, its optimizer, schedule and number format
    sampler: GlobalBatchSampler
    state: TrainState  # every stateful part, for checkpoints
    resume_path: Path | None  # the checkpoint to resume from (None: a fresh start)
    checkpoints: CheckpointManager

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0


def announce(parts: Parts, sinks: MetricsSinks, recovery: dict | None, profile_line: str | None) -> None:
    """The start-up lines: the model, every derived value of the layout, the data, the run dir, the resume,
    what MFU is measured against."""
    cfg, bundle, source = parts.cfg, parts.bundle, parts.source
    items_per_sample = getattr(cfg.model, "seq_len", 1) if bundle.items_name == "tokens" else 1
    trainable = sum(p.numel() for p in bundle.model.parameters() if p.requires_grad)
    frozen = f" ({trainable:,} trainable)" if trainable < parts.n_params else ""  # train.freeze, model.lora
    sinks.print(f"[bold]shoal[/] {cfg.model.name}: {parts.n_params:,} parameters{frozen}; "
                f"{parts.layout.describe(cfg, bundle.items_name, items_per_sample)}")
    if bundle.built_whole:
        sinks.print(f"model built whole on every rank, not sharded at the start: {bundle.built_whole}")
    if parts.step.par.describe():
        sinks.print(parts.step.par.describe())
    held = (f"streamed, tokenized as training reads it; {source.num_val:,} validation windows"
            if getattr(source, "streamed", False) else
            f"{source.num_train:,} training / {source.num_val:,} validation samples")
    sinks.print(f"data {cfg.data.source}: {held}; run dir {parts.run.path}")
    if recovery and recovery["checkpoint"]:
        sinks.print(f"resumed from {recovery['checkpoint']} (step {recovery['resumed_from_step']})")
    elif recovery:
        sinks.print(f"restart {recovery['restart']}: no checkpoint yet, starting from step 0")
    if profile_line:
        sinks.print(profile_line)


def profiler(parts: Parts) -> tuple[Profiler, str]:
    """metrics.profile: the step profile's profiler and the line saying what MFU is measured against."""
    cfg, layout, comm, source = parts.cfg, parts.layout, parts.comm, parts.source
    dims, p = layout.dims, cfg.parallel
    axes = tuple(a for a, n in (("dp", dims.dp), ("tp", dims.tp), ("pp", dims.pp)) if n > 1)
    time_model_waits(comm.log, "tp" if dims.tp > 1 else "dp", pipeline=dims.pp > 1)

    def meta_model():  # shapes only: what FlopCounterMode needs
        with on_meta():
            b = build_model(cfg.model, source.spec)
        return b.model, b.loss_fn

    flops = FlopSource(per_sample=parts.bundle.flops_per_sample, build=meta_model,
                       batch=source.train_batch(torch.arange(min(layout.micro_batch,
                                                                 source.num_train or source.num_val))))
    return start_profiler(cfg.metrics, cfg.precision.dtype, parts.env.device, flops,
                          axes=axes + (("world",) if comm.world_size > 1 else ()),
                          bubble=bubble_fraction(dims.pp, layout.pp_microbatches,
                                                 p.pp_stages_per_rank if p.pp_schedule == "interleaved-1f1b" else 1),
                          world_size=comm.world_size, global_batch=cfg.train.global_batch_size,
                          start_step=parts.sampler.step)
