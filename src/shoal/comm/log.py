"""The collective log: every collective this rank entered, whether it finished, and how long it took.

Each rank numbers the collectives it enters; ranks that run the same program enter them in the same
order, so "rank 1 is at #56 while rank 0 waits in #57" means rank 1 never reached #57. A record is
finished when its wait returns (a DDP gradient bucket: when its future completes), and `waiting`
names the one the main thread is blocked in, if any: the hang report tells a rank that waits from a
rank that is elsewhere. Durations are summed per (op, group) for the step profile.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import contextmanager

import torch


class CollectiveLog:
    def __init__(self, maxlen: int = 64):
        self.seq = 0
        self.records: deque[dict] = deque(maxlen=maxlen)
        self.waiting: dict | None = None  # the record the main thread is blocked in
        self.totals: dict[tuple[str, str], list[float]] = {}  # (op, group) -> [count, seconds]
        self._lock = threading.Lock()

    def enter(self, op: str, group: str, tensors: list[torch.Tensor] = ()) -> dict:
        with self._lock:
            self.seq += 1
            rec = {"seq": self.seq, "op": op, "group": group, "done": False, "entered": time.time(),
                   "shapes": [f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in tensors]}
            self.records.append(rec)
        return rec

    def done(self, rec: dict) -> None:
        """Called when the collective completed (possibly from a communication thread)."""
        seconds = time.time() - rec["entered"]
        with self._lock:
            rec["done"] = True
            total = self.totals.setdefault((rec["op"], rec["group"].split(",")[0]), [0, 0.0])
            total[0] += 1
            total[1] += seconds

    @contextmanager
    def record(self, op: str, group: str, tensors: list[torch.Tensor] = ()):
        """Around a blocking call that communicates (a barrier, a checkpoint's DCP save)."""
        rec = self.enter(op, group, tensors)
        with self.blocked_in(rec):
            yield rec
        self.done(rec)

    @contextmanager
    def blocked_in(self, rec: dict):
        """The main thread waits for `rec` inside this block."""
        outer, self.waiting = self.waiting, rec
        try:
            yield
        finally:
            self.waiting = outer

    def last(self) -> dict | None:
        with self._lock:
            return dict(self.records[-1]) if self.records else None

    def in_flight(self) -> dict | None:
        """The oldest collective entered and not finished."""
        with self._lock:
            return next((dict(r) for r in self.records if not r["done"]), None)


def describe(rec: dict | None) -> str:
    if rec is None:
        return "no collective yet"
    shapes = ", ".join(rec["shapes"])
    return f"#{rec['seq']} {rec['op']}({rec['group']}{': ' + shapes if shapes else ''})"
