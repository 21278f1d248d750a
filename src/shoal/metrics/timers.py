"""Step-time breakdown: consecutive phases of one training step, and (given the collective log) the
communication each phase waited for, per mesh axis.

On a CPU the phases are read off a monotonic clock at each mark. On CUDA a mark records an event in
the device's queue instead of waiting for it: the phases are the device's time between the events,
read once the step's last event has run (when the step's report is read: training/report.py), so that
timing a step never makes the host wait for the device. The exposed-communication accounting follows
the host's clock on both.
"""

from __future__ import annotations

import time

import torch


class StepTimer:
    def __init__(self, device: torch.device, log=None):
        self.cuda = device.type == "cuda"
        # comm/log.py's CollectiveLog; None: no exposed-communication accounting (metrics.profile = false)
        self.log = log
        self._host: dict[str, float] = {}
        self._events: list[tuple[str, torch.cuda.Event]] = []  # CUDA: (phase, event at its end), in order
        self._start_event: torch.cuda.Event | None = None
        self._device: dict[str, float] | None = None  # CUDA: the phases, once read
        self._device_from: list = []
        self._settled = False  # CUDA: an event recorded after the last mark has been waited for
        self.exposed: dict[str, dict[str, float]] = {}  # phase -> mesh axis -> seconds waited on the network
        self._t = 0.0
        self._seen: dict[str, float] = {}

    def start(self) -> None:
        self._host, self._events, self.exposed, self._device, self._settled = {}, [], {}, None, False
        self._t = time.perf_counter()
        if self.cuda:
            self._start_event = self._record()
        if self.log is not None:
            self.log.settle(self._t)  # a wait that began before this step is not this step's
            self._seen = dict(self.log.exposed)

    def mark(self, phase: str) -> None:
        """Charge the time since the previous mark to `phase`."""
        now = time.perf_counter()
        self._host[phase] = self._host.get(phase, 0.0) + now - self._t
        self._t = now
        if self.cuda:
            self._events.append((phase, self._record()))
        if self.log is not None:  # clock reads and a dict of at most four axes: nothing that communicates
            self.log.settle(now)
            seen = self.log.exposed
            waited = self.exposed.setdefault(phase, {})
            for axis, total in seen.items():
                waited[axis] = waited.get(axis, 0.0) + total - self._seen.get(axis, 0.0)
            self._seen = dict(seen)

    def settle(self) -> None:
        """The step's last event has run (the host waited for one recorded after it): reading the phases
        then waits for nothing, so a step costs the host one event wait, not two."""
        self._settled = True

    def marked(self, phase: str) -> bool:
        """Whether `phase` has been marked in this step (asked without reading the device's clock)."""
        return phase in self._host

    @property
    def phases(self) -> dict[str, float]:
        """Seconds per phase. CUDA: the device's, waiting for the step's last event (already done when the
        step's report has been read)."""
        if not self.cuda or not self._events:
            return self._host
        if self._device is None or len(self._device_from) != len(self._events):
            out: dict[str, float] = {}
            before = self._start_event
            if not self._settled:
                self._events[-1][1].synchronize()
            for phase, event in self._events:
                out[phase] = out.get(phase, 0.0) + before.elapsed_time(event) / 1e3
                before = event
            self._device, self._device_from = out, list(self._events)
        return self._device

    @property
    def total(self) -> float:
        return sum(self.phases.values())

    @staticmethod
    def _record() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
