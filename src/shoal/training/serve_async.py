"""An asynchronous parameter server (ps.mode = "async"): workers that come and go.

Threads: a listener makes this server's end of a link (parallel/ps_links.py) for every worker that
registers; one receiver per link turns its messages into events (a push with its gradient already
rebuilt dense, a join, a skip, a goodbye, or the link failing); the main thread handles the events in
order, so the shard, the optimizer and the bookkeeping have one owner.

Units of data (parallel/ps_async.py) are dealt by server 0 with each reply, once the launched workers
have all joined (or half of parallel.timeout_s after the first did: the run starts with those there). A unit
whose worker leaves (its link fails: SIGKILL, a crash, or no message for parallel.timeout_s seconds, a
stall) before server 0 applied it is dealt again, first; a worker asking for work while every unit is
dealt but some are not applied waits (the unit may come back). Every server applies a unit once (a
second push of it, from a worker that died between its pushes to two servers, is ignored). Server 0 says
the run is complete (a store key) once every unit is applied; a server stops when it is complete and
every worker it knows has left, after sending worker slot 0 (the one that writes the run's results) the
final parameters and its account: updates applied, the staleness histogram, and which workers joined and
left, and why.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque

import torch

from shoal import signals
from shoal.comm.collectives import Comm
from shoal.config import Config
from shoal.parallel.param_server import HEADER_DONE, HEADER_STEP
from shoal.parallel.ps_async import HEADER_JOIN, account_tensors, header_size
from shoal.parallel.ps_links import PREFIX, SERVER, Link, registered, slot_of
from shoal.training.serve_checkpoint import ServerCheckpoints


def serve_async(shard, cfg: Config, index: int, workers: int, comm: Comm, store, saver: ServerCheckpoints,
                say=print) -> dict:
    """Serve until the run is complete and every worker left; returns what this server did. `saver`: the
    checkpoints (train/serve_checkpoint.py), holding the state resumed from, if any."""
    k, aggregate, groups = cfg.ps.max_staleness, cfg.ps.aggregate, len(shard.optimizer.param_groups)
    shard_count = cfg.ps.servers
    total_units, timeout = workers * cfg.train.steps, cfg.parallel.timeout_s
    events: queue.Queue = queue.Queue()
    stop = threading.Event()

    def receive(w: int, link: Link) -> None:
        try:
            while True:
                header = link.recv(torch.zeros(header_size(groups), dtype=torch.float64), label="ps header")
                kind = header[0].item()
                grad = shard.recv_grads(link, w) if kind == HEADER_STEP else None
                events.put(("message", w, header.tolist(), grad))
                if kind == HEADER_DONE:
                    return
        except Exception as e:  # the link failed: the worker died, or stalled past the timeout
            events.put(("gone", w, str(e).strip().splitlines()[0][:200], None))

    def listen() -> None:
        known = 0
        while not stop.is_set():
            for w in range(known, registered(store)):
                known = w + 1
                slot = slot_of(store, w)
                try:
                    link = Link(store, index, w, SERVER, timeout, comm)  # waits for the worker's end
                except Exception as e:  # it registered and never linked (died, or gave up and registers anew):
                    # the workers after it must still be heard, so this thread goes on
                    say(f"parameter server {index}: worker {w} (slot {slot}) registered but did not link: "
                        f"{str(e).strip().splitlines()[0][:200]}")
                    continue
                events.put(("join", w, slot, link))
                threading.Thread(target=receive, args=(w, link), daemon=True, name=f"shoal-ps-recv-{w}").start()
            stop.wait(0.05)

    links: dict[int, Link] = {}
    slots: dict[int, int] = {}
    live: set[int] = set()
    clock: dict[int, int] = {}
    since: dict[int, int] = {}  # the largest staleness applied since the worker's last reply
    pulled: dict[int, int] = {}  # the version each live worker's current unit is computed on
    held: list[int] = []  # workers whose reply waits: too far ahead, or (server 0) no unit to give yet
    outbox: list = []
    applied_units: set[int] = set(range(saver.saved))  # a resumed run's cut: every unit before it
    waiting: list[int] = []  # pulled versions of the updates held for the next aggregated step
    newest_lrs: list[float] = []
    hist = saver.state.hist
    version, started = saver.state.version, time.perf_counter()
    resumed_updates = int(hist.sum().item())
    next_unit, requeue, outstanding = saver.saved, deque(), {}  # server 0 deals
    last_from: dict[int, int] = {}  # server 0: the unit it last applied from each worker
    joined, left = saver.state.people["joined"], saver.state.people["left"]
    dealing, first_join = False, 0.0
    finals_sent = 0

    def complete() -> bool:
        if index == 0:
            return len(applied_units) == total_units
        return store.check([f"{PREFIX}/complete"])

    def unit_for(w: int) -> int | None:
        """Server 0: the next unit for `w`; -1 when the run is complete; None: wait (units are out)."""
        nonlocal next_unit
        if requeue:
            unit = requeue.popleft()
        elif next_unit < total_units:
            if saver.propose(next_unit):  # a checkpoint's cut: nothing past it until it is saved
                return None
            unit, next_unit = next_unit, next_unit + 1
        elif complete():
            return -1
        else:
            return None
        outstanding[w] = unit
        return unit

    def reply(w: int, unit: int) -> None:
        meta = torch.tensor([version, since[w], unit], dtype=torch.float64)
        since[w] = 0
        pulled[w] = version
        outbox.extend([links[w].send(meta, label="ps version"), *shard.send_values(links[w], w)])
        for s in [s for s in outbox if s.work.is_completed()]:
            s.wait()  # done: closes its record in the collective log
            outbox.remove(s)

    def release() -> None:
        nonlocal dealing
        if index == 0 and not dealing:  # the start: the launched workers, or whoever came within half the
            # timeout. Not the whole timeout: a joined worker waits for its first unit with that timeout, so
            # when the launched workers start further apart than it (a loaded machine), the first would give
            # up at the moment dealing began, and rejoin
            dealing = len(live) >= workers or bool(first_join) and time.monotonic() - first_join > timeout / 2
            if not dealing:
                return
        slowest = min((clock[u] for u in live), default=0)
        for w in list(held):
            if clock[w] - slowest > k and not complete():
                continue
            unit = unit_for(w) if index == 0 else -1
            if unit is None:
                continue
            held.remove(w)
            reply(w, unit)

    def step() -> None:
        nonlocal version
        shard.set_held(len(waiting))
        # an update of len(waiting) units is that share of a global batch: the linear scaling rule
        # (measured: each update at the global batch's rate, AdamW moved ~n times as far per sample, and
        # at lr 2e-3 with 3 workers ended at val 2.73-2.89 where synchronous training reaches 2.645)
        shard.apply([lr * (len(waiting) / workers) for lr in newest_lrs])
        for v in waiting:
            staleness = version - v
            hist[min(staleness, len(hist) - 1)] += 1
            for u in since:
                since[u] = max(since[u], staleness)
        waiting.clear()
        version += 1

    def flush() -> int:
        if waiting:
            step()
        return version

    def save_if_due() -> None:
        """At a checkpoint's cut, once every unit before it is applied here: the save (collective over
        the servers), then dealing goes on."""
        if not saver.enabled:
            return
        if index == 0:
            saver.propose(next_unit)
        else:
            saver.announced()
        if saver.save_if_reached(len(applied_units), flush):
            say(f"parameter server {index}: checkpoint at step {saver.saved // workers} "
                f"(units before {saver.saved}, version {version})")
            release()

    listener = threading.Thread(target=listen, daemon=True, name="shoal-ps-listen")
    listener.start()
    idle_since = None
    try:
        while True:
            if signals.requested():  # the elastic agent stopping the survivors of a dead server, or Ctrl-C:
                # nothing to finish (a save needs every unit before its cut); the newest checkpoint stands
                raise signals.Interrupted(signals.requested(), saver.saved // workers, saver.newest())
            if complete() and not live and joined:  # done, once slot 0 has had the final parameters
                idle_since = idle_since or time.monotonic()
                if finals_sent or time.monotonic() - idle_since > timeout:  # or it did not come back
                    break
            else:
                idle_since = None
            try:
                event, w, data, grad = events.get(timeout=0.2)
            except queue.Empty:
                release()  # the start's timeout may have passed
                save_if_due()  # a cut announced meanwhile
                continue
            if event == "join":
                links[w], slots[w] = grad, data
                live.add(w)
                clock[w] = min((clock[u] for u in live if u != w), default=0)
                since[w] = 0
                shard.track_worker(w)
                first_join = first_join or time.monotonic()
                joined.append({"worker": w, "slot": data, "at_version": version})
                say(f"parameter server {index}: worker {w} (slot {data}) joined at version {version}")
                continue
            if event == "gone":
                if w not in live:
                    continue
                live.discard(w)
                if w in held:
                    held.remove(w)
                if index == 0 and w in outstanding and outstanding[w] not in applied_units:
                    requeue.appendleft(outstanding.pop(w))  # trained again, by the next worker that asks
                if index == 0 and shard_count > 1 and w in last_from:
                    # its last push may have reached this server and not all others (it died between
                    # them): dealt again, servers that applied it skip it
                    requeue.append(last_from.pop(w))
                left.append({"worker": w, "slot": slots[w], "why": data, "at_version": version})
                say(f"parameter server {index}: worker {w} (slot {slots[w]}) left: {data}")
                links.pop(w).close()
                release()
                continue
            kind, unit, pulled_version, norm, *lrs = data
            unit = int(unit)
            if kind == HEADER_DONE:
                live.discard(w)
                if slots[w] == 0 and complete():  # the final parameters and this server's account
                    if waiting:  # the last few updates, fewer than ps.aggregate
                        step()
                    reply(w, -1)
                    fresh = int(hist.sum().item()) - resumed_updates
                    for t in account_tensors(hist, time.perf_counter() - started, fresh, saver.state.people):
                        outbox.append(links[w].send(t, label="ps account"))
                    finals_sent += 1
                release()
                continue
            if kind == HEADER_STEP and unit not in applied_units:
                shard.set_grads(grad)
                shard.clip(torch.tensor(norm, dtype=torch.float64))  # each update clipped as a whole
                shard.hold()
                waiting.append(int(pulled_version))
                newest_lrs = lrs
                applied_units.add(unit)
                outstanding.pop(w, None)
                last_from[w] = unit
                if len(waiting) == aggregate or (index == 0 and len(applied_units) == total_units):
                    step()
                save_if_due()
                if index == 0 and complete():
                    store.set(f"{PREFIX}/complete", "1")
            if kind != HEADER_JOIN:
                clock[w] += 1
            held.append(w)
            release()
        for s in outbox:
            s.wait()
    finally:
        stop.set()
    applied = int(hist.sum().item())
    return {"applied": applied, "staleness_max": max((s for s, c in enumerate(hist.tolist()) if c), default=0),
            "workers_joined": len(joined), "workers_left": left}
