"""Assemble one rank's training run from a validated config, run it, and write its results.

Order: data source -> model (same seed on every rank) -> parallelize -> optimizer, schedule,
precision -> sampler and prefetcher -> loop -> final weights and summary.json (rank 0).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from shoal.config import Config
from shoal.data.loader import Prefetcher
from shoal.data.sampler import GlobalBatchSampler
from shoal.data.sources import build_source
from shoal.dist import DistEnv
from shoal.errors import UserError
from shoal.metrics.sinks import MetricsSinks
from shoal.models.registry import build_model, count_parameters
from shoal.parallel.apply import check_parallelizable, parallelize
from shoal.plan import RunPlan, make_plan
from shoal.train.loop import TrainState, train_loop
from shoal.train.optim import build_optimizer, build_scheduler
from shoal.train.precision import Precision


def build_data_and_model(cfg: Config, plan: RunPlan, device: str = "cpu"):
    """The data source and the model bundle; also used before launch (on the meta device) to check
    that they fit together without allocating the weights."""
    source = build_source(cfg.data, getattr(cfg.model, "seq_len", None))
    if source.num_val < plan.dims.dp:
        raise UserError(f"the validation split has {source.num_val} samples, fewer than dp ({plan.dims.dp}); "
                        f"raise data.val_fraction")
    with torch.device(device):
        bundle = build_model(cfg.model, source.spec)
    check_parallelizable(bundle, cfg)
    return source, bundle


def run_training(cfg: Config, run_dir: Path, env: DistEnv) -> dict:
    """Train on this rank; returns the run summary (identical on every rank)."""
    t_start = time.perf_counter()
    plan = make_plan(cfg, env.world_size)
    dims = plan.dims
    torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
    source, bundle = build_data_and_model(cfg, plan)
    model = parallelize(bundle, dims, cfg, env.device)
    torch.manual_seed(cfg.train.seed + 1 + env.rank)  # dropout etc. differ per rank, reproducibly
    optimizer = build_optimizer(bundle.model, cfg.train)
    dp_rank = dims.coords(env.rank)["dp"]
    dp_group = dims.mesh["dp"].get_group() if dims.world_size > dims.dp else None
    state = TrainState(cfg, plan, bundle, model, optimizer, build_scheduler(optimizer, cfg.train),
                       Precision(cfg.precision.dtype, env.device),
                       GlobalBatchSampler(source.num_train, cfg.train.global_batch_size, cfg.train.seed),
                       source, env.device, dp_rank, dp_group)

    def make(step: int):
        return [source.train_batch(i) for i in
                state.sampler.local_micro_batches(step, dp_rank, dims.dp, cfg.train.micro_batch_size)]

    is_main = env.rank == 0
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(cfg.to_toml(), encoding="utf-8")
    sinks = MetricsSinks(run_dir if is_main else None, cfg.train.steps, state.sampler.step,
                         bundle.items_name, cfg.metrics.tensorboard, cfg.metrics.progress)
    n_params = count_parameters(bundle.model)
    items_per_sample = getattr(cfg.model, "seq_len", 1) if bundle.items_name == "tokens" else 1
    shape = plan.describe(cfg, bundle.items_name, items_per_sample)
    sinks.print(f"[bold]shoal[/] {cfg.model.name}: {n_params:,} parameters; {shape}")
    sinks.print(f"data {cfg.data.source}: {source.num_train:,} training / {source.num_val:,} validation samples; "
                f"run dir {run_dir}")
    loader = Prefetcher(make, start=state.sampler.step, depth=cfg.data.prefetch)
    try:
        train_loop(state, loader, sinks)
    finally:
        loader.close()
        sinks.close()
    summary = summarize(state, n_params, time.perf_counter() - t_start)
    if is_main:
        if cfg.checkpoint.final_weights:
            from safetensors.torch import save_model  # handles tied weights (GPT's embedding/head)

            save_model(bundle.model, str(run_dir / "model.safetensors"))
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return summary


def summarize(state: TrainState, n_params: int, total_s: float) -> dict:
    h, items = state.history, state.bundle.items_name
    speeds = [m[f"{items}_per_s"] for m in h[1:]] or [m[f"{items}_per_s"] for m in h]  # step 1 warms up
    vals = [m for m in h if "val_loss" in m]
    dims = state.plan.dims
    return {
        "model": state.cfg.model.name,
        "parameters": n_params,
        "world_size": dims.world_size, "dp": dims.dp, "tp": dims.tp, "pp": dims.pp,
        "steps": h[-1]["step"] if h else 0,
        "final_loss": h[-1]["loss"] if h else None,
        "best_loss": min(m["loss"] for m in h) if h else None,
        **({k: v for k, v in vals[-1].items() if k.startswith("val_")} if vals else {}),
        "best_val_loss": min(m["val_loss"] for m in vals) if vals else None,
        f"mean_{items}_per_s": statistics.fmean(speeds) if speeds else None,
        "median_step_time_s": statistics.median(m["step_time_s"] for m in h) if h else None,
        "peak_memory_bytes": max((m.get("peak_memory_bytes", 0) for m in h), default=0),
        "total_time_s": total_s,
    }
