"""A parameter-server worker, asynchronous (ps.mode = "async"): its side of the links, and the units of
data it is fed.

Workers talk to each server over a link of their own (links.py), so they can come and go: a new or
restarted worker registers, joins (Push JOIN: the reply is the current parameters and a unit), and
trains. Data is dealt, not split: a global batch of step t is cut into one share per worker (the
shares every-step data parallelism would give, unit u = t * workers + share), and server 0 hands out
the next unit with each reply, in order. Worker w starts with unit w. So the sequence of units is the
run's fixed data order, every unit is trained once (a unit whose worker left before it was applied is
dealt again), and a fast worker simply trains more of them; which worker trains which unit depends on
timing (as does the order updates arrive in).

One unit is one step of the training loop (training/loop.py) over DealtUnits:
  forward/backward of the unit (loss normalised by the unit's own items: the update is one worker's)
  after_backward: the gradient's norm, over the whole model (this worker holds all of it): the servers
              clip every shard by it, so each update is clipped as a whole, as one process would
  optimizer.step() -> to each server: Push STEP [unit, the version of that server's tensors this
              gradient was computed on, norm, lr of each group] and the gradients of its tensors; then
              from each server a Reply [its version, the largest staleness it applied since this
              worker's last pull, the next unit (server 0; -1: none left)] and its tensors' new values.
              A server may hold the reply back (stale-synchronous parallel, async_server.py)
  a bad step -> Push SKIP without gradients: nothing is applied, the reply comes
  no unit left -> Push DONE: the worker leaves; the worker of slot 0 then receives the final parameters
              and each server's Account once every unit is applied
A link that fails (the servers died and may be restarting, or they dropped this worker as stalled)
drops the unit in hand and joins the servers again: restarted servers resume from their checkpoint and
deal what it lacks.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable

import torch

from shoal import signals
from shoal.comm.collectives import Comm
from shoal.config import TrainConfig
from shoal.data.sampler import GlobalBatchSampler
from shoal.models.spec import Batch
from shoal.ps.links import DEVICE, WORKER, Link, register
from shoal.ps.messages import Account, Kind, Push, Reply, staleness_bins
from shoal.ps.worker import PushPull
from shoal.training.optim import Schedule


class LinkLost(RuntimeError):
    """A link to a server failed: the servers died (and may be restarting), or they dropped this worker
    as stalled."""


class AsyncPushPull(PushPull):
    name = "parameter-server (async)"
    verdict_at_once = True

    def __init__(self, comm: Comm, store, *, device: torch.device, servers: int, slot: int, workers: int,
                 max_staleness: int, timeout_s: float, sparse: bool = False,
                 reopen: Callable[[], object] | None = None):
        super().__init__(comm, list(range(servers)), slot == 0, device, DEVICE, sparse)  # links: host messages
        self.store, self.slot, self.timeout_s = store, slot, timeout_s
        # a new connection to the store the roles meet in (a restarted server 0 hosts a new one); None:
        # the job's own store, which lives as long as this worker does
        self.reopen = reopen
        self.workers, self.max_staleness = workers, max_staleness
        self.unit = -1  # the unit server 0 dealt with the last reply (-1: none left)
        self.versions = [0] * servers  # each server's version this worker's parameters are
        self.staleness_max = 0  # the largest staleness the servers applied since the previous pull
        self.links: list[Link] = []
        self.joined = self.left = False
        self.dropped = False  # the last step's update was lost with its link
        self.account: dict = {}

    def after_backward(self) -> None:
        self.norm = torch.nn.utils.get_total_norm([p.grad for shard in self.shards for p in shard]).double()

    def join(self) -> None:
        """Register, link to every server, and pull the current parameters and a first unit."""
        self.resilient(self._join)

    def update(self, lrs: list[float]) -> None:
        def push() -> None:
            sends, norm = [], self.norm.item()  # one read for every server's header
            for link, wire, version in zip(self.links, self.wires, self.versions, strict=True):
                sends += [link.send(Push(Kind.STEP, self.unit, version, norm, lrs).tensor(link.device),
                                    label="ps header"), *self.push(link, wire)]
            for s in sends:
                s.wait()
            self.pull()

        self.resilient(push, drops_update=True)

    def skip(self, lrs: list[float]) -> None:
        def tell() -> None:
            self.send_all(Kind.SKIP, lrs)
            self.pull()

        self.resilient(tell)

    def finish(self) -> None:
        """Leave (once); slot 0 then waits for the final parameters and the servers' accounts."""
        if self.left:
            return
        self.left = True
        with self.lost():
            self.send_all(Kind.DONE, [0.0] * self.groups, version=0)
            if self.is_first:
                self.pull()
                self.account = self.read_accounts()

    def step_metrics(self) -> dict:
        dropped, self.dropped = self.dropped, False
        return {**super().step_metrics(), "ps_version": self.versions[0], "staleness_max": self.staleness_max,
                **({"update_dropped": True} if dropped else {})}

    def report(self) -> dict:
        return {"parameter_server": self.account} if self.account else {}

    # --- the links ----------------------------------------------------------------------------------

    def _join(self) -> None:
        worker = register(self.store, self.slot)
        self.links = [Link(self.store, s, worker, WORKER, self.timeout_s, self.comm) for s in self.server_ranks]
        self.send_all(Kind.JOIN, [0.0] * self.groups, version=0)
        self.pull()
        self.joined = True

    def send_all(self, kind: Kind, lrs: list[float], version: int | None = None) -> None:
        """A Push without gradients to every server (`version`: None, each server's pulled version)."""
        versions = self.versions if version is None else [version] * len(self.links)
        norm = self.norm.item()
        for s in [link.send(Push(kind, self.unit, v, norm, lrs).tensor(link.device), label="ps header")
                  for link, v in zip(self.links, versions, strict=True)]:
            s.wait()

    def pull(self) -> None:
        self.staleness_max = 0
        for i, (link, wire) in enumerate(zip(self.links, self.wires, strict=True)):
            reply = Reply.read(link.recv(torch.empty(Reply.SIZE, dtype=torch.float64, device=link.device),
                                         label="ps version"))
            self.versions[i] = reply.version
            self.staleness_max = max(self.staleness_max, reply.staleness)
            if i == 0:
                self.unit = reply.unit
            self.pull_from(link, wire)

    def read_accounts(self) -> dict:
        bins = staleness_bins(self.workers, self.max_staleness)
        accounts = []
        for link in self.links:
            head = link.recv(torch.empty(Account.head_size(bins), dtype=torch.float64, device=link.device),
                             label="ps account")
            text = link.recv(torch.empty(Account.json_size(head), dtype=torch.uint8, device=link.device),
                             label="ps account")
            accounts.append(Account.read(head, text))
        first = accounts[0]
        return {
            "mode": "async", "max_staleness": self.max_staleness, "updates_applied": first.applied,
            "updates_per_s": first.fresh / first.seconds if first.seconds else None,
            # server 0's (each server applies every update, in the order they reach it)
            "staleness_histogram": {str(s): int(c) for s, c in enumerate(first.histogram) if c},
            "staleness_max": max(max((s for s, c in enumerate(a.histogram) if c), default=0) for a in accounts),
            "workers_joined": first.people["joined"], "workers_left": first.people["left"],
            "servers_resumed": first.people.get("resumed", [])}

    @contextlib.contextmanager
    def lost(self):
        """A failing link (or store) raises LinkLost."""
        try:
            yield
        except LinkLost:
            raise
        except RuntimeError as e:  # gloo's and the store's errors (DistError is one)
            raise LinkLost(str(e).strip().splitlines()[0][:200]) from e

    def resilient(self, op: Callable[[], None], drops_update: bool = False) -> None:
        """`op()`; when a link fails, the worker joins the servers anew (its reply is the current parameters
        and a unit; `drops_update`: the step's update went with the link, and its unit is dealt again).
        Raises signals.Interrupted when the run is stopped while it waits for them."""
        try:
            with self.lost():
                op()
            return
        except LinkLost as e:
            why = str(e)
        self.dropped = drops_update
        self.rejoin(why)

    def rejoin(self, why: str) -> None:
        """Join the servers anew, retrying for parallel.timeout_s (restarted servers take seconds to come
        back from their checkpoint; until then there is no store to reach)."""
        print(f"worker slot {self.slot}: lost the servers ({why}); joining again", file=sys.stderr, flush=True)
        for link in self.links:
            with contextlib.suppress(Exception):
                link.close()
        deadline = time.monotonic() + self.timeout_s
        while not signals.requested():
            try:
                if self.reopen is not None:
                    self.store = self.reopen()
                with self.lost():
                    self._join()
                return
            except LinkLost as e:
                if time.monotonic() > deadline:
                    raise LinkLost(f"the servers did not come back within parallel.timeout_s "
                                   f"({self.timeout_s:g} s): {str(e).strip().splitlines()[0][:200]}") from None
                time.sleep(0.5)
        self.left = True  # stopped meanwhile (the servers too, by the same signal): nobody to tell
        raise signals.Interrupted(signals.requested(), 0, None)


class DealtUnits:
    """The feed of an asynchronous worker (training/feed.py): the units server 0 deals, until none is
    left. The learning rate follows the run's progress through the data (the unit's global step), not
    the worker's own count of steps."""

    def __init__(self, push_pull: AsyncPushPull, sampler: GlobalBatchSampler, source, train: TrainConfig,
                 schedule: Schedule):
        self.ps, self.sampler, self.source, self.train, self.schedule = push_pull, sampler, source, train, schedule
        self.current = -1  # the unit of the step being trained

    def more(self) -> bool:
        if not self.ps.joined:
            self.ps.join()  # the current parameters and a first unit
        return self.ps.unit >= 0

    def next(self) -> list[Batch]:
        self.current = unit = self.ps.unit
        step = unit // self.ps.workers
        self.schedule.set_step(step)
        return [self.source.train_batch(i, self.sampler.data_step(step)) for i in
                self.sampler.local_micro_batches(step, unit % self.ps.workers, self.ps.workers,
                                                 self.train.micro_batch_size)]

    def last(self) -> bool:
        """No unit is left: this worker leaves the servers, and slot 0 pulls the final parameters (once every
        worker's last unit is applied), so that the last step's validation sees the final model."""
        if self.ps.unit >= 0:
            return False
        self.ps.finish()
        return True

    def step_metrics(self) -> dict:
        return {"unit": self.current, "data_step": self.current // self.ps.workers}

    def restart(self, step: int) -> None:
        raise RuntimeError("an asynchronous parameter server's worker does not roll back")

    def release(self) -> None:
        pass  # its units are fetched when the step asks for them

    def close(self) -> None:
        pass
