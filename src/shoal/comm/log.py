"""The collective log: every collective this rank entered, whether it finished, and how long it took.

Each rank numbers the collectives it enters; ranks that run the same program enter them in the same
order, so "rank 1 is at #56 while rank 0 waits in #57" means rank 1 never reached #57. A record is
finished when its wait returns (a DDP gradient bucket: when its future completes), and `waiting`
names the one the main thread is blocked in, if any: the hang report tells a rank that waits from a
rank that is elsewhere. Durations are summed per (op, group).

[Note: exposed communication] The step profile charges to communication only the time the training
thread could not compute because it waited on the network, per mesh axis (the group label's first
word: dp, tp, pp, else world). Two waits are seen: (1) the main thread blocked in one of shoal's own
collectives (`blocked_in`, outermost wait only), and (2) DDP's end of backward: once the last gradient
bucket has been handed to the network, backward's remaining work is waiting for every bucket (DDP
finalises in C++), so the time from that hand-off until the next step mark, less any wait already
counted in between, is exposed dp time. Buckets that finish while backward still computes are hidden
and count nothing. (3) The waits of collectives torch issues inside the model on its own (FSDP2's
all-gathers, DTensor's tensor-parallel all-reduces, a pipeline's send/recv), timed by comm/model_waits.py;
a pipeline stage's wait for its neighbours is first its schedule's bubble (metrics/profile.py).
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
        # mesh axis -> seconds the main thread waited on the network ([Note: exposed communication])
        self.exposed: dict[str, float] = {}
        self._main = threading.main_thread().ident
        self._tail: tuple[float, str, float] | None = None  # (handed off at, axis, exposed then): DDP's last bucket

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
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.waiting = outer
            if outer is None and threading.get_ident() == self._main:  # a nested wait counts once
                self.add_exposed(mesh_axis(rec["group"]), time.perf_counter() - t0)

    def add_exposed(self, axis: str, seconds: float) -> None:
        self.exposed[axis] = self.exposed.get(axis, 0.0) + seconds

    def last_bucket_sent(self, group: str) -> None:
        """DDP handed its last gradient bucket of the backward to the network (from its comm hook)."""
        self._tail = (time.perf_counter(), mesh_axis(group), sum(self.exposed.values()))

    def settle(self, now: float) -> None:
        """At a step mark: charge the wait since DDP's last bucket left (if any) as exposed."""
        if self._tail is not None:
            sent, axis, before = self._tail
            self._tail = None
            self.add_exposed(axis, max(0.0, now - sent - (sum(self.exposed.values()) - before)))

    def drain(self, timeout_s: float) -> bool:
        """Wait, with the GIL released, until every record with a callback to run (`settled` False: a DDP
        gradient bucket's, comm/hooks.py) has run it; False if some had not after `timeout_s`. A process
        group whose work still has a Python callback to run must not be destroyed: gloo's destructor
        joins its worker threads while the caller holds the GIL, and the worker waits for the GIL to run
        the callback (a deadlock, seen when a live run's garbage collection freed the DDP of a failed
        generation whose last gradient buckets were still queued)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                if not any(r.get("settled") is False for r in self.records):
                    return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)

    def last(self) -> dict | None:
        with self._lock:
            return dict(self.records[-1]) if self.records else None

    def in_flight(self) -> dict | None:
        """The oldest collective entered and not finished."""
        with self._lock:
            return next((dict(r) for r in self.records if not r["done"]), None)


def mesh_axis(group: str) -> str:
    """The mesh axis a collective's group label names: its first word ("dp, gradient bucket 3" -> dp;
    weights tied across the first and last stage -> pp; a parameter server's traffic -> dp; expert parallelism's
    all-to-alls -> ep, and its experts' gradients summed over the ranks that hold the same ones, edp -> dp; context
    parallelism's gathers of keys and values -> cp)."""
    word = group.split(",")[0].split(" ")[0]
    return {"dp": "dp", "tp": "tp", "pp": "pp", "ep": "ep", "cp": "cp", "tied": "pp", "ps": "dp",
            "edp": "dp"}.get(word, "world")


def describe(rec: dict | None) -> str:
    if rec is None:
        return "no collective yet"
    shapes = ", ".join(rec["shapes"])
    return f"#{rec['seq']} {rec['op']}({rec['group']}{': ' + shapes if shapes else ''})"
