"""The run directory: where one training run keeps everything, the names of its files, and where it
is when the user does not say.

[Note: stable run dir] Without --run-dir a run goes to runs/<config stem>-<digest>, the digest taken
over what the config trains (model, data, optimisation; not the layout, the number format, the
checkpoint and metrics settings, nor train.steps). Running the same command again therefore finds
the same directory and continues from its newest checkpoint, as a scheduler's requeue (Slurm
--requeue, a Kubernetes pod restart, a spot replacement) expects; resuming on another layout or
world size, or for more steps, finds it too. `--resume never` starts over: the earlier run's files
are moved aside first, never deleted.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from shoal.config import LAYOUT_KEYS, LAYOUT_SECTIONS, Config
from shoal.errors import UserError

# train keys a run may change and still be the same run (more steps, other validation cadence)
CONTINUATION_KEYS = {"train.steps", "train.val_interval", "train.val_batches"}


@dataclass(frozen=True)
class RunDir:
    """The files of a run directory (rank 0 writes them)."""

    path: Path

    @property
    def config(self) -> Path:  # the resolved config, every default written out
        return self.path / "config.toml"

    @property
    def metrics(self) -> Path:  # one JSON object per logged step
        return self.path / "metrics.jsonl"

    @property
    def tensorboard(self) -> Path:
        return self.path / "tensorboard"

    @property
    def checkpoints(self) -> Path:  # step_<step:08d>/ folders
        return self.path / "checkpoints"

    @property
    def weights(self) -> Path:  # the final model, safetensors
        return self.path / "model.safetensors"

    @property
    def summary(self) -> Path:
        return self.path / "summary.json"

    @property
    def traces(self) -> Path:  # metrics.trace_steps: torch.profiler traces, one file per rank
        return self.path / "traces"

    @property
    def progress(self) -> Path:  # heartbeat: the last completed step and its time
        return self.path / "progress.json"

    @property
    def recoveries(self) -> Path:  # every recovery from a failure so far, across restarts
        return self.path / "recoveries.json"

    @property
    def session_models(self) -> Path:  # a Session's prepared models as the planner reads them (--check)
        return self.path / "session_models.json"


def run_identity(cfg: Config) -> dict:
    """What the config trains: the keys that make two configs the same training run."""
    out = {}
    for section, values in cfg.model_dump(by_alias=True).items():
        if section in LAYOUT_SECTIONS or not isinstance(values, dict):
            continue
        out[section] = {k: v for k, v in values.items()
                        if f"{section}.{k}" not in LAYOUT_KEYS | CONTINUATION_KEYS}
    return out


def default_run_dir(config_path: str | None, cfg: Config, root: Path = Path("runs")) -> Path:
    """runs/<config stem>-<digest of run_identity> ([Note: stable run dir])."""
    stem = Path(config_path).stem if config_path else "run"
    digest = hashlib.sha256(json.dumps(run_identity(cfg), sort_keys=True).encode()).hexdigest()[:8]
    return root / f"{stem}-{digest}"


def holds_a_run(path: Path) -> bool:
    return path.is_dir() and any(not p.name.startswith(".shoal-write-test") for p in path.iterdir())


def move_aside(path: Path) -> Path:
    """Move an earlier run out of the way for a fresh start (--resume never); returns where it went."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target, n = path.with_name(f"{path.name}-replaced-{stamp}"), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}-replaced-{stamp}-{n}")
    path.rename(target)
    return target


def choose_run_dir(given: str | None, config_path: str | None, cfg: Config, resume: str, first_attempt: bool) -> Path:
    """The run dir: the one given, or the stable default ([Note: stable run dir] in rundir.py). A fresh
    start (--resume never) over an earlier run moves that run aside first; a restarted attempt of the
    same job never does."""
    path = Path(given) if given else default_run_dir(config_path, cfg)
    if resume == "never" and first_attempt and holds_a_run(path):
        moved = move_aside(path)
        print(f"shoal: --resume never: the earlier run in {path} was moved to {moved}", file=sys.stderr, flush=True)
    return path


def check_writable(path: Path, need_bytes: int, what: str) -> None:
    """Fail at start, not after an hour of training, when results could not be written."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".shoal-write-test-{os.getpid()}"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as e:
        raise UserError(f"run dir {path} is not writable ({e.strerror or e}); pass a writable --run-dir") from None
    free = shutil.disk_usage(path).free
    if free < need_bytes:
        raise UserError(f"run dir {path} has {free / 2**20:.0f} MiB free, but this run needs about "
                        f"{need_bytes / 2**20:.0f} MiB ({what}); free space, lower checkpoint.keep or pass another "
                        f"--run-dir")


def write_json(path: Path, obj) -> None:
    """Write through a temporary file and a rename: a reader never sees half a file."""
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj), encoding="utf-8")
    tmp.replace(path)


class Heartbeat:
    """A small JSON record (progress.json) rewritten in place through one open file: each write lays the new
    record over the old one, padded with spaces to the file's length (still one JSON value). On ext4 that is
    6 us a write, against 250 for a new file and a rename, paid on every logged step. A process killed mid-run
    has made its writes whole (each is one system call), so a later attempt reads a whole record; a reader
    that polls while the run writes (a test, a user's script) could in principle catch a write half done,
    and read_json then answers its default, as for a missing file. The file is opened at the first write,
    without truncating it: until then it says what the attempt before wrote."""

    def __init__(self, path: Path):
        self.path, self._fd, self._size = path, None, 0

    def write(self, obj) -> None:
        data = json.dumps(obj).encode()
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
            self._size = os.fstat(self._fd).st_size
        os.pwrite(self._fd, data.ljust(self._size), 0)
        self._size = max(self._size, len(data))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self):
        self.close()


_REQUIRED = object()


def read_json(path: Path, default=_REQUIRED):
    """The file's JSON; `default` instead when it is missing or unreadable, if one is given."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        if default is _REQUIRED:
            raise
        return default


def read_metrics(path: Path) -> list[dict]:
    """metrics.jsonl's records. A last line cut short (a run being written, or killed mid-write) is left
    out; a bad line before it means the file is damaged."""
    rows, lines = [], path.read_text(encoding="utf-8").splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError:
            if n == len(lines):
                break
            raise UserError(f"{path} line {n} is not JSON; the file is damaged") from None
    return rows
