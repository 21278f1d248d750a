"""Step-time breakdown: consecutive phases of one training step, timed with a monotonic clock.

On CUDA each boundary synchronizes the device so a phase is charged for its own kernels, not for
kernels queued by the phase before it.
"""

from __future__ import annotations

import time

import torch


class StepTimer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.phases: dict[str, float] = {}
        self._t = 0.0

    def start(self) -> None:
        self.phases = {}
        self._t = self._now()

    def mark(self, phase: str) -> None:
        """Charge the time since the previous mark to `phase`."""
        now = self._now()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self._t
        self._t = now

    @property
    def total(self) -> float:
        return sum(self.phases.values())

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()
