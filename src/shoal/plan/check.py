"""`shoal plan --check RUN_DIR`: a finished run against the prediction for its own layout. The run's
summary.json holds median_step_time_s and memory_per_rank (params, grads, optimizer, peak per rank,
metrics/memory.py); the largest rank of each is compared with the prediction, which is of the largest."""

from __future__ import annotations

import json
from pathlib import Path

from shoal.config import load_config
from shoal.errors import UserError
from shoal.hardware import HardwareProfile
from shoal.plan.planner import predict_config
from shoal.rundir import RunDir

KINDS = ("params", "grads", "optimizer", "peak")


def relative_error(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or not measured:
        return None
    return (predicted - measured) / measured


def check_run(run_dir: str | Path, profile: HardwareProfile | None) -> list[tuple[str, float | None, float | None,
                                                                                   float | None]]:
    """[(quantity, predicted, measured, relative error), ...]."""
    run = RunDir(Path(run_dir))
    config = run.config
    if not run.summary.is_file() or not config.is_file():
        raise UserError(f"{run_dir} is not a finished run dir (it needs summary.json and config.toml); give the "
                        f"--run-dir of a run that ended")
    summary = json.loads(run.summary.read_text())
    cfg = load_config(config, stored=True)  # written by the run: keys that moved since are moved
    pred = predict_config(cfg, summary["world_size"], profile, cuda=False)
    per_rank = summary.get("memory_per_rank") or []
    rows = []
    if profile is not None:
        rows.append(("step time (s)", pred.step_time, summary.get("median_step_time_s"),
                     relative_error(pred.step_time, summary.get("median_step_time_s"))))
    for kind in KINDS:
        measured = max((r[kind] for r in per_rank), default=None)
        rows.append((f"{kind} (bytes)", pred.memory[kind], measured, relative_error(pred.memory[kind], measured)))
    state_measured = max((sum(r[k] for k in KINDS[:3]) for r in per_rank), default=None)
    state_pred = sum(pred.memory[k] for k in KINDS[:3])
    rows.append(("model state (bytes)", state_pred, state_measured, relative_error(state_pred, state_measured)))
    return rows
