"""The sockets of a live run's generation: those this process opened, cut when it leaves the generation,
and watched so that a peer's closed end is noticed at once.

[Note: cutting a group's connections] gloo on CPU cannot interrupt a pending receive: a rank whose
peer gave up on a collective waits until the group's timeout (ProcessGroup.abort() and shutdown() leave
it waiting: measured with torch 2.13). Destroying the group would close its connections, but a group
that DDP has wrapped stays referenced after destroy_process_group (measured: 10 references held from
C++ after the DDP module is gone, so the sockets stay open until the process ends). A live elastic
run therefore shuts down the sockets a generation opened when it leaves that generation: a peer still
waiting on it fails at once ("Connection closed by peer": measured 0.00-0.01 s against the group's
timeout before). Listening sockets are left alone: shutting gloo's listener down makes its accept
thread terminate the process ("accept: Invalid argument").
"""

from __future__ import annotations

import os
import select
import socket
import threading
from collections.abc import Iterator

import torch.distributed as dist


def open_sockets() -> set[tuple[int, str]]:
    """This process's sockets now, as (file descriptor, "socket:[inode]"): a descriptor number closed and
    reused by a new socket is a new pair, so "opened since" stays true when old sockets close meanwhile."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (listdir's own descriptor among them)
            continue
        if link.startswith("socket:"):
            found.add((int(fd), link))
    return found


def cut_connections(sockets: set[tuple[int, str]]) -> int:
    """Shut down the connected ones among `sockets` (from open_sockets), leaving them open (their owners
    close them); returns how many ([Note: cutting a group's connections])."""
    cut = 0
    for s in _connected(sockets):
        try:
            s.shutdown(socket.SHUT_RDWR)
            cut += 1
        except OSError:  # already shut
            pass
    return cut


def _connected(sockets: set[tuple[int, str]]) -> Iterator[socket.socket]:
    """The connected ones among `sockets` that are still what open_sockets saw (a closed descriptor's number
    may have been taken by another), each lent as a socket object and detached after (its owner closes it)."""
    for fd, link in sockets:
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != link:
                continue
            s = socket.socket(fileno=fd)
        except OSError:  # closed since, or not a socket any more
            continue
        try:
            if not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                yield s
        except OSError:  # not connected
            pass
        finally:
            s.detach()


class PeerLost(dist.DistError):
    """A connection of this generation's group closed under a step: a peer is gone (ConnectionWatch)."""


class ConnectionWatch:
    """Notices, with no traffic on them, that the far end of one of `sockets` (from open_sockets) closed
    or reset it, or that this rank cut it: a peer's process ended (the kernel closes its sockets at once) or gave
    up. gloo itself learns of it only at its next collective on that connection, which in a DDP step is the
    gradient all-reduce at the end of backward; a live run's layers ask `check()` as they run
    (comm/phase.py), so that a survivor stops computing a step that can no longer complete. A daemon thread
    waits on an epoll of its own over the same sockets (gloo's loop has its own; neither reads for the
    other: this one asks only for hang-ups). Listening sockets are left out."""

    POLL_S = 0.2  # how soon the thread sees close()

    def __init__(self, sockets: set[tuple[int, str]]):
        self._epoll = select.epoll()
        self._lost = threading.Event()
        self._closed = threading.Event()
        for s in _connected(sockets):
            self._epoll.register(s.fileno(), select.EPOLLRDHUP | select.EPOLLHUP | select.EPOLLERR)
        threading.Thread(target=self._run, daemon=True, name="shoal-connection-watch").start()

    def _run(self) -> None:
        try:
            while not self._closed.is_set():
                if self._epoll.poll(self.POLL_S):  # level-triggered: a hang-up stays reported
                    self._lost.set()
                    return
        finally:
            self._epoll.close()

    def lost(self) -> bool:
        return self._lost.is_set()

    def check(self) -> None:
        """Raise PeerLost if a connection is gone."""
        if self._lost.is_set():
            raise PeerLost("a connection of the group closed: a peer is gone")

    def close(self) -> None:
        self._closed.set()
