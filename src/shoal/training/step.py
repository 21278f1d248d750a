"""One optimizer step over this rank's micro-batches:

    batches to the device (pinned on the host, copied without waiting) and their items, counted on the
    host, summed over dp while the first forward runs
    -> forward/backward (the StepSync's gradient communication inside) -> after_backward -> gradient norm
    -> the step's flags all-reduce started (loss, stop, bad norm, checkpoint due) -> clip, while it runs
    -> the verdict (a bad step is skipped by the optimizer itself) -> optimizer step -> zero_grad
    -> the step's report: its values copied to the host without waiting (report.py)

Nothing here reads a tensor's value on the host: on a GPU the host queues the step and goes on to the
next one while the device computes it; the loop reads the report when it needs it (training/loop.py). On the
CPU, where the host is the device and a read waits for nothing, the host reads the step's values as the step
ends, decides the verdict and skips a bad step's update itself (Stepper.host_decides).
How the model is laid out and how gradients are synchronised is the Parallelized object's business
(parallel/); the step reads the same for every layout. See [Note: loss contract] in models/spec.py
for the loss scaling.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shoal.comm.collectives import Comm, Pending
from shoal.comm.phase import Phase
from shoal.metrics.memory import StateBytes, device_memory_bytes, peak_memory_bytes
from shoal.metrics.timers import StepTimer
from shoal.models.spec import Batch
from shoal.parallel.balance import ThroughputBalance
from shoal.parallel.parallelized import Parallelized
from shoal.parallel.precision import Precision
from shoal.parallel.zero import local_optimizer
from shoal.training.bad_steps import BadStepPolicy
from shoal.training.feed import Prepared, prepare
from shoal.training.flags import StepFlags, host_tensor, stop_or_regroup
from shoal.training.optim import Schedule
from shoal.training.report import MemoryShare, StepReport


@dataclass(frozen=True)
class Controls:
    """What the run around the step asks it and tells it, all decided on the host: whether this process was
    asked to stop (nonzero) and how long ago, whether its clock says a checkpoint is due, what must run
    before the optimizer changes the weights (an asynchronous checkpoint still copying them), and (a live
    elastic run) whether this rank wants the group to change at the step's end: it leaves, or, on rank 0,
    a joiner waits. None: not a live run, and a stop signal stops every rank."""

    stop_requested: Callable[[], int] = lambda: 0
    stop_age: Callable[[], float] = lambda: 0.0
    save_wanted: Callable[[], bool] = lambda: False
    before_update: Callable[[], None] = lambda: None
    regroup_wanted: Callable[[], bool] | None = None


@dataclass(kw_only=True)
class Stepper:
    """Everything a step changes or asks (assembled by training/assemble.py)."""

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
    controls: Controls = field(default_factory=Controls)
    balance: ThroughputBalance | None = None  # balance.mode = "throughput": this rank's compute is timed
    state_bytes: StateBytes = field(default_factory=StateBytes)  # the memory figures' model state (logged steps)
    # what a logged step records of a mixture of experts' counts, given the step (1-based): models/moe.py
    expert_figures: Callable[[int], dict] = lambda step: {}
    updated: int = 0  # steps whose update the weights hold: the optimizer and the schedule have stepped
    measuring: bool = False  # the step in progress measures memory (a logged step), alike on every rank
    # The CPU (None: decided by the device). The host is the device there, and reading a value waits for nothing:
    # the host reads the verdict's two values and skips a bad step's call itself, and reads the report's values
    # as the step ends, where the device would take four operations for the verdict and a stack for the report,
    # and the fused optimizer handed the verdict corrects its step counts after the kernel with one operation per
    # parameter (3.5% of a small GPT's ~3 ms step in an in-process A/B here; one kernel per parameter group on a GPU).
    host_decides: bool | None = None

    def __post_init__(self):
        if self.host_decides is None:
            self.host_decides = self.device.type == "cpu"

    @property
    def lags(self) -> bool:
        """Whether the loop may read a step's report a step later: not where the host must know at once how a
        step went (a live elastic run regroups at step boundaries; a sync mode that undoes a skipped step's
        codec state or schedules by it; balancing reads its clocks)."""
        return self.controls.regroup_wanted is None and not self.par.sync.verdict_at_once and self.balance is None

    def prepare(self, micro_batches: list[Batch]) -> Prepared:
        """A step's micro-batches made ready for the device, and their items counted (the data thread's work): what
        this rank computes of them (under parallel.cp its positions of each sequence, its items counted)."""
        return prepare([self.par.shard(b) for b in micro_batches], self.count_fn, self.device)

    def __call__(self, micro_batches: list[Batch] | Prepared, step: int, timer: StepTimer,
                 memory: dict[str, float] | None, backward_began: Callable[[], None] = lambda: None) -> StepReport:
        """Step `step` (0-based: the steps done before it). `memory`: None, or this step measures memory and
        gathers these figures of this rank's with it (the step profile's compute: Trainer.memory_figures).
        `backward_began`: called as the step's last backward starts (the data thread's cue: Feed.release)."""
        par, precision = self.par, self.precision
        sent, lr = self.comm.sync_bytes, self.optimizer.param_groups[0]["lr"]
        ready = micro_batches if isinstance(micro_batches, Prepared) else self.prepare(micro_batches)
        batches = ready.batches if self.device.type == "cpu" else [
            {k: v.to(self.device, non_blocking=True) for k, v in b.items()} for b in ready.batches]
        count = ItemCount(ready.items, self.comm, par, self.device)  # summed over dp during the first forward
        self.phase.outside("forward/backward")  # the model's layers refine it (comm/phase.py)
        if self.balance:
            with self.balance.measuring(step):
                loss_sum = par.forward_backward(batches, count.scale, precision, backward_began)
        else:
            loss_sum = par.forward_backward(batches, count.scale, precision, backward_began)
        par.after_backward()
        timer.mark("forward_backward_s")
        return self.finish(loss_sum, count.total, step, timer, memory, sent, lr)

    def finish(self, loss_sum: torch.Tensor, total: Callable[[], torch.Tensor], step: int, timer: StepTimer,
               memory: dict[str, float] | None, sent: int, lr: float) -> StepReport:
        """The step after its backward (and the StepSync's after_backward): the norm, the flags, clipping,
        the verdict, the update. `loss_sum`: this rank's share of the global loss sum; `total()`: the items
        it is over, on all ranks (a device scalar; at dp 1 a number); `sent`: comm.sync_bytes when the step
        began; `lr`: the step's learning rate. shoal's loop and a Session's step() both end their steps here."""
        par, optimizer, precision, c = self.par, self.optimizer, self.precision, self.controls
        self.phase.outside("optimizer step")
        precision.unscale(optimizer)
        norm = par.grad_norm()
        flags = StepFlags(self.comm, self.device)  # one all-reduce for every shared decision
        flags.start(loss_sum if par.owns_loss else torch.zeros_like(loss_sum), norm,
                    stop=c.stop_requested() > 0, save=c.save_wanted(),
                    regroup=c.regroup_wanted is not None and c.regroup_wanted(), stop_age=c.stop_age())
        if self.grad_clip:
            par.clip_grads(self.grad_clip, norm)  # while the flags travel
        agreed_loss, norms = flags.result()
        bad = self.bad_steps.verdict(agreed_loss, norms, on_host=self.host_decides)  # both inputs are global
        c.before_update()
        self.measuring = memory is not None  # read by the optimizer's step hooks (training/assemble.py)
        precision.step(optimizer, skip=bad)
        self.schedule.step()  # the rate follows the step count, skipped steps included
        self.updated = step + 1
        self._after_update(bad, step)
        share = None if memory is None else MemoryShare(
            {**self.state_bytes(par.model, local_optimizer(optimizer)), "peak": peak_memory_bytes(self.device),
             **device_memory_bytes(self.device), **memory}, self.comm, self.device)
        optimizer.zero_grad(set_to_none=True)
        timer.mark("optimizer_s")
        return self._report(flags, norm, bad, total(), share, step, timer, sent, lr)

    def _report(self, flags: StepFlags, norm: torch.Tensor, bad: torch.Tensor | float, items: torch.Tensor | float,
                share: MemoryShare | None, step: int, timer: StepTimer, sent: int, lr: float) -> StepReport:
        """The step's report: what only the device knows in one vector, copied to the host without waiting;
        what the host knows already (the flags at world size 1, the items at dp 1, no loss scale) as it is."""
        names, known, scalars = [*flags.names, "grad_norm"], dict(flags.known), [norm]
        for name, value in (("bad", bad), ("items", items)):
            if isinstance(value, float):
                known[name] = value
            else:
                names.append(name)
                scalars.append(value)
        if self.precision.scaler:
            names += ["overflow", "loss_scale"]
            scalars += [~torch.isfinite(norm), self.precision.scale().to(self.device)]
        else:
            known.update(overflow=0.0, loss_scale=0.0)
        head = flags.vector()
        values: torch.Tensor | list[float]
        if self.host_decides:  # read now (host_decides): no vector to make
            values = [*(head.tolist() if head.dim() else [head.item()]), *(s.item() for s in scalars),
                      *(share.result().tolist() if share else [])]
        else:  # one float64 vector (torch.stack promotes the float32 entries), in as few operations as it takes
            values = torch.stack([head, *scalars]) if head.dim() == 0 else torch.cat([head, torch.stack(scalars)])
            if share:
                values = torch.cat([values, share.result()])
        regroups, world = self.controls.regroup_wanted is not None, self.comm.world_size
        in_sync = self.par.in_sync(step + 1)

        def decide(flags) -> tuple[bool, bool]:
            stop, regroup = stop_or_regroup(flags, world, regroups)
            return stop, regroup and in_sync  # else at the end of the first step where they are
        return StepReport(values, names, known, step=step, lr=lr, timer=timer, memory=share,
                          comm_bytes=self.comm.sync_bytes - sent, decide=decide)

    def _after_update(self, bad: torch.Tensor | float, step: int) -> None:
        """What the StepSync does after the update. A mode that must know at once whether the update ran
        (it undoes a skipped step's codec state, or syncs only after steps that ran) reads the verdict."""
        par = self.par
        if par.sync.verdict_at_once and bool(bad):
            par.skipped()
        else:
            par.after_step(step + 1)


class ItemCount:
    """The items (tokens or samples) of the whole global batch: this rank's, counted on the host, summed
    over dp by an all-reduce that runs while the first forward does, the sum held only on the device. At dp 1
    there is nothing to sum: the count stays a number on the host, and nothing is copied for it."""

    def __init__(self, local: int, comm: Comm, par: Parallelized, device: torch.device):
        self.dp = par.dp
        self._pending: Pending | None = None
        self._scale: torch.Tensor | float | None = None
        if self.dp == 1:
            self.local: torch.Tensor | float = float(local)
            return
        self.local = host_tensor([float(local)], device).to(device, non_blocking=True)
        self._pending = comm.all_reduce(self.local, group=par.dp_group, label="dp", async_op=True)

    def total(self) -> torch.Tensor | float:
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        return self.local if isinstance(self.local, float) else self.local.reshape(())

    def scale(self) -> torch.Tensor | float:
        """What each backward is scaled by: gradient averaging divides by dp, so multiply it back and
        divide by the global count (no items counted: infinite, the loss NaN, a bad step)."""
        if self._scale is None:
            total = self.total()
            self._scale = (self.dp / total.float() if isinstance(total, torch.Tensor)
                           else 1.0 / total if total else math.inf)
        return self._scale
