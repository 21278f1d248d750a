"""A parameter-server worker, asynchronous (parallel.ps_mode = "async"): its side of the wire.

Data is dealt, not split: a global batch of step t is cut into one share per worker (the shares every-step
data parallelism would give, unit u = t * workers + shard), and server 0 hands out the next unit with
each reply, in order. Worker w starts with unit w. So the sequence of units is the run's fixed data
order, every unit is trained once, and a fast worker simply trains more of them; which worker trains
which unit depends on timing (as does the order updates arrive in).

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
  no unit left -> the header [0, ...]: the worker leaves; worker 0 then receives the final parameters
              and each server's account (updates applied, staleness histogram) once every worker left
"""

from __future__ import annotations

import torch

from shoal.comm.collectives import Comm
from shoal.parallel.param_server import HEADER_DONE, HEADER_STEP, PushPull

HEADER_SKIP = 3.0


def staleness_bins(workers: int, max_staleness: int) -> int:
    """Histogram length: a worker may be max_staleness + 1 pushes ahead of one that has just pulled and
    max_staleness behind it, so an update waits for at most (2 k + 1) updates of each other worker; one
    more bin counts anything beyond (none is expected)."""
    return (2 * max_staleness + 1) * (workers - 1) + 2


class AsyncPushPull(PushPull):
    name = "parameter-server (async)"

    def __init__(self, comm: Comm, server_ranks: list[int], worker: int, workers: int, max_staleness: int,
                 sparse: bool = False):
        super().__init__(comm, server_ranks, worker == 0, sparse)
        self.unit = worker  # the first unit: dealt by rank; then server 0 deals
        self.workers, self.max_staleness = workers, max_staleness
        self.versions = [0] * len(server_ranks)  # each server's version this worker's parameters are
        self.staleness_max = 0  # the largest staleness the servers applied since the previous pull
        self.left = False
        self.account: dict = {}

    def after_backward(self) -> None:
        self.norm = torch.nn.utils.get_total_norm([p.grad for shard in self.shards for p in shard]).double()

    def header(self, kind: float, lrs: list[float], rank: int, version: int):
        msg = torch.tensor([kind, self.unit, version, self.norm.item(), *lrs], dtype=torch.float64)
        return self.comm.send(msg, rank, "ps header")

    def update(self, lrs: list[float]) -> None:
        sends = []
        for rank, wire, version in zip(self.server_ranks, self.wires, self.versions, strict=True):
            sends += [self.header(HEADER_STEP, lrs, rank, version), *self.push(rank, wire)]
        for s in sends:
            s.wait()
        self.pull()

    def skip(self, lrs: list[float]) -> None:
        for s in [self.header(HEADER_SKIP, lrs, rank, v) for rank, v in zip(self.server_ranks, self.versions,
                                                                           strict=True)]:
            s.wait()
        self.pull()

    def pull(self) -> None:
        self.staleness_max = 0
        for i, (rank, wire) in enumerate(zip(self.server_ranks, self.wires, strict=True)):
            version, staleness, unit = self.comm.recv(torch.zeros(3, dtype=torch.float64), rank, "ps version").tolist()
            self.versions[i] = int(version)
            self.staleness_max = max(self.staleness_max, int(staleness))
            if i == 0:
                self.unit = int(unit)
            self.pull_from(rank, wire)

    def finish(self) -> None:
        """Leave (once); worker 0 then waits for the final parameters and the servers' accounts."""
        if self.left:
            return
        self.left = True
        for s in [self.header(HEADER_DONE, [0.0] * self.groups, rank, 0) for rank in self.server_ranks]:
            s.wait()
        if not self.is_first:
            return
        self.pull()
        bins = staleness_bins(self.workers, self.max_staleness)
        accounts = [self.comm.recv(torch.zeros(2 + bins, dtype=torch.float64), rank, "ps account").tolist()
                    for rank in self.server_ranks]
        applied, seconds, *hist = accounts[0]
        self.account = {
            "mode": "async", "max_staleness": self.max_staleness, "updates_applied": int(applied),
            "updates_per_s": applied / seconds if seconds else None,
            # server 0's (each server applies every update, in the order they reach it)
            "staleness_histogram": {str(s): int(c) for s, c in enumerate(hist) if c},
            "staleness_max": max(max((s for s, c in enumerate(h) if c), default=0) for _, _, *h in accounts)}

    def step_metrics(self) -> dict:
        return {**super().step_metrics(), "ps_version": self.versions[0], "staleness_max": self.staleness_max}

    def report(self) -> dict:
        return {"parameter_server": self.account} if self.account else {}
