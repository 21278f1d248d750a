"""A parameter-server worker, asynchronous (ps.mode = "async"): its side of the wire.

Workers talk to each server over a link of their own (ps_links.py), so they can come and go: a new
or restarted worker registers, joins (header [4, ...]: the reply is the current parameters and a unit),
and trains. Data is dealt, not split: a global batch of step t is cut into one share per worker (the shares every-step
data parallelism would give, unit u = t * workers + shard), and server 0 hands out the next unit with
each reply, in order. Worker w starts with unit w. So the sequence of units is the run's fixed data
order, every unit is trained once (a unit whose worker left before it was applied is dealt again), and
a fast worker simply trains more of them; which worker trains which unit depends on timing (as does
the order updates arrive in).

One unit, on a worker:
  forward/backward of the unit (loss normalised by the unit's own items: the update is one worker's)
  after_backward: the gradient's norm, over the whole model (this worker holds all of it): the servers
              clip every shard by it, so each update is clipped as a whole, as one process would
  optimizer.step() -> to each server: a header [1, unit, the version of that server's tensors this
              gradient was computed on, norm, lr of each group] and the gradients of its tensors; then
              from each server: [its version, the largest staleness it applied since this worker's
              last pull, the next unit (server 0; -1: none left)] and its tensors' new values. A server
              may hold the reply back (stale-synchronous parallel, train/serve.py)
  a bad step -> the header [3, unit, ...] without gradients: nothing is applied, the reply comes
  no unit left -> the header [0, ...]: the worker leaves; the worker of slot 0 then receives the final
              parameters and each server's account (updates applied, staleness histogram, the workers
              that joined and left) once every unit is applied
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable

import torch

from shoal.comm.collectives import Comm
from shoal.parallel.param_server import HEADER_DONE, HEADER_STEP, PushPull
from shoal.parallel.ps_links import WORKER, Link, register

HEADER_SKIP, HEADER_JOIN = 3.0, 4.0


class LinkLost(RuntimeError):
    """A link to a server failed: the servers died (and may be restarting), or they dropped this worker
    as stalled."""


def header_size(groups: int) -> int:
    """[kind, unit, pulled version, norm, one learning rate per parameter group]"""
    return 4 + groups


def staleness_bins(workers: int, max_staleness: int) -> int:
    """Histogram length: a worker may be max_staleness + 1 pushes ahead of one that has just pulled and
    max_staleness behind it, so an update waits for at most (2 k + 1) updates of each other worker; one
    more bin counts anything beyond (a worker that joined late, or none)."""
    return (2 * max_staleness + 1) * (workers - 1) + 2


def json_tensor(obj) -> torch.Tensor:
    """`obj` as JSON in a uint8 tensor (it travels over a link and sits in a safetensors file)."""
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)


def tensor_json(t: torch.Tensor):
    return json.loads(bytes(t.tolist()).decode())


def account_tensors(hist: torch.Tensor, seconds: float, fresh: int, people: dict) -> list[torch.Tensor]:
    """A server's account for worker slot 0: [updates applied, seconds serving, updates applied in them
    (not those a checkpoint resumed from), bytes of the JSON, histogram...] and the JSON of who joined
    and left, and which checkpoints the servers resumed from (uint8)."""
    text = json_tensor(people)
    return [torch.cat([torch.tensor([hist.sum().item(), seconds, fresh, len(text)], dtype=torch.float64), hist]),
            text]


class AsyncPushPull(PushPull):
    name = "parameter-server (async)"

    def __init__(self, comm: Comm, store, servers: int, slot: int, workers: int, max_staleness: int,
                 timeout_s: float, sparse: bool = False, reopen: Callable[[], object] | None = None):
        super().__init__(comm, list(range(servers)), slot == 0, sparse)
        self.store, self.slot, self.timeout_s = store, slot, timeout_s
        # a new connection to the store the roles meet in (a restarted server 0 hosts a new one); None:
        # the job's own store, which lives as long as this worker does
        self.reopen = reopen
        self.workers, self.max_staleness = workers, max_staleness
        self.unit = -1
        self.versions = [0] * servers  # each server's version this worker's parameters are
        self.staleness_max = 0  # the largest staleness the servers applied since the previous pull
        self.links: list[Link] = []
        self.left = False
        self.account: dict = {}

    def join(self) -> None:
        """Register, link to every server, and pull the current parameters and a first unit."""
        with self.lost():
            worker = register(self.store, self.slot)
            self.links = [Link(self.store, s, worker, WORKER, self.timeout_s, self.comm) for s in self.server_ranks]
            for s in [link.send(self.message(HEADER_JOIN, [0.0] * self.groups, 0), label="ps header")
                      for link in self.links]:
                s.wait()
            self.pull()

    def rejoin(self, why: str, stop: Callable[[], bool], say=print) -> bool:
        """After a LinkLost: join the servers anew, retrying for parallel.timeout_s (restarted servers
        take seconds to come back from their checkpoint; until then there is no store to reach).
        Returns False when `stop()` said to give up first (the run is being stopped)."""
        say(f"worker slot {self.slot}: lost the servers ({why}); joining again")
        for link in self.links:
            with contextlib.suppress(Exception):
                link.close()
        self.left, deadline = False, time.monotonic() + self.timeout_s
        while not stop():
            try:
                if self.reopen is not None:
                    self.store = self.reopen()
                self.join()
                return True
            except (LinkLost, RuntimeError) as e:
                if time.monotonic() > deadline:
                    raise LinkLost(f"the servers did not come back within parallel.timeout_s "
                                   f"({self.timeout_s:g} s): {str(e).strip().splitlines()[0][:200]}") from None
                time.sleep(0.5)
        return False

    @contextlib.contextmanager
    def lost(self):
        """A failing link (or store) raises LinkLost."""
        try:
            yield
        except LinkLost:
            raise
        except RuntimeError as e:  # gloo's and the store's errors (DistError is one)
            raise LinkLost(str(e).strip().splitlines()[0][:200]) from e

    def after_backward(self) -> None:
        self.norm = torch.nn.utils.get_total_norm([p.grad for shard in self.shards for p in shard]).double()

    def message(self, kind: float, lrs: list[float], version: int) -> torch.Tensor:
        return torch.tensor([kind, self.unit, version, self.norm.item(), *lrs], dtype=torch.float64)

    def update(self, lrs: list[float]) -> None:
        with self.lost():
            sends = []
            for link, wire, version in zip(self.links, self.wires, self.versions, strict=True):
                sends += [link.send(self.message(HEADER_STEP, lrs, version), label="ps header"),
                          *self.push(link, wire)]
            for s in sends:
                s.wait()
            self.pull()

    def skip(self, lrs: list[float]) -> None:
        with self.lost():
            for s in [link.send(self.message(HEADER_SKIP, lrs, v), label="ps header")
                      for link, v in zip(self.links, self.versions, strict=True)]:
                s.wait()
            self.pull()

    def pull(self) -> None:
        self.staleness_max = 0
        for i, (link, wire) in enumerate(zip(self.links, self.wires, strict=True)):
            version, staleness, unit = link.recv(torch.zeros(3, dtype=torch.float64), label="ps version").tolist()
            self.versions[i] = int(version)
            self.staleness_max = max(self.staleness_max, int(staleness))
            if i == 0:
                self.unit = int(unit)
            self.pull_from(link, wire)

    def finish(self) -> None:
        """Leave (once); slot 0 then waits for the final parameters and the servers' accounts."""
        if self.left:
            return
        self.left = True
        with self.lost():
            self._finish()

    def _finish(self) -> None:
        for s in [link.send(self.message(HEADER_DONE, [0.0] * self.groups, 0), label="ps header")
                  for link in self.links]:
            s.wait()
        if not self.is_first:
            return
        self.pull()
        bins = staleness_bins(self.workers, self.max_staleness)
        accounts = []
        for link in self.links:
            applied, seconds, fresh, size, *hist = link.recv(torch.zeros(4 + bins, dtype=torch.float64),
                                                      label="ps account").tolist()
            people = tensor_json(link.recv(torch.zeros(int(size), dtype=torch.uint8), label="ps account"))
            accounts.append((applied, fresh / seconds if seconds else None, hist, people))
        applied, per_s, hist, people = accounts[0]
        self.account = {
            "mode": "async", "max_staleness": self.max_staleness, "updates_applied": int(applied),
            "updates_per_s": per_s,
            # server 0's (each server applies every update, in the order they reach it)
            "staleness_histogram": {str(s): int(c) for s, c in enumerate(hist) if c},
            "staleness_max": max(max((s for s, c in enumerate(h) if c), default=0) for *_, h, _ in accounts),
            "workers_joined": people["joined"], "workers_left": people["left"],
            "servers_resumed": people.get("resumed", [])}

    def step_metrics(self) -> dict:
        return {**super().step_metrics(), "ps_version": self.versions[0], "staleness_max": self.staleness_max}

    def report(self) -> dict:
        return {"parameter_server": self.account} if self.account else {}
