"""Hang diagnosis, part one: every rank tells the others, once a second, what it is doing.

A daemon thread publishes this rank's status to the rendezvous store: the newest collective it
entered and the oldest still in flight (collective log), whether its main thread is blocked in a
collective and in which, where the main thread is in the project's or the user's code, the layer and
step it is at (phase.py), and torch's flight-recorder counters per process group (flight.py). When a
collective fails, report.py reads every rank's status from the store.

Whether the main thread waits in a collective is read off its stack: blocked in one of shoal's own
(the collective log says so; FSDP2's parameter all-gathers are among them, comm/model_waits.py),
inside torch.distributed code (DTensor's all-reduce, a pipeline's send/recv wait, a ZeRO 1
broadcast), or inside torch's autograd engine while a DDP gradient bucket has been in flight for over
a second (DDP waits for its buckets in C++ at the end of backward). A main thread running its own
code (a model's forward, a data step) is not in a collective, whatever async work it has in flight:
that is the rank the others wait for.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

from shoal.comm import flight
from shoal.comm.log import CollectiveLog, describe
from shoal.comm.phase import Phase

STATUS_KEY = "shoal/status/{rank}"
_TORCH = str(Path(torch.__file__).parent) + "/"
_STDLIB = str(Path(threading.__file__).parent) + "/"
_DIST = _TORCH + "distributed/"
# shoal's own collectives: Comm's, and FSDP2's all-gathers it issues (model_waits.py LoggedAllGather)
_COMM = (str(Path(__file__).with_name("collectives.py")), str(Path(__file__).with_name("model_waits.py")))
_WRAPPERS = {"wrapper", "inner", "_fn", "decorate_context", "__call__"}


def _library(filename: str) -> bool:
    return filename.startswith(_TORCH) or (filename.startswith(_STDLIB) and "site-packages" not in filename)


def where(stack: list[traceback.FrameSummary], frames: int = 2) -> str:
    """The innermost frames that are in the project or the user's code (not in libraries, nor
    model_waits.py's plumbing around torch's collectives)."""
    ours = [f for f in stack if "site-packages" not in f.filename and not f.filename.startswith(_STDLIB)
            and f.filename != _COMM[1]] or stack
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno} in {f.name}" for f in reversed(ours[-frames:]))


def blocked_in(stack: list[traceback.FrameSummary], log: CollectiveLog, groups: dict | None = None) -> str | None:
    """What the thread with this stack (outermost frame first) waits for, if it waits in a collective
    (see the module note). Also applied to the stack of an exception, to tell a failed collective.
    `groups` (flight.summary()) covers collectives no log saw: a user's script's own, DDP's among them."""
    if log.waiting is not None:
        return describe(log.waiting)
    inner = []
    for f in reversed(stack):  # the innermost run of library frames
        if not _library(f.filename):
            if f.filename in _COMM and log.in_flight() is not None:  # one of shoal's own collectives
                return describe(log.in_flight())
            if f.filename != _COMM[1]:  # model_waits.py's timing wrappers stand between torch's frames
                break
            continue
        inner.append(f)
    # torch.distributed's own frames, without the decorators around them
    dist_frames = [f for f in inner if f.filename.startswith(_DIST) and f.name not in _WRAPPERS]
    if dist_frames:  # the library's entry point (FSDP2, DTensor, a pipeline schedule) and where it waits
        outer, innermost = dist_frames[-1], dist_frames[0]
        path = outer.filename[len(_DIST):]
        return f"torch.distributed {path} in {outer.name}" + (f" -> {innermost.name}" if innermost is not outer else "")
    flying = log.in_flight()
    if inner and flying is not None and time.time() - flying["entered"] > 1.0:
        return describe(flying)
    pending = [g for g in (groups or {}).values() if time.time() - g.get("pending_since", time.time()) > 1.0]
    if inner and flying is None and pending:  # waiting in torch code while the recorder has one pending
        return f"torch {Path(inner[-1].filename).name} in {inner[-1].name}"
    return None


class Watchdog:
    """Publishes this rank's status to the store every `interval` seconds from a daemon thread."""

    def __init__(self, log: CollectiveLog, store, rank: int, phase: Phase | None = None, interval: float = 1.0):
        self.log, self.store, self.rank, self.interval = log, store, rank, interval
        self.phase = phase or Phase()
        self.main_thread = threading.main_thread().ident
        self.last_blocked: dict | None = None  # this rank's newest status while its main thread waited
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="shoal-watchdog")
        self._thread.start()

    def status(self) -> dict:
        frame = sys._current_frames().get(self.main_thread)
        stack = traceback.extract_stack(frame) if frame is not None else []
        now = time.time()
        groups = flight.summary()
        blocked = blocked_in(stack, self.log, groups)
        status = {"last": self.log.last(), "in_flight": self.log.in_flight(), "blocked": blocked,
                  "where": where(stack) if stack else "?", "phase": self.phase.describe(),
                  "groups": groups, "time": now}
        status["blocked_since"] = self._since(status) if blocked is not None else None
        if blocked is not None:
            self.last_blocked = status
        return status

    def _since(self, status: dict) -> float:
        """When the wait began: the shoal collective's entry, the flight recorder's oldest pending
        collective, or (neither known) the first sample that saw it."""
        times = [g["pending_since"] for g in status["groups"].values() if "pending_since" in g]
        waiting = self.log.waiting or status["in_flight"]
        if waiting is not None and status["blocked"] == describe(waiting):
            times.append(waiting["entered"])
        status["since_exact"] = bool(times)
        if times:
            return min(times)
        last = self.last_blocked
        return last["blocked_since"] if last and last["blocked"] == status["blocked"] else status["time"]

    def publish(self) -> None:
        self.store.set(STATUS_KEY.format(rank=self.rank), json.dumps(self.status()))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.publish()
            except Exception:  # noqa: BLE001 - the store went away: the run is ending anyway
                return

    def stop(self) -> None:
        """Stop publishing (the main thread has left the training code)."""
        self._stop.set()
        self._thread.join(timeout=2 * self.interval)

    def failure_status(self, error: BaseException) -> dict | None:
        """This rank's status at the failure, when `error` was raised in a collective it waited in
        (None otherwise: the failure is not a hang, its traceback says what happened)."""
        stack = traceback.extract_tb(error.__traceback__)
        blocked = blocked_in(stack, self.log, flight.summary())
        recent = self.last_blocked
        fresh = recent is not None and time.time() - recent["time"] <= 3 * self.interval
        if blocked is None and fresh and _library(stack[-1].filename) and recent["where"] == where(stack):
            # the error came from where this rank was just seen waiting in a collective that no log
            # saw (a script's DDP all-reduce): gloo counts a collective that timed out as completed,
            # so the recorder shows nothing pending any more
            blocked = recent["blocked"]
        if blocked is None:
            return None
        if not fresh:
            recent = {**self.status(), "where": where(stack), "blocked_since": None}
        return {**recent, "blocked": recent.get("blocked") or blocked}

    def read(self, rank: int) -> dict | None:
        key = STATUS_KEY.format(rank=rank)
        try:
            return json.loads(self.store.get(key)) if self.store.check([key]) else None
        except Exception:  # noqa: BLE001
            return None
