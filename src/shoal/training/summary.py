"""summary.json: what a run achieved and what it cost, and the accounting of recoveries from failures
(each restart's lost seconds, broken down), kept in recoveries.json across restarts."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from shoal.clock import started_at
from shoal.rundir import RunDir, read_json, write_json
from shoal.topology import ParallelDims


def failure_info(run: RunDir, restart_count: int) -> dict:
    """What the heartbeat says about the failure this attempt recovers from."""
    progress = read_json(run.progress, {})
    return {"restart": restart_count, "failed_after_step": progress.get("step"), "failed_at": progress.get("time")}


def fresh_start(run: RunDir, restart_count: int) -> dict | None:
    """The recovery record of an attempt that found no checkpoint (None: not a recovery at all)."""
    if not restart_count:
        return None
    return {"checkpoint": None, "resumed_from_step": 0, "restore_s": 0.0, "restore_started_at": time.time(),
            **failure_info(run, restart_count)}


def summarize(record, items: str, *, model_name: str, n_params: int, dims: ParallelDims, total_s: float,
              restart_count: int, recovery: dict | None, run: RunDir, is_main: bool, bad_steps: dict,
              start_step: int) -> dict:
    """summary.json from the loop's record (loop.py: per-step metrics, memory per rank, the validation
    before step 1). `items`: "tokens" or "samples"; `recovery`: what restore() said (None: a fresh start)."""
    history = record.history
    speeds = [m[f"{items}_per_s"] for m in history[1:]] or [m[f"{items}_per_s"] for m in history]  # 1st warms up
    vals = [m for m in history if "val_loss" in m]
    recoveries = read_json(run.recoveries, [])
    if recovery and history:
        # time lost to the failure: from the last step completed before it to the first step after it
        first = history[0]["time"]
        recovery = {**recovery, "steps_redone": (recovery["failed_after_step"] or 0) - recovery["resumed_from_step"],
                    "seconds_lost": first - recovery["failed_at"] if recovery["failed_at"] else None,
                    "breakdown_s": recovery_breakdown(recovery, first)}
        recoveries.append(recovery)
        if is_main:
            write_json(run.recoveries, recoveries)
    h = history
    return {
        "model": model_name,
        "parameters": n_params,
        "world_size": dims.world_size, "dp": dims.dp, "tp": dims.tp, "pp": dims.pp,
        "steps": h[-1]["step"] if h else start_step,
        "final_loss": h[-1]["loss"] if h else None,
        "best_loss": min(m["loss"] for m in h) if h else None,
        **({k: v for k, v in vals[-1].items() if k.startswith("val_")} if vals else {}),
        "best_val_loss": min(m["val_loss"] for m in vals) if vals else None,
        f"mean_{items}_per_s": statistics.fmean(speeds) if speeds else None,
        "median_step_time_s": statistics.median(m["step_time_s"] for m in h) if h else None,
        "peak_memory_bytes": max((m.get("peak_memory_bytes", 0) for m in h), default=0),
        **host_syncs(h),
        # bytes rank 0 sent to keep the dp replicas in sync (gradients or parameter averages), per step
        "comm_bytes": statistics.fmean(m["comm_bytes"] for m in h) if h else None,
        "total_time_s": total_s,
        "bad_steps": bad_steps["total"],
        "rollbacks": bad_steps["rollbacks"],
        "restarts": restart_count,
        "recoveries": recoveries,
        "memory_per_rank": record.memory_per_rank,
        **{f"initial_{k}": v for k, v in record.initial_val.items()},
    }


def host_syncs(history: list[dict]) -> dict:
    """metrics.host_syncs: the median per step after the first (which compiles, or infers a pipeline's
    shapes) and the first step's own; nothing when not counted."""
    counts = [m["host_syncs"] for m in history if "host_syncs" in m]
    if not counts:
        return {}
    return {"host_syncs_per_step": statistics.median(counts[1:] or counts), "host_syncs_first_step": counts[0]}


def recovery_breakdown(recovery: dict, first_step_at: float) -> dict:
    """Where a recovery's seconds went: until this process started (failure detection, stopping the
    old workers, spawning), its start-up (imports, rendezvous, model), the restore, the first step."""
    restored_at = recovery["restore_started_at"] + recovery["restore_s"]
    started = started_at()
    return {"respawn": started - recovery["failed_at"] if recovery["failed_at"] else None,
            "startup": recovery["restore_started_at"] - started,
            "restore": recovery["restore_s"],
            "first_step": first_step_at - restored_at}


def finished_message(run_dir, step: int, steps: int) -> str:
    return (f"{run_dir} already holds this run, finished at step {step} of train.steps = {steps}: nothing to "
            f"train (raise train.steps to train on, or --resume never to start over); results in {run_dir}/")


def say_done(summary: dict, path: Path, steps: int, reports: bool) -> None:
    """The run's last line, on the rank that `reports` (train.steps = `steps`)."""
    if reports and summary.get("already_finished"):
        print(finished_message(path, summary["steps"], steps), flush=True)
    elif reports:
        val = f", val loss {summary['val_loss']:.4f}" if summary.get("val_loss") is not None else ""
        loss = f"{summary['final_loss']:.4f}" if summary.get("final_loss") is not None else "-"
        print(f"done: {summary['steps']} steps in {summary['total_time_s']:.1f} s; final loss {loss}{val}\n"
              f"results in {path}/ (summary.json, metrics.jsonl, config.toml, checkpoints/, tensorboard/)", flush=True)
