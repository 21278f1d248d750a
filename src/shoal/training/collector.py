"""Python's garbage collector during training, managed as torchtitan manages it: automatic collection off
for the run, what the first step leaves (the model, the optimizer's state, torch.compile's dynamo and
inductor state: hundreds of thousands of long-lived objects) frozen out of every later scan, and a full
collection between steps every train.gc_interval steps, at the same step on every rank.

Left automatic, a generation-2 collection starts whenever allocations outnumber deallocations enough, in
the middle of some step on some rank, and scans the whole heap: with a compiled model's heap that is tens
of milliseconds, a step on one rank that every other rank then waits for at the next collective. Frozen,
a full collection scans only what the run made since; fixed, it falls between steps, every rank at once.

A live elastic run (live/generations.py) freezes its own start-up heap and collects each ended generation's
model itself: there nothing more is frozen here, so that the generation's objects stay collectable.
"""

from __future__ import annotations

import gc
import statistics
import time

FREEZE_AFTER = 1  # steps: the first builds what lives on (torch.compile's graphs, the optimizer's state); a freeze
# later would put its ~0.2 s pause inside a benchmark's window of steps


class Collector:
    def __init__(self, interval: int, freeze: bool = True):
        """`interval`: steps between full collections (0: leave Python's collector as it is); `freeze`: freeze
        the heap after FREEZE_AFTER steps."""
        self.interval, self.freeze = interval, freeze
        self.pauses: list[tuple[int, float]] = []  # (step, seconds) of each full collection made here
        self.frozen_at: int | None = None
        self._was_enabled = gc.isenabled()

    def start(self) -> None:
        if self.interval:
            gc.disable()

    def after_step(self, done: int) -> None:
        """Between steps: step `done` (1-based) has been queued and the step before it read."""
        if not self.interval:
            return
        if self.freeze and self.frozen_at is None and done >= FREEZE_AFTER:
            self._collect(done)  # the heap before the freeze: what an automatic full collection scanned
            gc.freeze()
            self.frozen_at = done
        elif done % self.interval == 0:
            self._collect(done)

    def close(self) -> None:
        """The collector as it was (what was frozen here given back to it: the process may go on, a live
        run's next generation or a test)."""
        if self.frozen_at is not None:
            gc.unfreeze()
        if self.interval and self._was_enabled:
            gc.enable()

    def _collect(self, done: int) -> None:
        t0 = time.perf_counter()
        gc.collect(2)
        self.pauses.append((done, time.perf_counter() - t0))

    def summary(self) -> dict:
        """summary.json's account: the full collection's pause before the freeze and the median after it."""
        if not self.pauses:
            return {}
        out = {"gc_interval": self.interval}
        if self.frozen_at is not None:
            out["gc_pause_before_freeze_s"] = self.pauses[0][1]
        after = [s for step, s in self.pauses if self.frozen_at is None or step > self.frozen_at]
        if after:
            out["gc_pause_s"] = statistics.median(after)
        return out
