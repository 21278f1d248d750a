"""How one rank trains: its model laid out, and what that way of training changes in the run around it.

run.py asks a Strategy at fixed points of the run and has no branch of its own for any way of
training. This base class is shoal's layouts: the model laid out by parallelize() with the step
synchronisation [sync] names (every step, local SGD, DiLoCo; compressed by [comm]), every stateful
part saved and restored by the run, the sampler's steps up to train.steps. A way of training that
holds its state elsewhere or is fed otherwise (a parameter server's workers: ps/strategies.py) is a
subclass. The points, in the order a run meets them:

  parallelize(bundle, sample)   this rank's share of the model, wrapped (a Parallelized)
  restores                      whether the rank resumes from the run's checkpoints
  checkpointing(cfg)            how this rank saves ([checkpoint], as the strategy can honour it)
  saved_optimizer(optimizer)    the optimizer whose state this rank's checkpoints hold (None: none)
  feed(steps, schedule)         where each step's micro-batches come from (feed.py)
  validates                     whether this rank runs validation
  before_save(step)             a checkpoint of `step` is about to be written
  step_metrics()                what a step adds to its metrics
  finish()                      training is over on this rank (also when it stopped early)
  report()                      what the run adds to summary.json
"""

from __future__ import annotations

import torch

from shoal.comm.collectives import Comm
from shoal.config import CheckpointConfig, Config
from shoal.layout import Layout
from shoal.models.spec import ModelBundle
from shoal.parallel.apply import make_sync, parallelize
from shoal.parallel.parallelized import Parallelized
from shoal.parallel.zero import local_optimizer
from shoal.training.feed import Feed, Steps
from shoal.training.optim import Schedule


class Strategy:
    """shoal's layouts (see the module doc); subclasses change what differs."""

    restores = True
    validates = True

    def __init__(self, cfg: Config, layout: Layout, device: torch.device, rank: int, comm: Comm):
        self.cfg, self.layout, self.device, self.rank, self.comm = cfg, layout, device, rank, comm

    def parallelize(self, bundle: ModelBundle, sample: dict | None) -> Parallelized:
        """`sample`: one pipeline micro-batch, to time the layers with (parallel.pp_balance = "time")."""
        cfg = self.cfg
        sync = make_sync(cfg.sync, cfg.comm, self.comm, last_step=cfg.train.steps)
        return parallelize(bundle, self.layout, parallel=cfg.parallel, precision=cfg.precision,
                           compile=cfg.train.compile, device=self.device, rank=self.rank, comm=self.comm, sync=sync,
                           sample=sample)

    def checkpointing(self, cfg: CheckpointConfig) -> CheckpointConfig:
        return cfg

    def saved_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
        return local_optimizer(optimizer)

    def feed(self, steps: Steps, schedule: Schedule) -> Feed:
        """`steps`: the sampler's steps up to train.steps, prefetched; `schedule`: the learning rate's, for
        a feed whose steps are not the optimizer's."""
        return steps

    def before_save(self, step: int) -> None:
        pass

    def step_metrics(self) -> dict:
        return {}

    def finish(self) -> None:
        pass

    def report(self) -> dict:
        return {}
