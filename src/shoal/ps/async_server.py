"""An asynchronous parameter server (ps.mode = "async"): workers that come and go.

Threads: a listener makes this server's end of a link (links.py) for every worker that registers; one
receiver per link turns its messages into events (Joined; Message: a Push, with a STEP's gradient
already rebuilt dense; Gone: the link failed); the main thread handles the events in order, one
method each, so the shard, the optimizer and the bookkeeping (fields of AsyncServer) have one owner.

Units of data (async_worker.py) are dealt by server 0 (Dealer) with each reply, once the launched
workers have all joined (or half of parallel.timeout_s after the first did: the run starts with those
there). A unit whose worker leaves (its link fails: SIGKILL, a crash, or no message for
parallel.timeout_s seconds, a stall) before server 0 applied it is dealt again, first; a worker asking
for work while every unit is dealt but some are not applied waits (the unit may come back). Every
server applies a unit once (a second push of it, from a worker that died between its pushes to two
servers, is ignored). A worker more than ps.max_staleness updates ahead of the slowest live one waits
for its reply (stale-synchronous parallel). Server 0 says the run is complete (a store key) once every
unit is applied; a server stops when it is complete and every worker it knows has left, after sending
worker slot 0 (the one that writes the run's results) the final parameters and its Account.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from shoal import signals
from shoal.comm.collectives import Comm
from shoal.config import PSConfig
from shoal.ps.checkpoints import ServerCheckpoints
from shoal.ps.links import COMPLETE, SERVER, Link, leave_in_turn, registered, slot_of
from shoal.ps.messages import Account, Kind, Push, Reply
from shoal.ps.shards import Shard


@dataclass(frozen=True)
class Joined:
    worker: int
    slot: int
    link: Link


@dataclass(frozen=True)
class Message:
    worker: int
    push: Push
    grad: torch.Tensor | None  # a STEP's gradient, dense


@dataclass(frozen=True)
class Gone:
    worker: int
    why: str


class Dealer:
    """Server 0's dealing of units: in order, except that a unit whose worker left before it was applied
    goes first again. Nothing past a checkpoint's cut is dealt until the cut is saved."""

    def __init__(self, total: int, start: int, saver: ServerCheckpoints):
        self.total, self.next_unit, self.saver = total, start, saver
        self.requeue: deque[int] = deque()
        self.outstanding: dict[int, int] = {}  # worker -> the unit it is training
        self.last_from: dict[int, int] = {}  # worker -> the unit last applied from it
        self.started, self.first_join = False, 0.0

    def unit_for(self, w: int, complete: bool) -> int | None:
        """The next unit for worker `w`; -1 when the run is complete; None: it waits (units are out)."""
        if self.requeue:
            unit = self.requeue.popleft()
        elif self.next_unit < self.total:
            if self.saver.propose(self.next_unit):  # a checkpoint's cut: nothing past it until it is saved
                return None
            unit, self.next_unit = self.next_unit, self.next_unit + 1
        elif complete:
            return -1
        else:
            return None
        self.outstanding[w] = unit
        return unit

    def applied(self, w: int, unit: int) -> None:
        self.outstanding.pop(w, None)
        self.last_from[w] = unit

    def left(self, w: int, applied: set[int], several_servers: bool) -> None:
        """Worker `w` left: its unit in hand, if not applied, is trained again by the next worker that asks."""
        if w in self.outstanding and self.outstanding[w] not in applied:
            self.requeue.appendleft(self.outstanding.pop(w))
        if several_servers and w in self.last_from:
            # its last push may have reached this server and not all others (it died between them): dealt
            # again, servers that applied it skip it
            self.requeue.append(self.last_from.pop(w))


class AsyncServer:
    def __init__(self, shard: Shard, ps: PSConfig, index: int, comm: Comm, *, workers: int, steps: int,
                 timeout_s: float, store, saver: ServerCheckpoints, say=print):
        """`workers`: the launched workers; `steps`: train.steps (a unit is one worker's share of a step);
        `saver`: the checkpoints, holding the state resumed from, if any."""
        self.shard, self.ps, self.index, self.workers = shard, ps, index, workers
        self.total, self.timeout_s, self.comm, self.store, self.saver, self.say = (
            workers * steps, timeout_s, comm, store, saver, say)
        self.groups = len(shard.optimizer.param_groups)
        self.events: queue.Queue = queue.Queue()
        self.stop = threading.Event()
        # the workers
        self.links: dict[int, Link] = {}
        self.slots: dict[int, int] = {}
        self.live: set[int] = set()
        self.clock: dict[int, int] = {}  # updates each worker pushed (stale-synchronous bound)
        self.since: dict[int, int] = {}  # the largest staleness applied since the worker's last reply
        self.held: list[int] = []  # workers whose reply waits: too far ahead, or (server 0) no unit to give yet
        self.outbox: list = []  # replies still being sent
        # the updates
        self.applied: set[int] = set(range(saver.saved))  # a resumed run's cut: every unit before it
        self.waiting: list[int] = []  # pulled versions of the updates held for the next aggregated step
        self.newest_lrs: list[float] = []
        self.hist = saver.state.hist  # staleness of every update applied
        self.version, self.started = saver.state.version, time.perf_counter()
        self.resumed_updates = int(self.hist.sum().item())
        self.people = saver.state.people  # who joined and left, and why
        self.dealer = Dealer(self.total, saver.saved, saver) if index == 0 else None
        self.finals_sent = 0
        self.said_complete = False  # server 0's word that the run is complete, once read (servers 1 and up)

    def serve(self) -> dict:
        """Until the run is complete and every worker left; returns what this server did."""
        listener = threading.Thread(target=self.listen, daemon=True, name="shoal-ps-listen")
        listener.start()
        handlers = {Joined: self.on_join, Gone: self.on_gone, Message: self.on_message}
        idle_since = None
        try:
            while True:
                if signals.requested():  # the elastic agent stopping the survivors of a dead server, or Ctrl-C:
                    # nothing to finish (a save needs every unit before its cut); the newest checkpoint stands
                    raise signals.Interrupted(signals.requested(), self.saver.saved // self.workers,
                                              self.saver.newest())
                if self.complete() and not self.live and self.people["joined"]:  # done, once slot 0 had the
                    idle_since = idle_since or time.monotonic()  # final parameters, or it did not come back
                    if self.finals_sent or time.monotonic() - idle_since > self.timeout_s:
                        break
                else:
                    idle_since = None
                try:
                    event = self.events.get(timeout=0.2)
                except queue.Empty:
                    self.release()  # the start's timeout may have passed
                    self.save_if_due()  # a cut announced meanwhile
                    continue
                handlers[type(event)](event)
            for s in self.outbox:
                s.wait()
        finally:
            self.stop.set()
        listener.join(timeout=1.0)  # its next read of the store is at most 0.05 s away, unless a link is forming
        leave_in_turn(self.store, self.index, self.ps.servers, self.timeout_s, stopped=signals.requested)
        applied = int(self.hist.sum().item())
        return {"applied": applied,
                "staleness_max": max((s for s, c in enumerate(self.hist.tolist()) if c), default=0),
                "workers_joined": len(self.people["joined"]), "workers_left": self.people["left"]}

    # --- threads: links in, events out -----------------------------------------------------------------

    def listen(self) -> None:
        known = 0
        while not self.stop.is_set():
            for w in range(known, registered(self.store)):
                known = w + 1
                slot = slot_of(self.store, w)
                try:
                    link = Link(self.store, self.index, w, SERVER, self.timeout_s, self.comm)  # waits for its end
                except Exception as e:  # it registered and never linked (died, or gave up and registers anew):
                    # the workers after it must still be heard, so this thread goes on
                    self.say(f"parameter server {self.index}: worker {w} (slot {slot}) registered but did not "
                             f"link: {str(e).strip().splitlines()[0][:200]}")
                    continue
                self.events.put(Joined(w, slot, link))
                threading.Thread(target=self.receive, args=(w, link), daemon=True, name=f"shoal-ps-recv-{w}").start()
            self.stop.wait(0.05)

    def receive(self, w: int, link: Link) -> None:
        try:
            while True:
                push = Push.read(link.recv(torch.empty(Push.size(self.groups), dtype=torch.float64, device=link.device),
                                           label="ps header"))
                grad = self.shard.recv_grads(link, w) if push.kind == Kind.STEP else None
                self.events.put(Message(w, push, grad))
                if push.kind == Kind.DONE:
                    return
        except Exception as e:  # the link failed: the worker died, or stalled past the timeout
            self.events.put(Gone(w, str(e).strip().splitlines()[0][:200]))

    # --- events --------------------------------------------------------------------------------------

    def on_join(self, e: Joined) -> None:
        w = e.worker
        self.links[w], self.slots[w] = e.link, e.slot
        self.live.add(w)
        self.clock[w] = min((self.clock[u] for u in self.live if u != w), default=0)
        self.since[w] = 0
        self.shard.track_worker(w)
        if self.dealer:
            self.dealer.first_join = self.dealer.first_join or time.monotonic()
        self.people["joined"].append({"worker": w, "slot": e.slot, "at_version": self.version})
        self.say(f"parameter server {self.index}: worker {w} (slot {e.slot}) joined at version {self.version}")

    def on_gone(self, e: Gone) -> None:
        w = e.worker
        if w not in self.live:
            return
        self.live.discard(w)
        if w in self.held:
            self.held.remove(w)
        if self.dealer:
            self.dealer.left(w, self.applied, several_servers=self.ps.servers > 1)
        self.people["left"].append({"worker": w, "slot": self.slots[w], "why": e.why, "at_version": self.version})
        self.say(f"parameter server {self.index}: worker {w} (slot {self.slots[w]}) left: {e.why}")
        self.links.pop(w).close()
        self.release()

    def on_message(self, e: Message) -> None:
        w, push = e.worker, e.push
        if push.kind == Kind.DONE:
            self.on_leave(w)
            return
        if push.kind == Kind.STEP and push.unit not in self.applied:
            self.on_update(w, push, e.grad)
        if push.kind != Kind.JOIN:
            self.clock[w] += 1
        self.held.append(w)  # its reply, when release() allows
        self.release()

    def on_update(self, w: int, push: Push, grad: torch.Tensor) -> None:
        self.shard.set_grads(grad)
        # each update clipped as a whole
        self.shard.clip(torch.tensor(push.norm, dtype=torch.float64, device=self.shard.device))
        self.shard.hold()
        self.waiting.append(push.version)
        self.newest_lrs = push.lrs
        self.applied.add(push.unit)
        if self.dealer:
            self.dealer.applied(w, push.unit)
        if len(self.waiting) == self.ps.aggregate or (self.index == 0 and len(self.applied) == self.total):
            self.step()
        self.save_if_due()
        if self.index == 0 and self.complete():
            self.store.set(COMPLETE, "1")

    def on_leave(self, w: int) -> None:
        """Worker `w` has no unit left; slot 0 gets the final parameters and this server's account."""
        self.live.discard(w)
        if self.slots[w] == 0 and self.complete():
            self.flush()  # the last few updates, fewer than ps.aggregate
            self.reply(w, -1)
            account = Account(int(self.hist.sum().item()), time.perf_counter() - self.started,
                              int(self.hist.sum().item()) - self.resumed_updates, self.hist.tolist(), self.people)
            link = self.links[w]
            self.outbox.extend(link.send(t, label="ps account") for t in account.tensors(link.device))
            self.finals_sent += 1
        self.release()

    # --- what the events set off ---------------------------------------------------------------------

    def complete(self) -> bool:
        if self.index == 0:
            return len(self.applied) == self.total
        # once said, for good: the store is read only until then
        self.said_complete = self.said_complete or self.store.check([COMPLETE])
        return self.said_complete

    def release(self) -> None:
        """Reply to every held worker that may go on: not too far ahead, and (server 0) with a unit to deal."""
        dealer = self.dealer
        if dealer and not dealer.started:  # the start: the launched workers, or whoever came within half the
            # timeout. Not the whole timeout: a joined worker waits for its first unit with that timeout, so
            # when the launched workers start further apart than it (a loaded machine), the first would give
            # up at the moment dealing began, and rejoin
            dealer.started = len(self.live) >= self.workers or (
                bool(dealer.first_join) and time.monotonic() - dealer.first_join > self.timeout_s / 2)
            if not dealer.started:
                return
        slowest = min((self.clock[u] for u in self.live), default=0)
        for w in list(self.held):
            if self.clock[w] - slowest > self.ps.max_staleness and not self.complete():
                continue
            unit = dealer.unit_for(w, self.complete()) if dealer else -1
            if unit is None:
                continue
            self.held.remove(w)
            self.reply(w, unit)

    def reply(self, w: int, unit: int) -> None:
        link = self.links[w]
        meta = Reply(self.version, self.since[w], unit).tensor(link.device)
        self.since[w] = 0
        self.outbox.extend([link.send(meta, label="ps version"), *self.shard.send_values(link, w)])
        for s in [s for s in self.outbox if s.work.is_completed()]:
            s.wait()  # done: closes its record in the collective log
            self.outbox.remove(s)

    def step(self) -> None:
        """Apply the updates held: their mean, at len(waiting) / workers of the newest learning rates."""
        n = len(self.waiting)
        self.shard.set_held(n)
        # an update of n units is that share of a global batch: the linear scaling rule (measured: each
        # update at the global batch's rate, AdamW moved ~n times as far per sample, and at lr 2e-3 with 3
        # workers ended at val 2.73-2.89 where synchronous training reaches 2.645)
        self.shard.apply([lr * (n / self.workers) for lr in self.newest_lrs])
        for v in self.waiting:
            staleness = self.version - v
            self.hist[min(staleness, len(self.hist) - 1)] += 1
            for u in self.since:
                self.since[u] = max(self.since[u], staleness)
        self.waiting.clear()
        self.version += 1

    def flush(self) -> int:
        """Apply what is held, if anything; returns the version."""
        if self.waiting:
            self.step()
        return self.version

    def save_if_due(self) -> None:
        """At a checkpoint's cut, once every unit before it is applied here: the save (collective over the
        servers), then dealing goes on."""
        saver = self.saver
        if not saver.enabled:
            return
        if self.dealer:
            saver.propose(self.dealer.next_unit)
        else:
            saver.announced()
        if saver.save_if_reached(len(self.applied), self.flush):
            self.say(f"parameter server {self.index}: checkpoint at step {saver.saved // self.workers} "
                     f"(units before {saver.saved}, version {self.version})")
            self.release()
