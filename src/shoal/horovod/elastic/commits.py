"""Where TorchState's commits live, so that they outlive the processes that made them.

Horovod keeps a commit in the memory of the processes that survive a failure. Under shoal's launcher
no process survives one: `shoal run --max-restarts N` starts the whole job again, and each process
finds its commit on disk. A commit is one file per process, `rank<r>-state<i>.pt` (the i-th
TorchState the script made), in a folder of its own launch: the first process to commit proposes a
new folder through the launcher's store (which lives as long as the launch, across restarts), and the
others take that one. A new run of the same command gets a new folder, so an old run's commit is
never resumed by mistake. The folder is under the system's temporary directory, or under
SHOAL_HOROVOD_STATE_DIR (a filesystem every node shares, say).

A commit is written to a temporary name and renamed (a process killed while writing leaves the last
commit whole), with torch.save, and read with torch.load(weights_only=True): tensors, numbers,
strings and containers of them, nothing that runs code when unpickled.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from shoal.errors import UserError

KEY = "shoal/horovod/commit_folder"
PLAIN = (type(None), bool, int, float, str, bytes)


def launch_folder() -> Path | None:
    """This launch's folder, the same in every attempt; None when no launcher can restart this process."""
    env = os.environ
    if not all(k in env for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")):
        return None
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    root = Path(env.get("SHOAL_HOROVOD_STATE_DIR") or Path(tempfile.gettempdir()) / "shoal-horovod")
    return Path(store.compare_set(KEY, "", str(root / uuid.uuid4().hex)).decode())


def storable(x, where: str):
    """`x` as a commit keeps it: numpy numbers become Python numbers; anything torch.load(weights_only=True)
    could not read back is refused here, at the commit, naming where it is."""
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, PLAIN) or isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (list, tuple)):
        return type(x)(storable(v, f"{where}[{i}]") for i, v in enumerate(x))
    if isinstance(x, dict):
        return {k: storable(v, f"{where}[{k!r}]") for k, v in x.items()}
    raise UserError(f"TorchState: {where} is a {type(x).__name__}; a commit keeps tensors, numbers, strings, None and "
                    f"lists, tuples and dicts of them (kept on disk, read back without unpickling code)")


def write(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def read(path: Path) -> dict | None:
    return torch.load(path, weights_only=True) if path.is_file() else None


def forget(path: Path) -> None:
    """Remove a commit once the function it protected has returned (and its folder, once empty)."""
    path.unlink(missing_ok=True)
    try:
        path.parent.rmdir()
    except OSError:
        pass  # another process's commit is still there
