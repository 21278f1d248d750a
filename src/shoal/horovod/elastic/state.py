"""Horovod's elastic state: what `commit()` keeps, `restore()` brings back and `sync()` makes every
process agree on.

A TorchState holds a model, an optimizer, ElasticSamplers (each kept as its state_dict) and any other
attributes given as keywords (kept as values). `commit()` keeps a copy in memory, as Horovod does,
and writes it to disk (commits.py), because a restarted process has only the disk. `sync()` takes
the newest commit any process holds (rank 0's when none has one, as in Horovod) to every process.
"""

from __future__ import annotations

import copy
import itertools
from abc import ABC, abstractmethod
from pathlib import Path

import torch

from shoal.horovod import runtime
from shoal.horovod.elastic import commits
from shoal.horovod.elastic.sampler import ElasticSampler
from shoal.horovod.functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters

_made = itertools.count()  # TorchStates made by this process, in order: the same in every attempt


class State(ABC):
    """Reset callbacks and commit; what is kept is the subclass's (ObjectState, TorchState, or a user's own
    subclass, as Horovod allows: it must say how to save, restore and sync)."""

    def __init__(self, bcast_object=None, get_rank=None):
        self._reset_callbacks: list = []

    def register_reset_callbacks(self, callbacks) -> None:
        """Functions called after the job was reset (shoal: restarted after a failure), e.g. to scale the
        learning rate to the number of processes."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Keep the state as it is now: a failure from here on resumes from this point."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Horovod's notice that hosts will come or go. Under shoal the processes change only when the
        launcher restarts the job, which no process has to be told about: nothing to check."""
        return  # a hook: nothing by default, a subclass may add its own

    @abstractmethod
    def save(self) -> None:
        """Keep the state as it is now (commit calls it)."""

    @abstractmethod
    def restore(self) -> None:
        """Bring back what save kept."""

    @abstractmethod
    def sync(self) -> None:
        """Make every process hold the same state."""

    def reset(self) -> None:
        """Called by on_reset before the callbacks."""
        return  # a hook: nothing by default, a subclass may add its own

    def resume(self) -> None:
        """After a restart, before sync: read what this process committed (TorchState reads its file)."""
        return  # a hook: nothing by default, a subclass may add its own

    def forget(self) -> None:
        """After the elastic function returned: drop what was kept for a restart."""
        return  # a hook: nothing by default, a subclass may add its own


class ObjectState(State):
    """Plain attributes given as keywords, kept by value."""

    def __init__(self, bcast_object=None, get_rank=None, **kwargs):
        self._saved = copy.deepcopy(kwargs)
        self._restore_attrs()
        super().__init__(bcast_object, get_rank)

    def save(self) -> None:
        self._saved = {k: copy.deepcopy(getattr(self, k)) for k in self._saved}

    def restore(self) -> None:
        self._restore_attrs()

    def sync(self, root: int = 0) -> None:
        if self._saved:
            self._saved = broadcast_object(self._saved, root)
            self._restore_attrs()

    def _restore_attrs(self) -> None:
        for k, v in self._saved.items():
            object.__setattr__(self, k, copy.deepcopy(v))


def _kind(value) -> str | None:
    for kind, cls in (("model", torch.nn.Module), ("optimizer", torch.optim.Optimizer), ("sampler", ElasticSampler)):
        if isinstance(value, cls):
            return kind
    return None


class TorchState(ObjectState):
    """A model, an optimizer, samplers and plain attributes, committed together."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        kwargs.update(model=model, optimizer=optimizer)
        held = {k: v for k, v in kwargs.items() if _kind(v) is not None}
        object.__setattr__(self, "_held", held)  # name -> module / optimizer / sampler
        object.__setattr__(self, "_kept", {k: copy.deepcopy(v.state_dict()) for k, v in held.items()})
        for k, v in held.items():
            object.__setattr__(self, k, v)
        super().__init__(**{k: v for k, v in kwargs.items() if k not in held})
        self._index, self._commits, self._loaded = next(_made), 0, False
        self._path: Path | None | bool = False  # False: not looked up yet; None: no launcher to restart us

    def __setattr__(self, name, value):
        if name in getattr(self, "_held", {}) and _kind(value) is not None:
            self._held[name] = value  # Horovod's rule: a new model or optimizer is kept from now on
            self._kept[name] = copy.deepcopy(value.state_dict())
        object.__setattr__(self, name, value)

    def save(self) -> None:
        self._kept = {k: copy.deepcopy(v.state_dict()) for k, v in self._held.items()}
        super().save()
        self._commits += 1
        path = self._commit_path()
        if path is not None:
            commits.write(path, {"commits": self._commits, "held": self._kept,
                                 "objects": commits.storable(self._saved, "state")})

    def restore(self) -> None:
        for k, v in self._held.items():
            v.load_state_dict(copy.deepcopy(self._kept[k]))
        super().restore()

    def resume(self) -> None:
        """After a restart: this process's last commit of this launch, from disk, if it made one."""
        path = self._commit_path()
        got = commits.read(path) if path is not None else None
        if got is not None:
            self._kept, self._saved, self._commits, self._loaded = got["held"], got["objects"], got["commits"], True
            self.restore()

    def sync(self, root: int | None = None) -> bool:
        """Every process takes the newest commit any of them holds; True when it was read from disk."""
        every = allgather_object((self._commits, self._loaded))
        newest = max(c for c, _ in every)
        root = next(r for r, (c, _) in enumerate(every) if c == newest) if root is None else root
        for v in self._held.values():
            if isinstance(v, torch.nn.Module):
                broadcast_parameters(v.state_dict(), root)
            elif isinstance(v, torch.optim.Optimizer):
                broadcast_optimizer_state(v, root)
            else:
                v.load_state_dict(broadcast_object(v.state_dict(), root))
        super().sync(root)
        # every process now holds the newest commit: restore() in memory brings back that one, not its own
        self._kept, self._commits = {k: copy.deepcopy(v.state_dict()) for k, v in self._held.items()}, newest
        return any(loaded for _, loaded in every)

    def forget(self) -> None:
        """The function the commits protected has returned: its commit file goes."""
        if self._path:
            commits.forget(self._path)

    def _commit_path(self):
        if self._path is False and runtime.is_initialized():
            folder = commits.launch_folder()
            self._path = folder / f"rank{runtime.rank()}-state{self._index}.pt" if folder is not None else None
        return self._path or None
