"""One optimizer step over this rank's micro-batches:

    forward/backward (the StepSync's gradient communication inside) -> after_backward -> gradient norm
    -> the step's flags all-reduce started (loss, stop, bad norm, checkpoint due) -> clip, while it runs
    -> the verdict (a bad step is skipped) -> optimizer step -> zero_grad

How the model is laid out and how gradients are synchronised is the Parallelized object's business
(parallel/); the step reads the same for every layout. See [Note: loss contract] in models/spec.py
for the loss scaling.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shoal.comm.collectives import Comm, Pending
from shoal.comm.phase import Phase
from shoal.metrics.memory import model_state_bytes
from shoal.metrics.timers import StepTimer
from shoal.models.spec import Batch
from shoal.parallel.balance import ThroughputBalance
from shoal.parallel.parallelized import Parallelized
from shoal.parallel.precision import Precision
from shoal.parallel.zero import local_optimizer
from shoal.training.bad_steps import BadStepPolicy
from shoal.training.flags import Flags, StepFlags
from shoal.training.optim import Schedule

# a live elastic run: ranks asked to stop while others were not leave once the request is this old, and
# not at the next step's end; a job's cancel signals every node within a moment, and without the wait a
# step boundary falling in between split it into a leave of some ranks and a stop of the rest
LEAVE_GRACE_S = 2.0


@dataclass(frozen=True)
class StepResult:
    """What a step leaves, the same on every rank but `held` and `comm_bytes`."""

    loss: float  # the global batch's mean loss
    grad_norm: float
    items: int  # tokens (or samples) in the global batch
    bad: bool  # the loss or gradient norm was not finite: the update was skipped
    stop: bool  # some rank was asked to stop (a live elastic run: every rank; some leave by regrouping)
    save: bool  # some rank's clock says a checkpoint is due
    held: dict[str, int] | None  # this rank's model-state bytes (on steps that measure memory)
    comm_bytes: int  # bytes this rank sent to keep the replicas in sync
    regroup: bool = False  # a live elastic run's group changes after this step (training/live.py)
    # fp16: the gradients overflowed, the loss scaler skipped the update and lowered its scale to this
    loss_scale_after_overflow: float | None = None


@dataclass(kw_only=True)
class Stepper:
    """Everything a step changes or asks (assembled by run.py)."""

    par: Parallelized
    optimizer: torch.optim.Optimizer
    schedule: Schedule
    precision: Precision
    bad_steps: BadStepPolicy
    comm: Comm
    device: torch.device
    count_fn: Callable[[Batch], torch.Tensor]  # tokens or samples in a batch
    grad_clip: float  # 0: no clipping (the norm is still taken)
    phase: Phase
    balance: ThroughputBalance | None = None  # balance.mode = "throughput": this rank's compute is timed
    stop_requested: Callable[[], int] = lambda: 0  # nonzero when this process was asked to stop
    stop_age: Callable[[], float] = lambda: 0.0  # seconds since it was asked
    save_wanted: Callable[[], bool] = lambda: False  # this rank's clock says a checkpoint is due
    before_update: Callable[[], None] = lambda: None  # runs before the optimizer changes the weights
    # a live elastic run: this rank wants the group to change at the step's end (it leaves, or, on
    # rank 0, a joiner waits); None: not a live run, and a stop signal stops every rank
    regroup_wanted: Callable[[], bool] | None = None

    def __call__(self, micro_batches: list[Batch], step: int, timer: StepTimer, measure_memory: bool) -> StepResult:
        """Step `step` (0-based: the steps done before it)."""
        par, precision = self.par, self.precision
        sent = self.comm.sync_bytes
        batches = [{k: v.to(self.device, non_blocking=True) for k, v in b.items()} for b in micro_batches]
        count = ItemCount(batches, self.count_fn, self.comm, par, self.device)  # runs during the first forward
        self.phase.outside("forward/backward")  # the model's layers refine it (comm/phase.py)
        with self.balance.measuring(step) if self.balance else contextlib.nullcontext():
            loss_sum = par.forward_backward(batches, count.scale, precision)
        par.after_backward()
        timer.mark("forward_backward_s")
        return self.finish(loss_sum, count.total, step, timer, measure_memory, sent)

    def finish(self, loss_sum: torch.Tensor, total: Callable[[], float], step: int, timer: StepTimer,
               measure_memory: bool, sent: int) -> StepResult:
        """The step after its backward (and the StepSync's after_backward): the norm, the flags, clipping,
        the verdict, the update. `loss_sum`: this rank's share of the global loss sum; `total()`: the items
        it is over, on all ranks; `sent`: comm.sync_bytes when the step began. shoal's loop and a Session's
        step() (session.py) both end their steps here."""
        par, optimizer, precision = self.par, self.optimizer, self.precision
        self.phase.outside("optimizer step")
        precision.unscale(optimizer)
        norm = par.grad_norm()
        flags = StepFlags(self.comm, self.device)  # one all-reduce for every shared decision
        flags.start(loss_sum if par.owns_loss else torch.zeros_like(loss_sum), stop=self.stop_requested() > 0,
                    bad_norm=not math.isfinite(norm.item()), save=self.save_wanted(),
                    regroup=self.regroup_wanted is not None and self.regroup_wanted(), stop_age=self.stop_age())
        par.clip_grads(self.grad_clip or math.inf, norm)  # while the flags travel
        agreed = flags.result()
        loss = agreed.loss_sum / total()
        bad = self.bad_steps.is_bad(loss, math.nan if agreed.bad_norm else norm.item())  # both inputs are global
        if bad:
            precision.skip(optimizer)
            par.skipped()
        else:
            self.before_update()  # e.g. an async checkpoint still copying the weights
            precision.step(optimizer)
            self.schedule.step()
            par.after_step(step + 1)
        held = model_state_bytes(par.model, local_optimizer(optimizer)) if measure_memory else None
        optimizer.zero_grad(set_to_none=True)
        timer.mark("optimizer_s")
        stop, regroup = stop_or_regroup(agreed, self.comm.world_size, live=self.regroup_wanted is not None)
        regroup = regroup and par.in_sync(step + 1)  # else at the end of the first step where they are
        overflow = precision.scaler is not None and not bad and not math.isfinite(norm.item())
        return StepResult(loss=loss, grad_norm=norm.item(), items=int(total()), bad=bad, stop=stop,
                          save=agreed.save, held=held, comm_bytes=self.comm.sync_bytes - sent, regroup=regroup,
                          loss_scale_after_overflow=precision.scaler.get_scale() if overflow else None)


def stop_or_regroup(agreed: Flags, world: int, live: bool) -> tuple[bool, bool]:
    """Whether the run stops at this step's end, and whether the group changes. A live run stops only when
    every rank was asked to; when some were, they leave (a regroup without them) once their request is
    LEAVE_GRACE_S old on average, a figure every rank reads alike from the flags."""
    if not live:
        return agreed.stops > 0, False
    if agreed.stops >= world:
        return True, False
    leave = agreed.stops > 0 and agreed.stop_age / agreed.stops >= LEAVE_GRACE_S
    return False, agreed.regroup or leave


class ItemCount:
    """The items (tokens or samples) of the whole global batch: this rank's, summed over dp by an
    all-reduce that runs while the first forward does."""

    def __init__(self, batches: list[Batch], count_fn, comm: Comm, par: Parallelized, device: torch.device):
        self.local = torch.stack([count_fn(b) for b in batches]).sum().double().to(device)
        self.dp = par.dp
        self._pending: Pending | None = comm.all_reduce(self.local, group=par.dp_group, label="dp", async_op=True)
        self._scale: torch.Tensor | None = None

    def total(self) -> float:
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        return self.local.item()

    def scale(self) -> torch.Tensor:
        """What each backward is scaled by: gradient averaging divides by dp, so multiply it back and
        divide by the global count."""
        if self._scale is None:
            self.total()
            self._scale = self.dp / self.local.float()
        return self._scale
