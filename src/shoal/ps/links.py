"""The asynchronous parameter server's links: one gloo process group of two per (server, worker) pair.

A worker of the asynchronous mode talks to each server over a group of its own, made from a prefix of
a key-value store both can reach (torch's `ProcessGroupGloo(PrefixStore(...), rank, 2)`), not over the
job's world: a worker that dies breaks only its own links (the server's receive fails at once with
"connection reset by peer", measured), and a worker that starts later makes new ones. Workers register
in the store (`shoal-ps/workers` counts them: each gets a new id, a restarted one too); each server
listens for registrations and makes its end of the link when one appears.

A link offers `send` / `recv` as `Comm` does (wire.py's Wire speaks through either), each message in the
collective log for the hang report.
"""

from __future__ import annotations

import datetime
import time

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo

from shoal.comm.collectives import Comm, Pending

PREFIX = "shoal-ps"
COMPLETE = f"{PREFIX}/complete"  # set by server 0 once every unit is applied
SERVED = f"{PREFIX}/served"  # how many servers other than server 0 have ended their loop
SERVER, WORKER = 0, 1  # ranks within a link
# where a link's messages are made, on a GPU run too: a link is a gloo group, and gloo's send and recv hand the
# transport a tensor's address as host memory (ProcessGroupGloo has a CUDA path for its collectives, none for
# send and recv; torch's table of backends says so), so a gradient or parameter from the GPU is copied to the
# host once, and the headers the host reads are never on the GPU at all
DEVICE = torch.device("cpu")


class Link:
    def __init__(self, store, server: int, worker: int, me: int, timeout_s: float, comm: Comm):
        self.server, self.worker, self.me, self.log = server, worker, me, comm.log
        self.group = ProcessGroupGloo(PrefixStore(f"{PREFIX}/link/{server}/{worker}", store), me, 2,
                                      datetime.timedelta(seconds=timeout_s))
        self.peer = WORKER if me == SERVER else SERVER
        self.name = f"server {server}" if me == WORKER else f"worker {worker}"
        self.device = DEVICE

    def send(self, t: torch.Tensor, dst=None, label: str = "ps") -> Pending:
        rec = self.log.enter("send", f"{label}, to {self.name}", [t])
        return Pending(self.group.send([t], self.peer, 0), rec, self.log, t)

    def recv(self, t: torch.Tensor, src=None, label: str = "ps") -> torch.Tensor:
        rec = self.log.enter("recv", f"{label}, from {self.name}", [t])
        return Pending(self.group.recv([t], self.peer, 0), rec, self.log, t).wait()

    def close(self) -> None:
        """Drop the link: the other end's next message fails (a worker that stalled and woke up)."""
        self.group.abort()


def register(store, slot: int) -> int:
    """A new worker's id (workers are numbered in the order they register); `slot`: which of the
    launched workers it is (restarts keep the slot, not the id)."""
    worker = store.add(f"{PREFIX}/workers", 1) - 1
    store.set(f"{PREFIX}/worker/{worker}", str(slot))
    return worker


def registered(store) -> int:
    """How many workers have registered so far."""
    return store.add(f"{PREFIX}/workers", 0)


def slot_of(store, worker: int) -> int:
    return int(store.get(f"{PREFIX}/worker/{worker}").decode())


def leave_in_turn(store, server: int, servers: int, timeout_s: float, stopped=lambda: False) -> None:
    """A server at its end. Server 0 hosts the store the roles meet in (roles.py), and the store ends with
    its process, so it leaves last: a server still finishing would fail reading the store (seen once under
    load: server 1's check of `complete` failed with "connection closed" as server 0 ended). The others
    say they are done and go; server 0 waits for them, at most `timeout_s`, or until `stopped()` (its
    agent stopping it)."""
    if server:
        store.add(SERVED, 1)
        return
    deadline = time.monotonic() + timeout_s
    while store.add(SERVED, 0) < servers - 1 and time.monotonic() < deadline and not stopped():
        time.sleep(0.05)
