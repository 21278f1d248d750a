"""Offline tools on a run's checkpoints, in one process and without a process group: list them, and
export one as a single safetensors file of consolidated model weights (no pickle), loadable into the
single-process model with `safetensors.torch.load_model`."""

from __future__ import annotations

import datetime
import shutil
import warnings
from pathlib import Path

import torch.distributed.checkpoint as dcp

from shoal.checkpoint import manifest as mf
from shoal.checkpoint.safe_io import SafeFileSystemReader, SafeLoadPlanner
from shoal.checkpoint.train_state import TRAIN_STATE, read_train_state, saved_config
from shoal.errors import UserError
from shoal.models.registry import build_model
from shoal.models.spec import DataSpec
from shoal.rundir import RunDir


def checkpoints_of(run_dir: Path) -> list[mf.CheckpointInfo]:
    if not run_dir.is_dir():
        raise UserError(f"run dir {run_dir} does not exist")
    return mf.list_checkpoints(RunDir(run_dir).checkpoints)


def table_rows(run_dir: Path) -> list[tuple[str, ...]]:
    """(step, world size, size, saved at, status) per checkpoint, oldest first."""
    rows = []
    for c in checkpoints_of(run_dir):
        m = c.manifest or {}
        when = datetime.datetime.fromtimestamp(m["time"]).strftime("%Y-%m-%d %H:%M:%S") if "time" in m else "-"
        rows.append((str(c.step), str(m.get("world_size", "-")), f"{c.bytes / 2**20:.1f} MiB", when,
                     "valid" if c.valid else f"INVALID: {c.problem}"))
    return rows


def load_saved_model(run_dir: Path, step: int | None = None):
    """The model as checkpointed in `run_dir` (the newest valid checkpoint, or the one at `step`), in
    one process: (checkpoint, its config, the model with the saved weights)."""
    found = checkpoints_of(run_dir)
    if step is not None:
        found = [c for c in found if c.step == step]
        if not found:
            raise UserError(f"{run_dir} has no checkpoint at step {step}; `shoal checkpoints {run_dir}` lists them")
    valid = [c for c in found if c.valid]
    if not valid:
        what = f"at step {step}" if step is not None else "at all"
        problem = f" ({found[-1].problem})" if found else ""
        raise UserError(f"{run_dir} has no valid checkpoint {what}{problem}")
    ckpt = valid[-1]
    train_state = read_train_state(ckpt.path)
    cfg = saved_config(train_state, f"{ckpt.path}/{TRAIN_STATE}")
    bundle = build_model(cfg.model, DataSpec(**train_state["data_spec"]))
    state = {"model": bundle.model.state_dict()}
    with warnings.catch_warnings():  # DCP warns that it loads without a process group: that is the intent
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=SafeFileSystemReader(ckpt.path), planner=SafeLoadPlanner(), no_dist=True)
    bundle.model.load_state_dict(state["model"])
    return ckpt, cfg, bundle.model


def export_weights(run_dir: Path, out: Path, step: int | None = None) -> mf.CheckpointInfo:
    """One safetensors file, loadable into the one-process model with `safetensors.torch.load_model`."""
    from safetensors.torch import save_model

    ckpt, _, model = load_saved_model(run_dir, step)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_model(model, str(out))
    return ckpt


def export_hf(run_dir: Path, out: Path, step: int | None = None) -> mf.CheckpointInfo:
    """A Hugging Face directory (config.json, model.safetensors; LoRA adapters merged) that
    `from_pretrained` loads, plus the run's tokenizer when it used one (data.tokenizer)."""
    from shoal.models.hf import save_pretrained

    ckpt, cfg, model = load_saved_model(run_dir, step)
    if cfg.model.name != "hf":
        raise UserError(f'--format hf exports model.name = "hf" runs; this run trained "{cfg.model.name}": use '
                        f"--format safetensors")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} exists and is not an empty directory; name a new directory")
    save_pretrained(model, out)
    tokenizer = Path(cfg.data.tokenizer).expanduser() if getattr(cfg.data, "tokenizer", None) else None
    if tokenizer is not None and tokenizer.exists():  # a tokenizer.json, or the files of a tokenizer folder
        files = [tokenizer] if tokenizer.is_file() else [f for f in tokenizer.iterdir() if f.is_file()]
        for f in files:
            if f.name != "config.json":  # the model's, written above
                shutil.copy2(f, out / f.name)
    return ckpt
