"""Resuming: which checkpoint, whether it fits this config, and restoring everything but the tensors'
layout (which DCP reshards).

`--resume auto` takes the newest checkpoint whose manifest verifies; a corrupt or truncated one is
reported in one line and the one before it is used. `never` starts fresh; a path must verify.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

from shoal.checkpoint import manifest as mf
from shoal.checkpoint.state import CHECKPOINT_FORMAT, TRAIN_STATE, read_json, restore_rng, rng_file, saved_config
from shoal.config import Config
from shoal.errors import UserError

# keys that must match for the checkpoint to be this run: the model's shape, and what decides the data
MUST_MATCH = ("data.source", "data.path", "data.max_bytes", "data.val_fraction", "train.seed")


def find_resume_point(run_dir: Path, resume: str, quiet: bool = False) -> Path | None:
    """The checkpoint folder to resume from, or None to start fresh (decided by rank 0)."""
    if resume == "never":
        return None
    if resume != "auto":
        path = Path(resume)
        problem = mf.verify(path) if path.is_dir() else "not a folder"
        if problem:
            raise UserError(f"--resume {resume}: not a usable checkpoint: {problem}; pick another or use --resume auto")
        return path
    for ckpt in reversed(mf.list_checkpoints(run_dir / "checkpoints")):
        if ckpt.valid:
            return ckpt.path
        if not quiet:
            print(f"shoal: checkpoint {ckpt.path} is unusable ({ckpt.problem}); trying the one before it",
                  file=sys.stderr, flush=True)
    return None


def check_run_dir(run_dir: Path, cfg: Config, n_params: int) -> None:
    """Fail at start, not after an hour of training, when results could not be written."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".shoal-write-test-{os.getpid()}"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as e:
        raise UserError(f"run dir {run_dir} is not writable ({e.strerror or e}); pass a writable --run-dir") from None
    # weights + two AdamW moments in fp32, for each kept checkpoint and the one being written
    ckpt = n_params * 4 * 3 * (cfg.checkpoint.keep + 1) if cfg.checkpoint.enabled else 0
    need = ckpt + n_params * 4 * cfg.checkpoint.final_weights
    free = shutil.disk_usage(run_dir).free
    if free < need:
        raise UserError(
            f"run dir {run_dir} has {free / 2**20:.0f} MiB free, but this run needs about {need / 2**20:.0f} MiB "
            f"({cfg.checkpoint.keep} checkpoints kept + 1 being written, {n_params:,} parameters with AdamW state); "
            f"free space, lower checkpoint.keep or pass another --run-dir")


def check_compatible(cfg: Config, path: Path) -> dict:
    """The checkpoint's train state, after checking that its config describes this model and data."""
    state = read_json(path / TRAIN_STATE)
    if state.get("format", 1) != CHECKPOINT_FORMAT:
        raise UserError(f"checkpoint {path} is in checkpoint format {state.get('format', 1)}, written by another "
                        f"version of shoal; this one reads format {CHECKPOINT_FORMAT}: resume it with the version that "
                        f"wrote it, or start fresh with --resume never or another --run-dir")
    saved = saved_config(state, f"{path}/{TRAIN_STATE}")
    for key in [f"model.{k}" for k in type(cfg.model).model_fields] + list(MUST_MATCH):
        section, name = key.split(".")
        ours, theirs = getattr(getattr(cfg, section), name, None), getattr(getattr(saved, section), name, None)
        if ours != theirs:
            raise UserError(
                f"{key} is {ours!r} here but {theirs!r} in checkpoint {path.name}; set {key} = {theirs!r} to resume "
                f"it, or start fresh with --resume never or another --run-dir"
            )
    return state


def restore_rng_for(path: Path, rank: int, world_size: int, seed: int, step: int) -> bool:
    """This rank's RNG streams as saved, when the world size is unchanged (True). After a resize
    there is no saved stream for a new rank: all ranks reseed from (seed, rank, step) instead (False)."""
    manifest = mf.read_manifest(path)
    if manifest["world_size"] == world_size:
        restore_rng(read_json(path / rng_file(rank)))
        return True
    mixed = int(np.random.SeedSequence([seed, rank, step]).generate_state(1)[0])
    random.seed(mixed)
    np.random.seed(mixed)
    torch.manual_seed(mixed)
    return False
