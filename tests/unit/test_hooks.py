"""A logged DDP hook's gradient bucket (comm/hooks.py) and CollectiveLog.drain: a live run frees a failed
generation's process group only once every bucket's Python callback has run (else gloo's destructor,
joining the thread that waits for the GIL to run it, deadlocks)."""

import threading

import torch

from shoal.comm.hooks import logged
from shoal.comm.log import CollectiveLog


class Bucket:  # what a DDP comm hook reads of its GradBucket
    def index(self):
        return 0

    def buffer(self):
        return torch.zeros(4)

    def is_last(self):
        return True


def test_drain_waits_for_a_failed_buckets_callback():
    log, pending = CollectiveLog(), torch.futures.Future()
    out = logged(lambda state, bucket: pending, log, "dp")(None, Bucket())
    assert log.drain(0.05) is False  # the collective has not completed: its callback is still to run
    fail = threading.Timer(0.1, lambda: pending.set_exception(RuntimeError("Connection closed by peer")))
    fail.start()
    assert log.drain(5.0) is True  # run on another thread while drain waited with the GIL released
    fail.join()
    assert out.done() and log.in_flight() is not None  # failed: the record stays open for the hang report


def test_drain_is_immediate_when_every_callback_ran():
    log, done = CollectiveLog(), torch.futures.Future()
    done.set_result(torch.ones(4))
    logged(lambda state, bucket: done, log, "dp")(None, Bucket())
    assert log.drain(0.0) is True and log.in_flight() is None
