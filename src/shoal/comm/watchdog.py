"""Hang diagnosis: which rank did not arrive at which collective, and what every rank was doing.

Each rank keeps a small record of the collectives it entered (sequence number, op, group, shapes),
fed by shoal's own collectives and by a DDP communication hook for the gradient buckets. A daemon
thread publishes this rank's newest record and the innermost frames of its main thread to the
rendezvous store once a second. When a collective fails (a timeout after parallel.timeout_s, or a
peer that died), the rank that saw it reads every rank's status from the store and prints one report
instead of a bare backend error.

Sequence numbers count the collectives this rank entered; ranks that run the same program enter them
in the same order, so "rank 1 is at #56 while rank 0 waits in #57" means rank 1 never reached #57.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
import traceback
from collections import deque
from contextlib import contextmanager
from pathlib import Path

import torch

STATUS_KEY = "shoal/status/{rank}"


class CollectiveLog:
    def __init__(self, maxlen: int = 64):
        self.seq = 0
        self.records: deque[dict] = deque(maxlen=maxlen)
        self._lock = threading.Lock()

    def enter(self, op: str, group: str, tensors: list[torch.Tensor] = ()) -> dict:
        with self._lock:
            self.seq += 1
            rec = {"seq": self.seq, "op": op, "group": group, "done": False, "entered": time.time(),
                   "shapes": [f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in tensors]}
            self.records.append(rec)
        return rec

    @staticmethod
    def done(rec: dict) -> None:
        rec["done"] = True

    @contextmanager
    def record(self, op: str, group: str, tensors: list[torch.Tensor] = ()):
        rec = self.enter(op, group, tensors)
        yield rec
        self.done(rec)

    def last(self) -> dict | None:
        with self._lock:
            return dict(self.records[-1]) if self.records else None

    def oldest_open(self) -> dict | None:
        """The collective this rank is stuck in: the oldest one entered and not finished."""
        with self._lock:
            return next((dict(r) for r in self.records if not r["done"]), None)


def describe(rec: dict | None) -> str:
    if rec is None:
        return "no collective yet"
    shapes = ", ".join(rec["shapes"])
    return f"#{rec['seq']} {rec['op']}({rec['group']}{': ' + shapes if shapes else ''})"


def where(thread_id: int, frames: int = 2) -> str:
    """The innermost frames of a thread that are in the project or the user's code (not in libraries)."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return "?"
    stack = traceback.extract_stack(frame)
    ours = [f for f in stack if "site-packages" not in f.filename and "/lib/python3" not in f.filename] or stack
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno} in {f.name}" for f in reversed(ours[-frames:]))


class Watchdog:
    """Publishes this rank's status to the store every `interval` seconds from a daemon thread."""

    def __init__(self, log: CollectiveLog, store, rank: int, interval: float = 1.0):
        self.log, self.store, self.rank, self.interval = log, store, rank, interval
        self.main_thread = threading.main_thread().ident
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="shoal-watchdog")
        self._thread.start()

    def status(self) -> dict:
        return {"last": self.log.last(), "open": self.log.oldest_open(), "where": where(self.main_thread),
                "time": time.time()}

    def publish(self) -> None:
        self.store.set(STATUS_KEY.format(rank=self.rank), json.dumps(self.status()))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.publish()
            except Exception:  # noqa: BLE001 - the store went away: the run is ending anyway
                return

    def stop(self) -> None:
        self._stop.set()


def reason(error: BaseException) -> str:
    """The backend's own words, without the wrappers DDP and gloo put around them."""
    first = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
    last = first.split("Error: ")[-1]  # innermost of "RuntimeError: ... callback: RuntimeError: <why>"
    return re.sub(r"^\[[^\]]*\]\s*", "", last)[:200]  # drop gloo's "[/path/file.cc:78]"


def collective_report(watchdog: Watchdog, world_size: int, error: BaseException) -> str | None:
    """The report for a failed collective, or None when this rank was not in one."""
    mine = watchdog.log.oldest_open()
    if mine is None:
        return None
    waited = time.time() - mine["entered"]
    lines = [f"collective {describe(mine)} failed on rank {watchdog.rank} after {waited:.1f} s: {reason(error)}"]
    for rank in range(world_size):
        key = STATUS_KEY.format(rank=rank)
        try:
            status = json.loads(watchdog.store.get(key)) if watchdog.store.check([key]) else None
        except Exception:  # noqa: BLE001
            status = None
        if status is None:
            lines.append(f"  rank {rank}: no status published (it may have died before its first report)")
            continue
        age = time.time() - status["time"]
        last, open_ = status["last"], status["open"]
        if open_ is not None and open_["seq"] == mine["seq"] and open_["op"] == mine["op"]:
            state = f"waiting in {describe(open_)}"
        elif last is None or last["seq"] < mine["seq"]:
            state = f"DID NOT ARRIVE at #{mine['seq']} {mine['op']}; last entered {describe(last)}"
        else:
            state = f"at {describe(open_ or last)}"
        lines.append(f"  rank {rank}: {state}; was at {status['where']} ({age:.0f} s ago)")
    return "\n".join(lines)
