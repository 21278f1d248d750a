"""What servers and workers say to each other, declared once: the message kinds and the typed header,
control, reply and account messages, each a float64 tensor on the wire (c10d point-to-point carries
tensors; the gradients and parameters that follow them are wire.py's), made on the device the channel takes
(wire.message_device: the GPU under NCCL; links.DEVICE: host memory) and read whole by the host (`tolist`).

Synchronous mode (one job, ranks): worker 0 -> every server  SyncHeader [kind, step]
                                    every worker -> servers   gradients (STEP)
                                    server 0 -> every worker  the total gradient norm
                                    worker 0 -> every server  Control [apply, lr of each group]
                                    every server -> workers   parameters (when applied)
Asynchronous mode (links):          worker -> each server     Push [kind, unit, pulled version, norm, lrs]
                                                              and, for STEP, the gradients
                                    each server -> worker     Reply [version, staleness, next unit] and
                                                              the parameters; at the end, to worker slot 0,
                                                              an Account and its JSON
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import IntEnum

import torch


class Kind(IntEnum):
    DONE = 0  # the worker leaves; synchronous: training is over
    STEP = 1  # a step's gradients follow
    SAVE = 2  # synchronous: a checkpoint of `step` is being written: join the save
    SKIP = 3  # asynchronous: a bad step, no gradients: nothing to apply, reply as usual
    JOIN = 4  # asynchronous: a new (or restarted) worker: reply with the parameters and a unit


@dataclass(frozen=True)
class SyncHeader:
    kind: Kind
    step: int = 0

    SIZE = 2

    def tensor(self, device: torch.device) -> torch.Tensor:
        return torch.tensor([float(self.kind), float(self.step)], dtype=torch.float64, device=device)

    @classmethod
    def read(cls, t: torch.Tensor) -> SyncHeader:
        kind, step = t.tolist()
        return cls(Kind(int(kind)), int(step))


@dataclass(frozen=True)
class Control:
    """Worker 0's verdict on a synchronous step: apply it (at these learning rates) or drop it."""

    apply: bool
    lrs: list[float]

    def tensor(self, device: torch.device) -> torch.Tensor:
        return torch.tensor([1.0 if self.apply else 0.0, *self.lrs], dtype=torch.float64, device=device)

    @staticmethod
    def size(groups: int) -> int:
        return 1 + groups

    @classmethod
    def read(cls, t: torch.Tensor) -> Control:
        apply, *lrs = t.tolist()
        return cls(apply == 1.0, lrs)


@dataclass(frozen=True)
class Push:
    """An asynchronous worker's message to a server: what follows, for which unit of data, computed on
    which version of that server's tensors, the update's whole norm, the schedule's learning rates."""

    kind: Kind
    unit: int
    version: int
    norm: float
    lrs: list[float]

    @staticmethod
    def size(groups: int) -> int:
        return 4 + groups

    def tensor(self, device: torch.device) -> torch.Tensor:
        return torch.tensor([float(self.kind), self.unit, self.version, self.norm, *self.lrs], dtype=torch.float64,
                            device=device)

    @classmethod
    def read(cls, t: torch.Tensor) -> Push:
        kind, unit, version, norm, *lrs = t.tolist()
        return cls(Kind(int(kind)), int(unit), int(version), norm, lrs)


@dataclass(frozen=True)
class Reply:
    """A server's answer before the parameters: its version, the largest staleness it applied since this
    worker's last pull, and (server 0) the next unit: -1 when none is left."""

    version: int
    staleness: int
    unit: int

    SIZE = 3

    def tensor(self, device: torch.device) -> torch.Tensor:
        return torch.tensor([self.version, self.staleness, self.unit], dtype=torch.float64, device=device)

    @classmethod
    def read(cls, t: torch.Tensor) -> Reply:
        version, staleness, unit = t.tolist()
        return cls(int(version), int(staleness), int(unit))


@dataclass(frozen=True)
class Account:
    """A server's account for worker slot 0 at the end: updates applied, seconds serving, updates applied
    in them (not those a checkpoint resumed from), the staleness histogram, and who joined and left."""

    applied: int
    seconds: float
    fresh: int
    histogram: list[float]
    people: dict

    def tensors(self, device: torch.device) -> list[torch.Tensor]:
        """[applied, seconds, fresh, bytes of the JSON, histogram...] and the JSON (uint8), on `device`."""
        text = json_tensor(self.people)
        head = [self.applied, self.seconds, self.fresh, len(text), *self.histogram]
        return [torch.tensor(head, dtype=torch.float64, device=device), text.to(device)]

    @staticmethod
    def head_size(bins: int) -> int:
        return 4 + bins

    @classmethod
    def read(cls, head: torch.Tensor, text: torch.Tensor) -> Account:
        applied, seconds, fresh, _, *hist = head.tolist()
        return cls(int(applied), seconds, int(fresh), hist, tensor_json(text))

    @staticmethod
    def json_size(head: torch.Tensor) -> int:
        return int(head[3].item())


def json_tensor(obj) -> torch.Tensor:
    """`obj` as JSON in a uint8 tensor (it travels over a link and sits in a safetensors file)."""
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)


def tensor_json(t: torch.Tensor):
    return json.loads(bytes(t.tolist()).decode())


def staleness_bins(workers: int, max_staleness: int) -> int:
    """Histogram length: a worker may be max_staleness + 1 pushes ahead of one that has just pulled and
    max_staleness behind it, so an update waits for at most (2 k + 1) updates of each other worker; one
    more bin counts anything beyond (a worker that joined late, or none)."""
    return (2 * max_staleness + 1) * (workers - 1) + 2
