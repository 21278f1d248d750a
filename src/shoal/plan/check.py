"""`shoal plan --check RUN_DIR`: a finished run against the prediction for its own layout. The run's
summary.json holds median_step_time_s and memory_per_rank (params, grads, optimizer, peak per rank,
metrics/memory.py); the largest rank of each is compared with the prediction, which is of the largest.
A Session's run (its own loop) is predicted from the models the Session recorded: model state only."""

from __future__ import annotations

import json
from pathlib import Path

from shoal.config import load_config
from shoal.errors import UserError
from shoal.hardware import HardwareProfile
from shoal.layout import resolve_layout
from shoal.plan.cost import MicroBatchCost, Ops
from shoal.plan.planner import predict_config
from shoal.plan.predict import ModelShape, predict_memory
from shoal.rundir import RunDir

KINDS = ("params", "grads", "optimizer", "peak")
BREAKDOWN = ("activations", "buffers", "working")  # predicted terms of the peak that no run measures apart


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
    per_rank = summary.get("memory_per_rank") or []
    if run.session_models.is_file():
        memory = session_state(json.loads(run.session_models.read_text()), cfg, summary["world_size"])
        step_time = None
    else:
        gpu = profile is not None and profile.device == "cuda"
        pred = predict_config(cfg, summary["world_size"], profile, cuda=gpu)
        memory, step_time = pred.memory, pred.step_time
    rows = []
    if profile is not None:
        rows.append(("step time (s)", step_time, summary.get("median_step_time_s"),
                     relative_error(step_time, summary.get("median_step_time_s"))))
    return rows + memory_rows(memory, per_rank)


def memory_rows(memory: dict, per_rank: list[dict]) -> list[tuple]:
    """Each memory term predicted, against the largest rank's measurement where a run measures it: the model
    state, the peak's other terms (predicted only), the peak, and on a GPU what the device holds beyond it
    (the allocator's reserve, the context and NCCL outside the allocator, the total: metrics/memory.py)."""
    rows = []

    def row(name: str, predicted, fn=None) -> None:
        measured = max((fn(r) for r in per_rank), default=None) if fn else None
        rows.append((f"{name} (bytes)", predicted, measured, relative_error(predicted, measured)))

    for kind in KINDS[:3]:
        row(kind, memory.get(kind), lambda r, kind=kind: r[kind])
    for kind in BREAKDOWN:
        if kind in memory:
            row(kind, memory[kind])
    row("peak", memory.get("peak"), lambda r: r["peak"])
    if "device" in memory:
        gpu = bool(per_rank) and all("reserved" in r for r in per_rank)  # a run on a GPU measured these
        row("reserve", memory["reserve"], (lambda r: r["reserved"] - r["peak"]) if gpu else None)
        row("context + nccl", memory["context"] + memory["nccl"], (lambda r: r["outside"]) if gpu else None)
        row("device", memory["device"], (lambda r: r["reserved"] + r["outside"]) if gpu else None)
    state_pred = None if None in (memory.get(k) for k in KINDS[:3]) else sum(memory[k] for k in KINDS[:3])
    row("model state", state_pred, lambda r: sum(r[k] for k in KINDS[:3]))
    return rows


def is_session_run(run_dir: str | Path) -> bool:
    return RunDir(Path(run_dir)).session_models.is_file()


# optimizers whose state the planner sizes, by class: (its name in train.optimizer, has moments)
_OPTIMIZERS = {"AdamW": "adamw", "Adam": "adamw", "SGD": "sgd"}


def session_state(models: list[dict], cfg, world: int) -> dict[str, int | None]:
    """Predicted model-state bytes (params, grads, optimizer) of a Session's run from the models it
    recorded (training/session.py). A Session's forward and loss are the script's own, which the planner
    cannot trace as it traces the models it builds from a config: its activations, peak and step time
    are not predicted (shown as ?)."""
    layout = resolve_layout(cfg, world, cuda=False)
    none = MicroBatchCost(layout.micro_batch, Ops(), 0.0, 0, [], [], 0)
    total: dict[str, int | None] = {"params": 0, "grads": 0, "optimizer": 0}
    for m in models:
        shape = ModelShape([tuple(p) for p in m["params"]], [[tuple(p) for p in b] for b in m["blocks"]])
        optimizer = _OPTIMIZERS.get(m["optimizer"])
        mem = predict_memory(shape, shape.params, none, layout, optimizer=optimizer or "sgd", momentum=m["momentum"],
                             checkpointing=False, schedule=cfg.parallel.pp_schedule, profile=None, stage_fraction=1.0)
        for kind in total:
            unknown = total[kind] is None or (kind == "optimizer" and optimizer is None)
            total[kind] = None if unknown else total[kind] + mem[kind]
    return total
