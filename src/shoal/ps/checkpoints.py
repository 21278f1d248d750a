"""An asynchronous parameter server's checkpoints, written by the servers alone.

Workers of the asynchronous mode hold nothing worth saving (they pull the parameters, and units of
data are dealt to them by index), so the servers save alone, at clean cuts. Server 0 picks a cut at a
global step's boundary (every checkpoint.interval steps, after checkpoint.interval_minutes, and at
the end), announces it in the store and deals no unit past it; every server saves once it has
applied every unit before the cut (none after it can have reached it: they are not dealt yet), and
server 0 deals on once the save is sealed. So a checkpoint holds exactly the units before its cut,
on every server, and a resumed run deals from the cut: no unit is trained into the model twice or
skipped, whatever was applied after the cut before a server died.

The tensors are an ordinary checkpoint's (each server writes the parameters it owns and their
optimizer state under the usual flat keys, through DCP on the servers' group), so another number of
servers resumes it. Its train_state.json holds no data position of the workers' kind, so only an
asynchronous parameter server resumes it (other modes refuse it in one line, checkpoint/resume.py);
an asynchronous server resumes any checkpoint, from its data step.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from shoal.checkpoint.manager import CheckpointManager, load_checkpoint
from shoal.checkpoint.manifest import step_dir_name
from shoal.checkpoint.resume import check_compatible
from shoal.checkpoint.train_state import TrainState
from shoal.comm.collectives import Comm
from shoal.config import Config
from shoal.ps.links import PREFIX
from shoal.ps.messages import json_tensor, tensor_json
from shoal.rundir import RunDir

PART = "parameter_server"
CUT = f"{PREFIX}/cut"


class ServerState:
    """The TrainState part of an asynchronous server: the cut (shared JSON) and this server's version,
    staleness histogram and who joined and left (its own file)."""

    def __init__(self, workers: int, bins: int):
        self.workers, self.units, self.version = workers, 0, 0
        self.hist = torch.zeros(bins, dtype=torch.float64)
        self.people: dict = {"joined": [], "left": []}

    def state_dict(self) -> dict:
        return {"mode": "async", "units": self.units, "workers": self.workers}

    def load_state_dict(self, state: dict) -> None:
        self.units = int(state.get("units", 0))

    def rank_state(self) -> dict[str, torch.Tensor]:
        return {"version": torch.tensor([self.version]), "histogram": self.hist, "people": json_tensor(self.people)}

    def load_rank_state(self, tensors: dict[str, torch.Tensor] | None) -> None:
        if not tensors:  # another number of servers wrote it: versions and accounts start afresh
            return
        self.version = int(tensors["version"].item())
        saved = tensors["histogram"]
        n = min(len(saved), len(self.hist))  # max_staleness may have changed: the rest into the last bin
        self.hist[:n] = saved[:n]
        self.hist[-1] += saved[n:].sum()
        self.people = tensor_json(tensors["people"])


class ServerCheckpoints:
    """Cuts and saves of one asynchronous server (see the module doc)."""

    def __init__(self, shard, index: int, cfg: Config, comm: Comm, run: RunDir, workers: int, state: ServerState):
        self.cfg, self.comm, self.workers, self.state = cfg, comm, workers, state
        self.total = workers * cfg.train.steps
        self.every = cfg.checkpoint.interval * workers
        self.manager = CheckpointManager(run.checkpoints, cfg.checkpoint.model_copy(update={"async_save": False}),
                                         comm, dcp_group=comm.group)
        self.train_state = TrainState(shard.model, shard.optimizer, {PART: state})
        self.train_state.owned = written_keys(shard.model, shard.params, index)
        self.saved = 0  # the newest cut saved (or resumed from)
        self.cut: int | None = None  # the cut announced and not saved yet
        self.polled = 0.0

    @property
    def enabled(self) -> bool:
        return self.cfg.checkpoint.enabled

    def newest(self) -> str | None:
        """The folder of the newest checkpoint saved or resumed from (None: none yet)."""
        path = self.manager.root / step_dir_name(self.saved // self.workers)
        return str(path) if self.saved and path.exists() else None

    def resume(self, path: Path, group) -> int:
        """Load the checkpoint at `path` (collective over the servers); returns its cut in units."""
        saved = check_compatible(self.cfg, path)
        load_checkpoint(path, self.train_state.model, self.train_state.optimizer, self.comm, group=group)
        self.train_state.restore(path, saved, self.comm.rank, self.comm.world_size, self.cfg.train.seed)
        if PART not in saved["parts"]:  # another mode's checkpoint: its data step, in units
            self.state.units = saved["parts"]["sampler"]["step"] * self.workers
        self.saved = self.state.units
        return self.state.units

    def propose(self, next_unit: int) -> bool:
        """Server 0, before dealing `next_unit`: whether to cut there (and stop dealing until saved)."""
        if not self.enabled or self.cut is not None or next_unit <= self.saved or next_unit % self.workers:
            return self.cut is not None
        by_steps = self.every and next_unit % self.every == 0
        by_time = self.manager.wants_save()
        if by_steps or by_time or next_unit == self.total:
            self.cut = next_unit
            self.comm.store.set(CUT, str(next_unit))
        return self.cut is not None

    def announced(self) -> int | None:
        """Servers but 0: the cut server 0 announced (the store is read at most every 0.2 s)."""
        if self.enabled and time.monotonic() - self.polled > 0.2:
            self.polled = time.monotonic()
            if self.comm.store.check([CUT]):
                cut = int(self.comm.store.get(CUT).decode())
                self.cut = cut if cut > self.saved else None
        return self.cut

    def save_if_reached(self, applied: int, flush) -> bool:
        """Collective over the servers once this server has applied the `applied` units before the cut:
        `flush()` applies the updates held for aggregation and returns the version; then the save.
        Returns whether it saved."""
        if self.cut is None or applied != self.cut:
            return False
        self.state.units, self.state.version = self.cut, flush()
        step = self.cut // self.workers
        self.manager.save(step, self.train_state, self.train_state.capture(step, self.cfg.to_toml(), {}))
        self.saved, self.cut = self.cut, None
        return True


def written_keys(model: torch.nn.Module, owned: list[torch.Tensor], index: int) -> set[str]:
    """The model's state-dict keys server `index` writes: its parameters under every name they have (a
    tied weight has two), and, on server 0, whatever no server owns (buffers, frozen parameters)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    mine = {p.data_ptr() for p in owned}
    trained = {p.data_ptr() for p in model.parameters() if p.requires_grad}
    return {k for k, v in get_model_state_dict(model).items()
            if v.data_ptr() in mine or (index == 0 and v.data_ptr() not in trained)}
