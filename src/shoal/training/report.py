"""What the host learns of a step, and when.

Everything a step decides stays on the device while it runs: the loss, the gradient norm, the verdict
on a bad step (which the optimizer applies itself: parallel/precision.py), the agreed flags (flags.py).
At the step's end those values are gathered into one small vector and copied, without waiting, into
host memory (pinned on a GPU, where the copy is then asynchronous), with a CUDA event behind it. The
loop reads that copy a step later (training/loop.py), when the device is already busy with the next
step: the host waits for the copy, the device never waits for the host. A step the loop must act on at
once (a validating or saving step, the last one) is read right away; a logged step is read late like any
other.

A step that measures memory (a logged one) adds every rank's figures to the vector: this rank's model-state
bytes, peak and (a GPU) reserved and outside-the-allocator bytes, all known on the host, are gathered over
the ranks on the device (MemoryShare; nothing to gather at world size 1) and read with the rest, so that
measuring memory neither drains the device's queue nor adds a collective at world size 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shoal.comm.collectives import Comm, Pending
from shoal.metrics.timers import StepTimer
from shoal.training.flags import Flags, agreed_flags, host_tensor


@dataclass(frozen=True)
class StepResult:
    """What a step leaves, the same on every rank but `held` and `comm_bytes`."""

    loss: float  # the global batch's mean loss
    grad_norm: float
    items: int  # tokens (or samples) in the global batch
    bad: bool  # the loss or gradient norm was not finite: the update was skipped
    stop: bool  # some rank was asked to stop (a live elastic run: every rank; some leave by regrouping)
    save: bool  # some rank's clock says a checkpoint is due
    memory: list[dict] | None  # every rank's memory figures, rank by rank (on steps that measure memory)
    comm_bytes: int  # bytes this rank sent to keep the replicas in sync
    regroup: bool = False  # a live elastic run's group changes after this step (live/generation.py)
    # fp16: the gradients overflowed, the loss scaler skipped the update and lowered its scale to this
    loss_scale_after_overflow: float | None = None


class MemoryShare:
    """Every rank's memory figures (name -> number, the same names on every rank), gathered on the device
    without waiting: started after the update, its result joins the step's report vector."""

    def __init__(self, figures: dict[str, float], comm: Comm, device: torch.device):
        self.kinds, self.world = tuple(figures), comm.world_size
        mine = host_tensor([float(v) for v in figures.values()], device).to(device, non_blocking=True)
        self._pending: Pending | torch.Tensor = (comm.all_gather_flat(mine, label="world, memory accounting",
                                                                      async_op=True)
                                                 if self.world > 1 else mine)

    def result(self) -> torch.Tensor:
        """The figures of rank 0, then rank 1, ...: a float64 vector on the device (waiting for it makes
        the device wait for the collective, not the host)."""
        if isinstance(self._pending, Pending):
            self._pending = self._pending.wait()
        return self._pending

    def rows(self, values: list[float]) -> list[dict]:
        """The host's copy of result() as rows: {"rank": r, kind: value, ...}; byte counts as integers (a
        figure named *_s is seconds)."""
        k = len(self.kinds)
        return [{"rank": r, **{kind: v if kind.endswith("_s") else int(v)
                               for kind, v in zip(self.kinds, values[r * k:(r + 1) * k], strict=True)}}
                for r in range(self.world)]


class StepReport:
    """One step's values on their way to the host: `values`, a float64 vector on the step's device (or, where the
    host read them as the step ended, Stepper.host_decides, their list), holds `names`' entries, then (a step
    that measures memory) `memory`'s result; `known` holds the entries the
    host knew already (at world size 1 the flags it would have agreed with no one, at dp 1 the items it
    counted). Together: flags.AGREED's entries, grad_norm, items, bad, overflow, loss_scale."""

    def __init__(self, values: torch.Tensor | list[float], names: list[str], known: dict[str, float], *, step: int,
                 lr: float, timer: StepTimer, memory: MemoryShare | None, comm_bytes: int,
                 decide: Callable[[Flags], tuple[bool, bool]]):
        self.step, self.lr, self.timer, self.memory, self.comm_bytes = step, lr, timer, memory, comm_bytes
        self.names, self.known = names, known
        self.decide = decide  # (stop, regroup) from the agreed flags (flags.stop_or_regroup)
        self.copied: torch.cuda.Event | None = None
        if isinstance(values, list) or values.device.type == "cpu":
            self.host = values  # already there (read already, or a vector of its own nothing writes to again)
        else:
            cuda = values.device.type == "cuda"
            self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=cuda)
            self.host.copy_(values, non_blocking=True)
            if cuda:
                self.copied = torch.cuda.Event()
                self.copied.record()
        self._result: StepResult | None = None

    def result(self) -> StepResult:
        """The step's values, read from the host copy (waiting for the copy only, and only once)."""
        if self._result is None:
            self._result = self._make(self.read())
        return self._result

    def read(self) -> list[float]:
        """The one read of the step's values on the host."""
        if self.copied is not None:
            self.copied.synchronize()
            self.timer.settle()  # its events were recorded before this copy's: they have run
        return self.host if isinstance(self.host, list) else self.host.tolist()

    def __getattr__(self, name: str):
        """A StepResult's fields (report.loss, report.grad_norm, ...), read when first asked for: what a
        Session's step() returns, so that a loop that never looks never waits."""
        if name in StepResult.__dataclass_fields__:
            return getattr(self.result(), name)
        raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")

    def _make(self, values: list[float]) -> StepResult:
        mine = len(self.names)
        own = {**dict(zip(self.names, values[:mine], strict=True)), **self.known}
        agreed = agreed_flags(own)
        items = own["items"]
        overflow = own["overflow"] > 0 and own["bad"] == 0
        stop, regroup = self.decide(agreed)
        return StepResult(loss=agreed.loss_sum / items if items else math.nan, grad_norm=own["grad_norm"],
                          items=round(items), bad=own["bad"] > 0, stop=stop, save=agreed.save,
                          memory=self.memory.rows(values[mine:]) if self.memory else None,
                          comm_bytes=self.comm_bytes, regroup=regroup,
                          loss_scale_after_overflow=own["loss_scale"] if overflow else None)
