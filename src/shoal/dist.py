"""Process-group setup and teardown for one worker.

[Note: per-attempt store] After torch elastic restarts a worker group, building the new group on the
agent's store as-is fails often on gloo ("connectFullMesh failed ... Connection refused": keys of the
dead attempt are still there; measured here 2 of 3 restarts failing). Prefixing the store with the
restart attempt gives each attempt clean keys: 4 of 4 recoveries.

[Note: exit] A gloo worker can abort with SIGABRT in static destructors after all its work is done
("terminate called without an active exception"; 2 of 20 plain DDP runs here, even after barrier +
destroy_process_group). Workers therefore end with os._exit after flushing: the exit code is the
run's, not the destructor's (0 of 16 runs aborted that way).

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
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from shoal.comm import flight


def is_launched() -> bool:
    """True inside a worker started by torch elastic (shoal --nproc, torchrun) or a similar per-process
    launcher. LOCAL_RANK tells a worker from a Kubeflow PyTorchJob pod, which gets the other four for the
    node; an Azure ML node gets all five, and is told apart by its variables ([Note: pod or worker] in
    launch/environment.py)."""
    return (all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"))
            and not azureml_node(os.environ))


def azureml_node(env) -> bool:
    """A node of an Azure ML job with the PyTorch distribution (it sets RANK, LOCAL_RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT and NODE_RANK on each), as opposed to a worker that a launcher on it started
    (torch elastic's carry TORCHELASTIC_RUN_ID; shoal's live workers SHOAL_LIVE_ID)."""
    return ("AZUREML_RUN_ID" in env and "NODE_RANK" in env and "TORCHELASTIC_RUN_ID" not in env
            and "SHOAL_LIVE_ID" not in env)


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    restart_count: int
    device: torch.device
    store: dist.Store  # prefixed per attempt; shared by all ranks for small key/value exchanges
    status_store: dist.Store  # the same keys over a second connection, for the watchdog thread


def init(backend: str, timeout_s: float, device: str | None = None) -> DistEnv:
    """Join (or, alone, create) the default process group; `device` as join's."""
    if not is_launched():
        store = dist.HashStore()
        return join(backend, timeout_s, store, store, rank=0, world_size=1, device=device)
    env = os.environ
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    restart = int(env.get("TORCHELASTIC_RESTART_COUNT", 0))
    timeout = timedelta(seconds=timeout_s)
    # under torch elastic the agent hosts the store; a hand-rolled env launch makes rank 0 host it
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    base = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world,
                         is_master=(rank == 0 and not agent_store), timeout=timeout)
    # a node joining an elastic job re-forms the group without counting a restart: the world size
    # tells those rounds apart
    prefix = f"shoal/attempt_{restart}_world_{world}"
    side = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=False,
                         timeout=timedelta(seconds=10), wait_for_workers=False)
    store, status_store = dist.PrefixStore(prefix, base), dist.PrefixStore(prefix, side)  # [Note: per-attempt store]
    return join(backend, timeout_s, store, status_store, rank, world, int(env.get("LOCAL_RANK", 0)),
                int(env.get("LOCAL_WORLD_SIZE", 1)), restart, device=device)


def join(backend: str, timeout_s: float, store, status_store, rank: int, world_size: int, local_rank: int = 0,
         local_world_size: int = 1, restart_count: int = 0, device: str | None = None) -> DistEnv:
    """The default process group over `store`, with torch's flight recorder on (comm/flight.py). `device`:
    "cuda" or "cpu" (the layout's); None: GPUs under NCCL, the CPU under gloo. On GPUs, local rank r takes
    GPU r mod the GPUs: one each under NCCL (the launcher refuses more workers than GPUs), shared under gloo."""
    flight.enable()
    kind = device or ("cuda" if backend == "nccl" else "cpu")
    where = torch.device("cpu")
    if kind == "cuda":
        where = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(where)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    return DistEnv(rank, world_size, local_rank, local_world_size, restart_count, where, store, status_store)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int) -> None:
    """End a worker process with `code`, skipping destructors that may abort ([Note: exit])."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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
