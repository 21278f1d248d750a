"""Resuming: which checkpoint, and whether it fits this config.

`--resume auto` takes the newest checkpoint whose manifest verifies; a corrupt or truncated one is
reported in one line and the one before it is used. `never` starts fresh; a path must verify.
"""

from __future__ import annotations

import sys
from pathlib import Path

from shoal.checkpoint import manifest as mf
from shoal.checkpoint.train_state import TRAIN_STATE, read_train_state, saved_config
from shoal.config import CheckpointConfig, Config
from shoal.errors import UserError

# keys that must match for the checkpoint to be this run: the model's shape, and what decides the data
MUST_MATCH = ("data.source", "data.path", "data.max_bytes", "data.val_fraction", "train.seed")


def find_resume_point(checkpoints: Path, resume: str, quiet: bool = False) -> Path | None:
    """The checkpoint folder to resume from, or None to start fresh."""
    if resume == "never":
        return None
    if resume != "auto":
        path = Path(resume)
        problem = mf.verify(path) if path.is_dir() else "not a folder"
        if problem:
            raise UserError(f"--resume {resume}: not a usable checkpoint: {problem}; pick another or use --resume auto")
        return path
    for ckpt in reversed(mf.list_checkpoints(checkpoints)):
        if ckpt.valid:
            return ckpt.path
        if not quiet:
            print(f"shoal: checkpoint {ckpt.path} is unusable ({ckpt.problem}); trying the one before it",
                  file=sys.stderr, flush=True)
    return None


def newest_valid(checkpoints: Path) -> Path | None:
    valid = [c for c in mf.list_checkpoints(checkpoints) if c.valid]
    return valid[-1].path if valid else None


def check_compatible(cfg: Config, path: Path, keys: tuple[str, ...] | None = None,
                     fresh: str = "--resume never or another --run-dir") -> dict:
    """The checkpoint's train state, after checking that its config describes this run: its `keys` match
    (None: every model.* key and MUST_MATCH's). `fresh`: how the refusal says to start over instead."""
    state = read_train_state(path)
    served = state["parts"].get("parameter_server", {}).get("mode") == "async"
    if served and not (cfg.sync.mode == "parameter-server" and cfg.ps.mode == "async"):
        raise UserError(f"checkpoint {path.name} was written by asynchronous parameter servers (it has no data "
                        f'position of the workers\' kind); resume it with ps.mode = "async", or start fresh '
                        f"with --resume never or another --run-dir")
    saved = saved_config(state, f"{path}/{TRAIN_STATE}")
    for key in keys if keys is not None else [f"model.{k}" for k in type(cfg.model).model_fields] + list(MUST_MATCH):
        section, name = key.split(".")
        ours, theirs = getattr(getattr(cfg, section), name, None), getattr(getattr(saved, section), name, None)
        if ours != theirs:
            raise UserError(
                f"{key} is {ours!r} here but {theirs!r} in checkpoint {path.name}; set {key} = {theirs!r} to resume "
                f"it, or start fresh with {fresh}"
            )
    return state


def checkpoint_bytes(cfg: CheckpointConfig, n_params: int) -> int:
    """Disk a run needs: weights + two AdamW moments in fp32, for each kept checkpoint and the one
    being written, and the final weights."""
    ckpt = n_params * 4 * 3 * (cfg.keep + 1) if cfg.enabled else 0
    return ckpt + n_params * 4 * cfg.final_weights
