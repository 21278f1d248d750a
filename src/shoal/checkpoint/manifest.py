"""Checkpoint manifests: what makes a folder of files a checkpoint.

[Note: atomic checkpoints] A checkpoint is written into `step_<step:08d>.tmp/`; when every rank's files
are there, rank 0 writes `manifest.json` (size and SHA-256 of every file) last, fsyncs, and renames
the folder to `step_<step:08d>/`. A folder without a manifest, or whose files do not match it, is not a
checkpoint: a crash at any moment leaves either the previous checkpoints or a complete new one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "manifest.json"
FORMAT = 1
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _hash_all(paths: list[Path]) -> list[str]:
    # hashlib releases the GIL on large buffers: shards hash in parallel (SHA-256 runs ~1.8 GB/s a core here)
    with ThreadPoolExecutor(max_workers=min(len(paths), os.cpu_count() or 1) or 1) as pool:
        return list(pool.map(_sha256, paths))


def write_manifest(folder: Path, info: dict) -> dict:
    """Checksum every file in `folder`, write the manifest last, fsync files and folder."""
    paths = [p for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST]
    for p in paths:
        _fsync(p)
    files = {p.name: {"bytes": p.stat().st_size, "sha256": h} for p, h in zip(paths, _hash_all(paths), strict=True)}
    manifest = {"format": FORMAT, **info, "files": files}
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    _fsync(tmp)
    tmp.rename(folder / MANIFEST)
    _fsync(folder)
    return manifest


def finalize(tmp_folder: Path, final: Path, info: dict) -> dict:
    """Manifest, then the atomic rename that makes the checkpoint exist ([Note: atomic checkpoints])."""
    manifest = write_manifest(tmp_folder, info)
    tmp_folder.rename(final)
    _fsync(final.parent)
    return manifest


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    manifest: dict | None
    problem: str | None  # why it is not a usable checkpoint; None when valid

    @property
    def valid(self) -> bool:
        return self.problem is None

    @property
    def bytes(self) -> int:
        return sum(f.stat().st_size for f in self.path.iterdir() if f.is_file())


def verify(folder: Path, deep: bool = True) -> str | None:
    """None when `folder` is a complete checkpoint; otherwise one phrase saying what is wrong."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return "no manifest (the save did not finish)"
    except (OSError, ValueError) as e:
        return f"unreadable manifest ({e})"
    if manifest.get("format") != FORMAT:
        return f"manifest format {manifest.get('format')!r}, expected {FORMAT}"
    files = manifest.get("files", {})
    for name, want in files.items():
        p = folder / name
        if not p.is_file():
            return f"{name} is missing"
        if p.stat().st_size != want["bytes"]:
            return f"{name} has {p.stat().st_size} bytes, the manifest says {want['bytes']}"
    if deep:
        names = list(files)
        for name, digest in zip(names, _hash_all([folder / n for n in names]), strict=True):
            if digest != files[name]["sha256"]:
                return f"{name} does not match its checksum"
    return None


def read_manifest(folder: Path) -> dict:
    return json.loads((folder / MANIFEST).read_text(encoding="utf-8"))


def list_checkpoints(root: Path, deep: bool = True) -> list[CheckpointInfo]:
    """Every `step_*` folder under `root`, oldest first, each verified."""
    out = []
    if root.is_dir():
        for p in root.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and p.is_dir():
                problem = verify(p, deep)
                out.append(CheckpointInfo(p, int(m.group(1)), None if problem else read_manifest(p), problem))
    return sorted(out, key=lambda c: c.step)
