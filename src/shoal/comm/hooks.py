"""DDP communication hooks that compose: `logged(hook)` wraps any hook (torch's default all-reduce,
a compression codec) so that its gradient buckets appear in the collective log, for the hang
report and the step profile. DDP takes one hook per model; wrapping keeps that slot free for the
hook that does the work."""

from __future__ import annotations

import torch

from shoal.comm.log import CollectiveLog


def logged(hook, log: CollectiveLog, label: str):
    """`hook(state, bucket) -> Future` recorded as one collective per bucket, finished when its
    future completes (a failed one stays open: the report names it)."""

    def wrapper(state, bucket):  # no annotations: DDP checks them, and they would be strings here
        rec = log.enter("all_reduce", f"{label}, gradient bucket {bucket.index()}", [bucket.buffer()])
        rec["settled"] = False  # until its callback has run, failed or not (CollectiveLog.drain)

        def finished(fut: torch.futures.Future) -> torch.Tensor:
            try:
                value = fut.value()  # raises if the collective failed: the record then stays open
            finally:
                rec["settled"] = True
            log.done(rec)
            return value

        fut = hook(state, bucket).then(finished)
        if bucket.is_last():  # what backward waits for from here on is exposed (comm/log.py)
            log.last_bucket_sent(label)
        return fut

    return wrapper

