"""Background prefetch: a thread prepares the next steps' micro-batches while the model computes.

The thread holds Python's GIL while it builds a batch, and every torch call of the training thread lets it
in: run beside a step's forward, which the host spends launching hundreds of small operations, each handover
costs the training thread (a tiny GPT's forward on the CPU took 1.4 ms beside the thread against 0.95 ms
without it). So the thread builds a batch when the consumer says the host is free (`release()`: the step's
last backward began, during which the training thread waits in autograd's engine without the GIL), or, for a
consumer that never says, when it takes the next batch. It keeps `depth` steps ready all the same.

The consumer measures how long it waits (`data_wait_s`): time the step was starved for data, the
number to look at before blaming the model or the network.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

from shoal.models.spec import Batch

AUTO_DEPTH = 2  # data.prefetch = "auto" for a source whose samples are decoded or generated


def prefetch_depth(setting: int | str, source) -> int:
    """data.prefetch as a number of steps. "auto": 0 for a source whose batches are slices of arrays in memory
    (`light_batches`): on a tiny GPT on the CPU, where the host's work is the step, building the batch in the
    training thread cost it 0.1 ms a step, and a thread building it beside the step 0.1-0.2 ms (the step's
    backward and update slowed while the thread held the GIL and the other core)."""
    if setting != "auto":
        return int(setting)
    return 0 if getattr(source, "light_batches", False) else AUTO_DEPTH


class Prefetcher:
    """Yields (step, micro_batches) for steps start, start+1, ...; `make(step)` builds one step's data."""

    def __init__(self, make: Callable[[int], list[Batch]], start: int, depth: int):
        self.make, self.next_step, self.depth = make, start, depth
        self.last_wait_s = 0.0
        self._stop = threading.Event()
        self._owed = False  # the batch taken last has not yet let the thread build another
        if depth > 0:
            self._q: queue.Queue = queue.Queue()
            self._permits = threading.Semaphore(depth)  # batches the thread may build: `depth` ahead at first
            self._thread = threading.Thread(target=self._fill, args=(start,), daemon=True, name="shoal-prefetch")
            self._thread.start()

    def _fill(self, step: int) -> None:
        while True:
            self._permits.acquire()
            if self._stop.is_set():
                return
            try:
                item = (step, self.make(step))
            except BaseException as e:  # surface it in the training thread, with its traceback
                item = e
            self._q.put(item)
            if isinstance(item, BaseException):
                return
            step += 1

    def next(self) -> list[Batch]:
        t0 = time.perf_counter()
        if self.depth == 0:
            step, batches = self.next_step, self.make(self.next_step)
        else:
            self.release()  # the step before never said when: build in its place now
            item = self._q.get()
            if isinstance(item, BaseException):
                raise item
            step, batches = item
            self._owed = True
        assert step == self.next_step, f"prefetcher out of order: got {step}, want {self.next_step}"
        self.next_step += 1
        self.last_wait_s = time.perf_counter() - t0
        return batches

    def release(self) -> None:
        """The host is free for a while (the step's last backward began): build the batch that replaces the
        one taken last. Once per batch taken; a no-op after that."""
        if self._owed:
            self._owed = False
            self._permits.release()

    def close(self) -> None:
        self._stop.set()
        if self.depth > 0:
            self._permits.release()  # a thread waiting for a permit sees the stop
            while self._thread.is_alive():
                try:
                    self._q.get_nowait()
                except queue.Empty:
                    pass
                self._thread.join(timeout=0.01)
