"""Handles: what Horovod's `*_async` operations return, and `synchronize` / `poll`.

A handle holds torch's work objects (through comm's Pending, so the wait is logged for the hang
report) and what turns the received buffers into the operation's result (slicing a padded
all-gather, scaling an average). A failed wait is Horovod's HorovodInternalError, whose cause is
torch's own error (a peer that died, a collective past its timeout).
"""

from __future__ import annotations

from collections.abc import Callable

from shoal.errors import first_line


class HorovodInternalError(RuntimeError):
    """A collective failed: a process of the job died or did not arrive within the timeout. Under `shoal
    run --max-restarts N` the launcher starts the job again and `hvd.elastic` resumes from the last commit."""


class Handle:
    def __init__(self, pendings: list, finish: Callable[[], object]):
        self.pendings, self.finish = pendings, finish
        self._result, self._done = None, False

    def poll(self) -> bool:
        """True once every collective of the operation has completed (waiting then does not block)."""
        return self._done or all(p.work.is_completed() for p in self.pendings)

    def wait(self):
        """The operation's result, once every collective of it completed (a second call returns it again)."""
        if not self._done:
            try:
                for p in self.pendings:
                    p.wait()
            except RuntimeError as e:
                raise HorovodInternalError(f"{type(e).__name__}: {first_line(e)}") from e
            self._result, self._done = self.finish(), True
            self.pendings = []
        return self._result


def done(result) -> Handle:
    """A handle of an operation that needed no communication (one process)."""
    return Handle([], lambda: result)


def synchronize(handle):
    """Wait for an asynchronous operation and return its result (a tensor, or a tuple for alltoall)."""
    if callable(handle) and not isinstance(handle, Handle):
        return handle()  # Horovod's sparse allreduce hands back a function
    return handle.wait()


def poll(handle) -> bool:
    return handle.poll()
