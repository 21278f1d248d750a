"""The one collective of every step that carries the loss and every decision all ranks must take
alike: the loss sum, whether some rank was asked to stop (signals.py), whether some rank saw a
non-finite gradient norm (a bad step: skip, roll back or abort), whether some rank's clock says a
checkpoint is due, and (a live elastic run) whether some rank wants the group to change at the step's
end: it leaves, or a joiner waits. One small all-reduce over all ranks, overlapping the gradient clipping, whatever
the step synchronisation does with the gradients (under local SGD the gradient norm is a rank's own)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.comm.collectives import Comm, Pending


@dataclass
class Flags:
    loss_sum: float  # summed over ranks whose loss counts
    stops: int  # ranks asked to stop
    bad_norm: bool
    save: bool
    regroup: bool = False
    stop_age: float = 0.0  # seconds since their request, summed over the ranks asked to stop

    @property
    def stop(self) -> bool:
        return self.stops > 0


class StepFlags:
    def __init__(self, comm: Comm, device: torch.device):
        self.comm, self.device = comm, device
        self._pending: Pending | None = None

    def start(self, loss_sum: torch.Tensor, stop: bool, bad_norm: bool, save: bool, regroup: bool = False,
              stop_age: float = 0.0) -> None:
        t = torch.stack([loss_sum.double().reshape(()).to(self.device),
                         *(torch.tensor(float(x), dtype=torch.float64, device=self.device)
                           for x in (stop, bad_norm, save, regroup, stop_age))])
        self._pending = self.comm.all_reduce(t, label="world, step flags", async_op=True)

    def result(self) -> Flags:
        t = self._pending.wait().cpu()
        self._pending = None
        return Flags(t[0].item(), round(t[1].item()), t[2].item() > 0, t[3].item() > 0, t[4].item() > 0, t[5].item())
