"""Stopping on request: SIGTERM (a scheduler's preemption, torchrun's shutdown) or SIGINT (Ctrl-C).

The handler only records the request. The training loop folds it into the step's loss all-reduce,
so every rank learns at the same step that some rank was asked to stop; then the run saves a final
checkpoint (unless one exists for that step) and exits with 128 + the signal number.

When the signal is the elastic agent stopping the survivors of a failed run (another rank has
published its failure), there is nothing to save and no step to finish: the rank exits at once
instead of making the agent wait out its grace period. A rank stuck where Python cannot run its
handler is ended by the agent's SIGKILL after that period.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable


def _never() -> bool:
    return False


_requested = 0
_requested_at = 0.0  # time.monotonic() when it came
_run_failed: Callable[[], bool] = _never


def _handler(signum, frame) -> None:
    global _requested, _requested_at
    if _run_failed():
        sys.stderr.flush()
        os._exit(128 + signum)
    if not _requested:
        _requested, _requested_at = signum, time.monotonic()


def install(run_failed: Callable[[], bool] = _never) -> None:
    """Handle SIGTERM and SIGINT; `run_failed()` says whether another rank already failed."""
    global _run_failed
    _run_failed = run_failed
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _handler)


def requested() -> int:
    """The first stop signal received (0: none)."""
    return _requested


def age() -> float:
    """Seconds since the first stop signal came (0.0: none came)."""
    return time.monotonic() - _requested_at if _requested else 0.0


class Interrupted(Exception):
    def __init__(self, signum: int, step: int, checkpoint: str | None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        where = f"; checkpoint {checkpoint}" if checkpoint else ""
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}{where}")
