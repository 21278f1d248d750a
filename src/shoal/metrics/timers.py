"""Step-time breakdown: consecutive phases of one training step, timed with a monotonic clock, and
(given the collective log) the communication each phase waited for, per mesh axis.

On CUDA each boundary synchronizes the device so a phase is charged for its own kernels, not for
kernels queued by the phase before it.
"""

from __future__ import annotations

import time

import torch


class StepTimer:
    def __init__(self, device: torch.device, log=None):
        self.cuda = device.type == "cuda"
        # comm/log.py's CollectiveLog; None: no exposed-communication accounting (metrics.profile = false)
        self.log = log
        self.phases: dict[str, float] = {}
        self.exposed: dict[str, dict[str, float]] = {}  # phase -> mesh axis -> seconds waited on the network
        self._t = 0.0
        self._seen: dict[str, float] = {}

    def start(self) -> None:
        self.phases, self.exposed = {}, {}
        self._t = self._now()
        if self.log is not None:
            self.log.settle(self._t)  # a wait that began before this step is not this step's
            self._seen = dict(self.log.exposed)

    def mark(self, phase: str) -> None:
        """Charge the time since the previous mark to `phase`."""
        now = self._now()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self._t
        self._t = now
        if self.log is not None:  # clock reads and a dict of at most four axes: nothing that communicates
            self.log.settle(now)
            seen = self.log.exposed
            waited = self.exposed.setdefault(phase, {})
            for axis, total in seen.items():
                waited[axis] = waited.get(axis, 0.0) + total - self._seen.get(axis, 0.0)
            self._seen = dict(seen)

    @property
    def total(self) -> float:
        return sum(self.phases.values())

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()
