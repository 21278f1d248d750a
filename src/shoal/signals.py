"""Stopping on request: SIGTERM (a scheduler's preemption, torchrun's shutdown) or SIGINT (Ctrl-C).

The handler only records the request. The training loop folds it into the step's loss all-reduce,
so every rank learns at the same step that some rank was asked to stop; then the run saves a final
checkpoint (unless one exists for that step) and exits with 128 + the signal number. A rank stuck
where Python cannot run its handler is ended by the elastic agent's SIGKILL after its grace period.
"""

from __future__ import annotations

import signal

_requested = 0


def _handler(signum, frame) -> None:
    global _requested
    _requested = _requested or signum


def install() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _handler)


def requested() -> int:
    """The first stop signal received (0: none)."""
    return _requested


class Interrupted(Exception):
    def __init__(self, signum: int, step: int, checkpoint: str | None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        where = f"; checkpoint {checkpoint}" if checkpoint else ""
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}{where}")
