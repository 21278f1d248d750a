"""Who is in a live elastic run (`--nnodes MIN:MAX`): generations of members, agreed over the store
that node 0's launcher hosts.

[Note: live membership] torch elastic cannot grow a running job: with torch 2.13 a node joining a
running c10d job hangs both agents in re-rendezvous (each waits 60 s on the other's store keys,
role_info / MASTER_ADDR; plain torchrun, one host, loopback), and its agent restarts every worker
of every node on any failure. A live run therefore keeps its own membership, on a plain TCPStore:

- a member is one worker process, named by an id its node's launcher draws (`next_id`); it beats a
  counter (`beat/<id>`) from a thread of its own, and its launcher marks it `gone/<id>` the moment
  the process ends; a node that dies whole is seen by node 0's launcher (`watch_beats`), which marks
  a member of the newest generation gone when its beat stands still for SILENT_S; a member marked
  gone while its process still runs (evicted, below, or its node silent and back) is ended by its
  launcher, its stack printed first;
- a member gone by failure counts in `lost`; each member's heartbeat thread reads it and, when a
  member of its generation is among them, cuts that generation's connections (the worker's `cut`),
  so a survivor waiting in a collective on a node that vanished without closing its sockets fails
  within seconds instead of at the group's timeout;
- a generation g is a closed list of members in rank order (`g<g>/closed`); its process group lives
  under the store prefix `shoal/live/g<g>`, so no key of a broken generation is ever read again;
- after a failure, or at a step boundary where some member leaves (`leaving/<id>`) or a joiner waits
  (`join_requests` counts them), the candidates append themselves to `g<g+1>/roster`; the first of
  them to see the roster complete closes it with compare-and-set, so all read one list. Complete:
  every member of g is in it, leaving, gone, or still (or, alive but absent for `evict_s` seconds,
  evicted and named), there are at least `min_world`, and (the first generation) `max_world` came or
  no one arrived for LAST_CALL_S; where the scheduler says how many nodes it started (a Slurm step over
  a node range), that many workers came or no one arrived for START_CALL_S; and the first generation
  also waits, up to START_CALL_S, for a worker whose launcher has drawn its id (it is importing torch,
  not missing). Members of g come first,
  in their old order, then joiners by id.
  A candidate left out (a late joiner, more than `max_world`) tries the next generation.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

PREFIX = "shoal/live/"
STORE_ENV = "SHOAL_LIVE_STORE"  # host:port of the membership store (node 0's launcher)
WORLD_ENV = "SHOAL_LIVE_WORLD"  # "min:max" workers, or "min:max:start" (start: the scheduler started so many)
ID_ENV = "SHOAL_LIVE_ID"  # this worker's member id, drawn by its launcher
EVICTED = "stalled past parallel.timeout_s, evicted"
BEAT_S = 0.2  # a member's heartbeat period
STALE_S = 1.5  # a beat unchanged this long: a regroup does not wait for the member
# a beat unchanged this long: node 0's launcher marks the member gone, and its peers cut their connections
# to it. Longer than STALE_S: on 2 busy cores a live member's beat once stood still for 1.5 s (4 workers
# and a joiner's start), and marking it gone then cut a working group
SILENT_S = 10.0
LAST_CALL_S = 2.0  # the first generation waits this long after the last arrival for more (up to max)
# ... or this long for the workers a scheduler started (torchrun's last call): a host capped at half a core
# took 3 s longer than the others to start its worker, and the run began without it
START_CALL_S = 30.0
LOST_KEY = PREFIX + "lost"  # how many members have gone by failure so far


def is_live_worker() -> bool:
    return STORE_ENV in os.environ and ID_ENV in os.environ


def connect(endpoint: str, timeout_s: float = 60) -> dist.TCPStore:
    """A client of the membership store at HOST:PORT."""
    host, _, port = endpoint.rpartition(":")
    return dist.TCPStore(host.strip("[]"), int(port), is_master=False, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def draw_id(store: dist.Store, node: str, local_rank: int) -> int:
    """A new member id (the launcher draws it before starting the worker), with where it runs."""
    member = int(store.add(PREFIX + "next_id", 1))
    store.set(f"{PREFIX}where/{member}", f"{node} local rank {local_rank}")
    return member


def mark_gone(store: dist.Store, member: int, why: str = "its process ended", failed: bool = True) -> None:
    """`member` is out of the run, `why` in words; `failed`: its peers must not wait on it (a worker
    that finished the run is gone without that)."""
    store.set(f"{PREFIX}gone/{member}", why)
    if failed:
        store.add(LOST_KEY, 1)


def why_out(store: dist.Store, member: int) -> str | None:
    """Why `member` is marked gone (None: it is not)."""
    key = f"{PREFIX}gone/{member}"
    return store.get(key).decode() if store.check([key]) else None


def watch_beats(store: dist.Store, stop: threading.Event) -> None:
    """Node 0's launcher, until `stop`: mark gone each member of the newest generation whose beat has not
    moved for SILENT_S (its node died whole, or lost the network)."""
    seen: dict[int, tuple[int, float]] = {}
    while not stop.wait(BEAT_S):
        try:
            key = PREFIX + "gen"
            if not store.check([key]):
                continue
            closed = f"{PREFIX}g{int(store.get(key))}/closed"
            now = time.monotonic()
            for m in json.loads(store.get(closed))["members"]:
                if store.check([f"{PREFIX}gone/{m}"]):
                    continue
                beat = int(store.add(f"{PREFIX}beat/{m}", 0))
                last, since = seen.get(m, (None, now))
                if beat != last:
                    seen[m] = (beat, now)
                elif now - since >= SILENT_S:
                    mark_gone(store, m, f"no heartbeat for {SILENT_S:g} s: its node is gone")
        except Exception:  # noqa: BLE001 - the store is going away with the run
            return


def finish(store: dist.Store) -> None:
    """The run is over (trained to the end, or stopped): joiners still waiting leave."""
    store.set(PREFIX + "done", "1")


def is_done(store: dist.Store) -> bool:
    return store.check([PREFIX + "done"])


def all_gone(store: dist.Store) -> bool:
    """Every member drawn so far is marked gone: its launcher saw its worker end (and wrote that here), or
    node 0's launcher saw its node fall silent."""
    drawn = int(store.add(PREFIX + "next_id", 0))
    return store.check([f"{PREFIX}gone/{m}" for m in range(1, drawn + 1)]) if drawn else True


def beats(store: dist.Store) -> dict[int, int]:
    """Every member's heartbeat count so far (unchanged over STALE_S: that member is gone)."""
    return {m: int(store.add(f"{PREFIX}beat/{m}", 0)) for m in range(1, int(store.add(PREFIX + "next_id", 0)) + 1)}


@dataclass(frozen=True)
class Generation:
    number: int
    members: tuple[int, ...]  # member ids in rank order
    admitted: int  # join requests counted when it closed: more means a joiner waits
    evicted: tuple[int, ...] = ()  # members alive but absent past evict_s (stalled)

    def rank_of(self, member: int) -> int:
        return self.members.index(member)

    @property
    def world(self) -> int:
        return len(self.members)

    @property
    def prefix(self) -> str:
        return f"{PREFIX}g{self.number}"


@dataclass
class Member:
    """This worker in a live run: its id, its heartbeat, and the generations it is part of."""

    store: dist.Store
    endpoint: str
    id: int
    min_world: int
    max_world: int
    evict_s: float  # an alive member absent this long from a regroup is evicted (parallel.timeout_s)
    start_world: int | None = None  # the workers a scheduler started together: the first generation waits for them
    join_timeout_s: float = 600.0  # below min_world: how long to wait for joiners
    _stop: threading.Event = field(default_factory=threading.Event)
    _join_requests: int = 0  # as the heartbeat thread last read it
    _ticket: int = 0  # this worker's own join request: the count it made join_requests
    _lost: int = 0  # LOST_KEY as the heartbeat thread last read it
    _watched: tuple | None = None  # (generation, what cuts its connections), while this member trains in it
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def from_env(cls, evict_s: float) -> Member:
        endpoint = os.environ[STORE_ENV]
        lo, hi, *start = os.environ[WORLD_ENV].split(":")
        member = cls(connect(endpoint), endpoint, int(os.environ[ID_ENV]), int(lo), int(hi), evict_s,
                     int(start[0]) if start else None)
        member.start_beating()
        return member

    def start_beating(self) -> None:
        side = connect(self.endpoint)  # its own connection: the main thread's may be blocked in a wait
        key = f"{PREFIX}beat/{self.id}"

        def beat() -> None:  # and read the join requests, so that the training step never waits on the store
            while not self._stop.wait(BEAT_S):
                try:
                    side.add(key, 1)
                    self._join_requests = int(side.add(PREFIX + "join_requests", 0))
                    lost = int(side.add(LOST_KEY, 0))
                    if lost != self._lost:
                        self._lost = lost
                        self._cut_if_lost(side)
                except Exception:  # noqa: BLE001 - the store's host is gone: the run ends anyway
                    return

        side.add(key, 1)
        threading.Thread(target=beat, daemon=True, name="shoal-heartbeat").start()

    def stop(self) -> None:
        self._stop.set()

    def watch(self, generation: Generation | None, cut: Callable[[], object] | None = None) -> None:
        """From now on, call `cut` (once) if a member of `generation` is lost: it cuts the generation's
        connections. None: stop watching (this member is leaving that generation)."""
        with self._lock:
            self._watched = (generation, cut) if generation is not None else None
            self._lost = -1  # so the next beat also looks at losses counted before this call

    def _cut_if_lost(self, store: dist.Store) -> None:
        with self._lock:
            if self._watched is None:
                return
            generation, cut = self._watched
            if any(store.check([f"{PREFIX}gone/{m}"]) for m in generation.members if m != self.id):
                cut()
                self._watched = None

    def where(self, member: int) -> str:
        key = f"{PREFIX}where/{member}"
        return self.store.get(key).decode() if self.store.check([key]) else f"member {member}"

    def current(self) -> int:
        """The newest closed generation's number (-1: none yet)."""
        key = PREFIX + "gen"
        return int(self.store.get(key)) if self.store.check([key]) else -1

    def leave(self) -> None:
        """Say this member leaves cleanly at the coming regroup."""
        self.store.set(f"{PREFIX}leaving/{self.id}", "1")

    def request_join(self) -> None:
        self._ticket = int(self.store.add(PREFIX + "join_requests", 1))

    def join_wanted(self, generation: Generation) -> bool:
        """A joiner has asked in since `generation` closed (as of the last heartbeat: no store round trip)."""
        return self._join_requests > generation.admitted

    def regroup(self, previous: Generation | None, give_up: Callable[[], object] = lambda: False) -> Generation | None:
        """Take part in forming the generation after `previous` (None: the first, or this process is a
        joiner that has no generation yet). Returns the new generation when this member is in it; None
        when it was left out (then ask again, with request_join, for the next), or when `give_up()` says
        so while it waits."""
        if previous is None and self.current() >= 0:  # a joiner: the group it joins is the newest one
            previous = self._newest_for_joiner()
        number = (previous.number + 1) if previous is not None else 0
        key = f"{PREFIX}g{number}/"
        self.store.append(key + "roster", f"{self.id};")
        seen: dict[int, tuple[int, float]] = {}  # member -> (last beat seen, when it changed)
        started = last_arrival = time.monotonic()
        count = 0
        while True:
            if self.store.check([key + "closed"]):
                gen = self._read(key, number)
                return gen if self.id in gen.members else None
            roster = [int(x) for x in self.store.get(key + "roster").decode().split(";") if x]
            now = time.monotonic()
            if len(roster) != count:
                count, last_arrival = len(roster), now
            starting = self._starting(roster) if previous is None else 0
            members, evicted = self._complete(previous, roster, seen, now, started, last_arrival, starting)
            if members is not None:
                admitted = int(self.store.add(PREFIX + "join_requests", 0))
                text = json.dumps({"members": members, "admitted": admitted, "evicted": evicted})
                self.store.compare_set(key + "closed", "", text)  # the first closer wins; all read that
                gen = self._read(key, number)
                if gen.number > self.current():
                    self.store.set(PREFIX + "gen", str(gen.number))
                for m in gen.evicted:  # its launcher ends it (node.py): it must not linger, stalled
                    mark_gone(self.store, m, EVICTED, failed=False)
                return gen if self.id in gen.members else None
            if is_done(self.store) or give_up():
                return None
            if now - started > self.join_timeout_s + (self.evict_s if previous else 0):
                raise TimeoutError(f"only {count} of the {self.min_world} workers this run needs at least "
                                   f"(--nnodes MIN x --nproc) came within {self.join_timeout_s:g} s")
            # the members that formed it wait for the slowest to read it: poll often for the first second
            # (a regroup after a failure is one of those), less while waiting for joiners
            time.sleep(0.005 if now - started < 1.0 else 0.02)

    def _newest_for_joiner(self) -> Generation | None:
        """The newest generation, which a joiner joins the next of. One that closed (after a failure, say) having
        counted this worker's request, before it reached the roster, would leave no member ever wanting it
        again: it asks again."""
        newest = self.generation(self.current())
        if newest is not None and self._ticket and newest.admitted >= self._ticket and self.id not in newest.members:
            self.request_join()
        return newest

    def generation(self, number: int) -> Generation | None:
        """Closed generation `number` (None: not closed, or none)."""
        key = f"{PREFIX}g{number}/"
        return self._read(key, number) if number >= 0 and self.store.check([key + "closed"]) else None

    def why_gone(self, member: int) -> str:
        if self.store.check([f"{PREFIX}leaving/{member}"]):
            return "it was asked to stop"
        return why_out(self.store, member) or f"no heartbeat for {STALE_S:g} s: its node is gone"

    def _read(self, key: str, number: int) -> Generation:
        got = json.loads(self.store.get(key + "closed"))
        return Generation(number, tuple(got["members"]), got["admitted"], tuple(got["evicted"]))

    def _complete(self, previous: Generation | None, roster: list[int], seen: dict, now: float, started: float,
                  last_arrival: float, starting: int = 0) -> tuple[list[int] | None, list[int]]:
        """The closed member list if the roster is complete (else None), and who was evicted. `starting`: (the
        first generation) workers whose launcher has drawn their id but which have not arrived yet."""
        evicted = []
        if previous is not None:
            for m in previous.members:
                if m in roster or self._gone(m, seen, now):
                    continue
                if now - started < self.evict_s:
                    return None, []
                evicted.append(m)  # alive (its beat goes on) but it never came: stalled
        if len(roster) < self.min_world:
            return None, []
        if previous is None:
            wanted, wait = (self.start_world, START_CALL_S) if self.start_world else (self.max_world, LAST_CALL_S)
            if len(roster) < wanted and now - last_arrival < wait:
                return None, []
            # a worker whose launcher is up is still starting (importing torch): it is waited for as a
            # scheduler's node is. Under load a node's worker once came after the last call, and the run began
            # without it: it joined at step 3, and a test holding the run at a step counted from the start held
            # it at another
            if starting and len(roster) < self.max_world and now - last_arrival < START_CALL_S:
                return None, []
        old = [m for m in (previous.members if previous else ()) if m in roster]
        new = sorted(m for m in roster if m not in old)
        return (old + new)[:self.max_world], evicted

    def _starting(self, roster: list[int]) -> int:
        """Workers whose launcher drew their id (draw_id, before it starts them) that are neither in `roster`
        nor marked gone (a worker that ended before it arrived is: node.py)."""
        drawn = int(self.store.add(PREFIX + "next_id", 0))
        return sum(1 for m in range(1, drawn + 1)
                   if m not in roster and not self.store.check([f"{PREFIX}gone/{m}"]))

    def _gone(self, member: int, seen: dict, now: float) -> bool:
        """Left cleanly, marked gone by its launcher, or its beat has not moved for STALE_S."""
        if self.store.check([f"{PREFIX}leaving/{member}"]) or self.store.check([f"{PREFIX}gone/{member}"]):
            return True
        beat = int(self.store.add(f"{PREFIX}beat/{member}", 0))
        last, since = seen.get(member, (None, now))
        if beat != last:
            seen[member] = (beat, now)
            return False
        return now - since >= STALE_S
