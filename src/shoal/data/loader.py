"""Background prefetch: a thread prepares the next steps' micro-batches while the model computes.

The consumer measures how long it waits (`data_wait_s`): time the step was starved for data, the
number to look at before blaming the model or the network.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

from shoal.models.spec import Batch

_DONE = object()


class Prefetcher:
    """Yields (step, micro_batches) for steps start, start+1, ...; `make(step)` builds one step's data."""

    def __init__(self, make: Callable[[int], list[Batch]], start: int, depth: int):
        self.make, self.next_step, self.depth = make, start, depth
        self.last_wait_s = 0.0
        self._stop = threading.Event()
        if depth > 0:
            self._q: queue.Queue = queue.Queue(maxsize=depth)
            self._thread = threading.Thread(target=self._fill, args=(start,), daemon=True, name="shoal-prefetch")
            self._thread.start()

    def _fill(self, step: int) -> None:
        while not self._stop.is_set():
            try:
                item = (step, self.make(step))
            except BaseException as e:  # surface it in the training thread, with its traceback
                item = e
            self._q.put(item)  # blocks while `depth` steps are ready; close() drains to release it
            if isinstance(item, BaseException):
                return
            step += 1

    def next(self) -> list[Batch]:
        t0 = time.perf_counter()
        if self.depth == 0:
            step, batches = self.next_step, self.make(self.next_step)
        else:
            item = self._q.get()
            if isinstance(item, BaseException):
                raise item
            step, batches = item
        assert step == self.next_step, f"prefetcher out of order: got {step}, want {self.next_step}"
        self.next_step += 1
        self.last_wait_s = time.perf_counter() - t0
        return batches

    def close(self) -> None:
        self._stop.set()
        if self.depth > 0:
            while self._thread.is_alive():
                try:
                    self._q.get_nowait()
                except queue.Empty:
                    pass
                self._thread.join(timeout=0.01)
