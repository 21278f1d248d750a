"""The commands a cluster is made with (`ip`, `tc`), and what they need: root and iproute2."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from shoal.errors import UserError


def require_root(action: str, tools: tuple[str, ...] = ("ip", "tc")) -> None:
    """Refuse in one line when this process cannot make namespaces, links, qdiscs and cgroups."""
    if os.geteuid() != 0:
        raise UserError(f"shoal cluster {action} needs root (network namespaces, tc and cgroups are root-only): "
                        f"run it as root, e.g. sudo {shutil.which('shoal') or 'shoal'} cluster {action} ...")
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        raise UserError(f"shoal cluster {action} needs the {' and '.join(f'`{t}`' for t in missing)} command "
                        f"(package iproute2): install it, e.g. apt-get install iproute2")


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run one command; with `check`, a failure is a one-line error naming the command and its answer."""
    proc = subprocess.run(argv, capture_output=True, text=True)
    if check and proc.returncode != 0:
        answer = (proc.stderr.strip() or proc.stdout.strip() or f"exit code {proc.returncode}").splitlines()[0]
        raise UserError(f"`{' '.join(argv)}` failed: {answer} (`shoal cluster down` removes what was made)")
    return proc


def netns_exec(netns: str) -> list[str]:
    """The prefix that runs a command inside network namespace `netns`."""
    return ["ip", "netns", "exec", netns]


def wait_up(system: str, until, what: str, log: Path, timeout_s: float = 60.0) -> None:
    """Wait until `until()` holds for a daemon the testbed started, or fail in one line with its log's end."""
    deadline = time.monotonic() + timeout_s
    while not until():
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace").strip().splitlines()[-3:] if log.exists() else []
            raise UserError(f"{system} did not come up: no {what} after {timeout_s:g} s; {log} ends: "
                            f"{' | '.join(tail) or '(nothing)'} (`shoal cluster down` removes what was made)")
        time.sleep(0.2)
