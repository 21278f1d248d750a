"""A parameter server's workers as training strategies (training/strategy.py): the training loop and the
run around it are every other layout's; these say what differs.

SyncWorker   the model whole and unwrapped (ServedModel), PushPull as its step synchronisation; the
             servers hold the optimizer state, so this rank's checkpoints hold none and its saves block
             (the servers write their state inside the workers' DCP save, on the default group: an
             async save's own group would not hold them); worker 0 calls the servers into each save
             and tells them when training ends
AsyncWorker  a world of its own (one worker) fed the units server 0 deals (DealtUnits); the servers save
             and resume alone (checkpoints.py), so the worker neither restores nor saves: it pulls; only
             the worker of slot 0, which writes the run's results, validates
"""

from __future__ import annotations

import torch

from shoal.comm.collectives import Comm
from shoal.config import CheckpointConfig, Config
from shoal.layout import Layout
from shoal.models.spec import ModelBundle
from shoal.parallel.materialize import whole
from shoal.ps.async_worker import AsyncPushPull, DealtUnits
from shoal.ps.wire import message_device
from shoal.ps.worker import PushPull, ServedModel
from shoal.training.feed import Feed, Steps
from shoal.training.optim import Schedule
from shoal.training.strategy import Strategy


class SyncWorker(Strategy):
    def __init__(self, cfg: Config, layout: Layout, device: torch.device, rank: int, comm: Comm):
        super().__init__(cfg, layout, device, rank, comm)
        dims = layout.dims
        servers = list(range(dims.world_size, dims.world_size + layout.servers))  # the last ranks of the world
        self.push_pull = PushPull(comm, servers, rank == 0, device, message_device(device, layout.backend),
                                  cfg.ps.sparse)

    def parallelize(self, bundle: ModelBundle, sample: dict | None) -> ServedModel:
        model = whole(bundle, self.device)
        self.push_pull.attach(model, None, self.layout.dims.dp)
        return ServedModel(model, bundle, self.push_pull, comm=self.comm, device=self.device, dp_rank=self.rank,
                           dp=self.layout.dims.dp)

    def checkpointing(self, cfg: CheckpointConfig) -> CheckpointConfig:
        return cfg.model_copy(update={"async_save": False})

    def saved_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        return None

    def before_save(self, step: int) -> None:
        self.push_pull.before_save(step)

    def step_metrics(self) -> dict:
        return self.push_pull.step_metrics()

    def finish(self) -> None:
        self.push_pull.finish()


class AsyncWorker(Strategy):
    restores = False

    def __init__(self, cfg: Config, layout: Layout, device: torch.device, slot: int, comm: Comm, *, source, store,
                 reopen=None):
        """`comm`: this worker's own world; `slot`: which of the launched workers it is (its rank in the
        run); `source`: the data; `store`: the one it meets the servers in; `reopen()`: a new connection to
        it (None: the job's own store, which lives as long as this worker does)."""
        super().__init__(cfg, layout, device, slot, comm)
        self.source = source
        self.validates = slot == 0
        self.push_pull = AsyncPushPull(comm, store, device=device, servers=layout.servers, slot=slot,
                                       workers=layout.dims.dp, max_staleness=cfg.ps.max_staleness,
                                       timeout_s=cfg.parallel.timeout_s, sparse=cfg.ps.sparse, reopen=reopen)
        self.units: DealtUnits | None = None

    def parallelize(self, bundle: ModelBundle, sample: dict | None) -> ServedModel:
        model = whole(bundle, self.device)
        self.push_pull.attach(model, None, 1)  # it joins the servers when the loop asks for its first unit
        # each update is one worker's: its batch is its whole world
        return ServedModel(model, bundle, self.push_pull, comm=self.comm, device=self.device, dp_rank=0, dp=1)

    def checkpointing(self, cfg: CheckpointConfig) -> CheckpointConfig:
        return cfg.model_copy(update={"enabled": False})

    def saved_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        return None

    def feed(self, steps: Steps, schedule: Schedule) -> Feed:
        """Not the sampler's steps: the units server 0 deals."""
        self.units = DealtUnits(self.push_pull, steps.sampler, self.source, self.cfg.train, schedule)
        return self.units

    def step_metrics(self) -> dict:
        return {**self.push_pull.step_metrics(), **(self.units.step_metrics() if self.units else {})}

    def finish(self) -> None:
        self.push_pull.finish()

    def report(self) -> dict:
        return self.push_pull.report()
