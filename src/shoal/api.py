"""`shoal.train(...)`: the `shoal train` command from a script or a notebook.

The same path as the command: the config validated here (a bad value raises `shoal.UserError` with
the command's one-line message), the same preflight, and workers started by the same torch elastic
launch (separate processes: a notebook's own state never reaches them). A builder may be passed as an
importable callable where the config names one as a string ("module:function", e.g. model.name);
workers import it by that name, so it must live at a module's top level.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from shoal.config.literals import overrides_as_sets
from shoal.errors import TrainingError


def train(config: str | Path | None = None, overrides: Mapping[str, object] | None = None, nproc: int | None = None,
          run_dir: str | Path | None = None, resume: str = "auto", max_restarts: int = 0, ray: str | None = None,
          nnodes: int | None = None) -> dict:
    """Train as `shoal train CONFIG --nproc N --set KEY=VALUE ...` would; returns the run's summary
    (summary.json). `nproc` None: as the command without --nproc (one per GPU of this node, 1 without GPUs,
    or what a scheduler's environment says: launch/environment.py). `ray`: a Ray cluster's address ("auto":
    the one this machine belongs to), as --ray: one node per Ray node (`nnodes` of them, default every node),
    the run dir on a path they share. Raises UserError for a bad config or arguments, TrainingError if the run fails."""
    from shoal.cli import build_parser
    from shoal.cli.train import train as train_command
    from shoal.config import load_config
    from shoal.rundir import default_run_dir

    sets = overrides_as_sets(overrides)
    argv = ["train", *([str(config)] if config is not None else []), *[a for s in sets for a in ("--set", s)],
            *(["--nproc", str(nproc)] if nproc is not None else []), "--resume", resume,
            "--max-restarts", str(max_restarts), *(["--ray", ray] if ray is not None else []),
            *(["--nnodes", str(nnodes)] if nnodes is not None else [])]
    cfg = load_config(config, sets)  # raises the command's UserError
    where = Path(run_dir) if run_dir is not None else default_run_dir(str(config) if config else None, cfg)
    argv += ["--run-dir", str(where)]
    args = build_parser().parse_args(argv)
    args.argv = argv
    args.fresh_workers = True  # the caller's __main__ may be a script without a main guard (launch/restart.py)
    saved = dict(os.environ)  # the launch sets variables for its workers; leave the caller's as they were
    try:
        code = train_command(args)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    summary = where / "summary.json"
    if code != 0 or not summary.exists():
        raise TrainingError(f"training failed (exit code {code}); its output is above, its run dir {where}")
    return json.loads(summary.read_text())
