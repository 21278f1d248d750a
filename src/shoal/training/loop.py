"""The training loop: while the feed has a step, its micro-batches -> the step (step.py) -> metrics,
validation, checkpoint hooks.

The loop reads the same for every layout and way of training: what differs is the Parallelized
object inside the step (parallel/) and the Feed it draws from (feed.py).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shoal.comm.collectives import Comm
from shoal.comm.phase import Phase
from shoal.config import MetricsConfig, TrainConfig
from shoal.data.sampler import GlobalBatchSampler
from shoal.metrics.host_syncs import HostSyncs
from shoal.metrics.memory import STATE_KINDS
from shoal.metrics.profile import Profiler
from shoal.metrics.sinks import MetricsSinks
from shoal.metrics.timers import StepTimer
from shoal.metrics.trace import StepTrace
from shoal.training.collector import Collector
from shoal.training.evaluate import evaluate
from shoal.training.feed import Feed
from shoal.training.report import StepReport, StepResult
from shoal.training.step import Stepper


class Ended(enum.Enum):
    """How the loop left off (Trainer.run), or what reading a step's report asks of it (Trainer.complete)."""

    END = "the feed ended: train.steps reached"
    STOP = "the ranks agreed to stop early: a signal"
    REGROUP = "the ranks agreed to change the group at this step's end (a live elastic run)"
    ROLLED_BACK = "a bad step sent the run back to its newest checkpoint"
    ACT = "a step read late asks for a stop, a save or a regroup: the step after it carries it out"


def begin_step(watch: Watch, device: torch.device, log, step: int) -> StepTimer:
    """Step `step` (0-based) begins: the hang report's phase and the step trace know it, and its clock starts
    (`log`: the collective log, whose waits the timer reads at each mark with the step profile on, else None)."""
    watch.phase.begin_step(step + 1)
    if watch.trace:
        watch.trace.before(step + 1)
    timer = StepTimer(device, log)
    timer.start()
    return timer


@dataclass
class Watch:
    """What measures the steps as they run: the phase a hang report names, the step profile, traces."""

    phase: Phase = field(default_factory=Phase)
    profile: Profiler | None = None  # metrics.profile: the step profile (metrics/profile.py)
    trace: StepTrace | None = None  # metrics.trace_steps
    syncs: HostSyncs | None = None  # metrics.host_syncs: the host's waits for the device, per step


@dataclass
class Hooks:
    """What the run around the loop adds to it (run.py): checkpoints, rollbacks, heartbeats."""

    rollback: Callable[[int], None] | None = None  # reload the newest checkpoint, skipping a data step
    # after every step, with (metrics, is_last_step, checkpoint agreed due by time)
    after_step: list[Callable[[dict, bool, bool], None]] = field(default_factory=list)
    logged: list[Callable[[dict], None]] = field(default_factory=list)  # after a step's line is written, with it
    step_metrics: Callable[[], dict] = dict  # what the way of training adds to a step's metrics
    due: Callable[[int], bool] = lambda done: False  # a hook acts after step `done` whatever it reports


@dataclass
class Record:
    """What the loop leaves behind, the same on every rank."""

    history: list[dict] = field(default_factory=list)  # per-step metrics
    memory_per_rank: list[dict] = field(default_factory=list)  # the last measurement, rank by rank
    initial_val: dict = field(default_factory=dict)  # train.eval_on_start: validation before step 1


@dataclass(kw_only=True)
class Trainer:
    """One rank's loop (assembled by run.py)."""

    train: TrainConfig
    metrics: MetricsConfig
    step: Stepper
    sampler: GlobalBatchSampler  # its position is the run's step count
    source: object  # data/sources.py: the validation batches
    items_name: str  # "tokens" or "samples"
    hooks: Hooks
    watch: Watch
    sinks: MetricsSinks
    validates: bool = True  # this rank runs validation (Strategy.validates)
    record: Record = field(default_factory=Record)
    collector: Collector = field(default_factory=lambda: Collector(0))  # Python's garbage collector (run.py)
    late: StepReport | None = None  # a step queued and not read yet (see run)

    @property
    def comm(self) -> Comm:
        return self.step.comm

    @property
    def device(self) -> torch.device:
        return self.step.device

    def run(self, feed: Feed) -> Ended:
        """Train until the feed ends (END); or until the ranks agreed to stop early on a signal (STOP), or (a
        live elastic run) to change the group at this step's end (REGROUP).

        A step the loop need not act on at once (not logged, validated, saved or the last) is read a step
        late: its report is read once the next step is queued (report.py), so the device always has a
        step's work ahead of it. What that late read says must be acted on (a stop, a save by time, a
        regroup) makes the step just queued one that is read at once, and acted on at its end: a stop
        signal stops the run within one step."""
        watch = self.watch
        if self.train.eval_on_start and self.sampler.step == 0 and self.validates:
            self.record.initial_val = self.validate(0)
        self.collector.start()
        try:
            while feed.more():
                step = self.sampler.step
                timer = self.begin_step()
                micro_batches = feed.next()
                timer.mark("data_wait_s")
                report = self.step(micro_batches, step, timer, memory=self.memory_figures(step),
                                   backward_began=feed.release)
                self.sampler.step = step + 1
                ended = self.advance(report, feed)
                if ended in (Ended.STOP, Ended.REGROUP):
                    return ended
                self.collector.after_step(self.sampler.step)
            self.flush(feed)
        finally:
            self.collector.close()
            feed.close()
            if watch.trace:
                watch.trace.close()
            if watch.syncs:
                watch.syncs.close()
        return Ended.END

    def begin_step(self) -> StepTimer:
        """The step the sampler is at begins (begin_step): shoal's loop and a Session's steps alike."""
        return begin_step(self.watch, self.device, self.comm.log if self.watch.profile else None, self.sampler.step)

    def advance(self, report: StepReport, feed: Feed | None, now: bool = False) -> Ended | None:
        """A step is queued (the sampler has moved past it): read the step before it if that was left for
        now, then this one at once or not (`now`: at once). shoal's loop and a Session's step() complete
        every step here. Returns what complete() says of the step read, or None. `feed`: None in a Session
        (no rollback)."""
        at_once = now or not self.step.lags or self.acts_after(report.step + 1, feed)
        owed_save = False  # a save the ranks agreed on a step read late: taken at the end of this one
        if self.late is not None:
            late, self.late = self.late, None
            ended = self.complete(late, feed, last=False)
            if ended is Ended.ROLLED_BACK:
                return ended  # the step just queued trained on weights the rollback replaced
            at_once, owed_save = at_once or ended is Ended.ACT, late.result().save
        if not at_once:
            self.late = report
            return None
        return self.complete(report, feed, last=self.at_end(feed), owed_save=owed_save)

    def flush(self, feed: Feed | None) -> None:
        """Read the step left for later, if any (the run ends, or a Session saves)."""
        if self.late is not None:
            late, self.late = self.late, None
            self.complete(late, feed, last=self.at_end(feed))

    def at_end(self, feed: Feed | None) -> bool:
        return feed.last() if feed is not None else self.sampler.step >= self.train.steps

    def logged(self, step: int) -> bool:
        """Whether step `step` (0-based) writes its line: every metrics.log_interval steps, and the last."""
        return (step + 1) % self.metrics.log_interval == 0 or step + 1 == self.train.steps

    def acts_after(self, done: int, feed: Feed | None) -> bool:
        """Whether something happens after step `done` whatever its report says: validation, a checkpoint by
        interval, the feed's end."""
        t = self.train
        return (self.at_end(feed) or bool(t.val_interval and done % t.val_interval == 0 and self.validates)
                or self.hooks.due(done))

    def complete(self, report: StepReport, feed: Feed | None, last: bool, owed_save: bool = False) -> Ended | None:
        """Read a step's report and do what follows it: count a bad step (or roll back), the metrics, the
        hooks. Returns STOP or REGROUP when the ranks agreed to, ROLLED_BACK, ACT when a step read late asks
        for a stop, a save or a regroup (which the step after it then carries out), else None."""
        out, step = report.result(), report.step
        if out.bad and self.step.bad_steps.record_bad(step + 1, out.loss, out.grad_norm) == "rollback":
            feed.close()  # nothing is prepared from the sampler while it is read back
            self.hooks.rollback(self.sampler.data_step(step))  # back to the checkpoint, minus this batch
            self.sinks.print(f"step {step + 1}: loss {out.loss}; rolled back to step {self.sampler.step}")
            feed.restart(self.sampler.step)
            return Ended.ROLLED_BACK
        if not out.bad:
            self.step.bad_steps.record_good()
        if self.watch.trace:
            self.watch.trace.after(step + 1)
        acted_on_now = self.sampler.step == step + 1  # else the weights have moved on: a save waits
        self.after_step(step + 1, report.lr, out, report.timer, last=last,
                        by_time=acted_on_now and (out.save or owed_save))
        if not acted_on_now:
            return Ended.ACT if out.stop or out.save or out.regroup else None
        if out.stop or out.regroup:
            return Ended.STOP if out.stop else Ended.REGROUP
        return None

    def after_step(self, done: int, lr: float, out: StepResult, timer: StepTimer, last: bool,
                   by_time: bool = False) -> None:
        """Metrics, validation and hooks of step `done` (1-based: steps completed); `by_time`: a checkpoint
        the ranks agreed is due by time."""
        m = self.step_metrics(done, lr, out, timer)
        if self.step.balance:  # before the checkpoint hooks: a split agreed now is saved with this step
            m.update(self.step.balance.after_step(done))
        if out.bad:
            m["skipped"] = True
            self.sinks.print(f"step {done}: loss {out.loss}, gradient norm {out.grad_norm}: update skipped")
        if out.loss_scale_after_overflow is not None:  # fp16: the scaler's own skip, not a bad step
            m.update(skipped=True, overflow=True, loss_scale=out.loss_scale_after_overflow)
            self.sinks.print(f"step {done}: fp16 gradients overflowed: update skipped, loss scale lowered to "
                             f"{out.loss_scale_after_overflow:g}")
        if out.memory is not None:  # a logged step
            m.update(self.memory(out.memory, done))
            m.update(self.step.expert_figures(done))  # a mixture of experts' (models/moe.py)
        validated = self.validates and (last or (self.train.val_interval and done % self.train.val_interval == 0))
        if validated:
            m.update(self.validate(done))
        self.record.history.append(m)
        self.sinks.step(m)
        if last or validated or "peak_memory_bytes" in m or "skipped" in m:
            self.sinks.log(m)
            for hook in self.hooks.logged:
                hook(m)
        self.watch.phase.outside("checkpoint and hooks")
        for hook in self.hooks.after_step:
            hook(m, last, by_time)

    def step_metrics(self, done: int, lr: float, out: StepResult, timer: StepTimer) -> dict:
        """What metrics.jsonl records of step `done` (memory and validation aside)."""
        profile, phases, syncs = self.watch.profile, timer.phases, self.watch.syncs
        total = sum(phases.values())  # timer.total, added up once
        return {"step": done, "time": time.time(), "loss": out.loss, "lr": lr, "grad_norm": out.grad_norm,
                f"{self.items_name}_per_s": out.items / total, "step_time_s": total, **phases,
                **({"host_syncs": syncs.take(done)} if syncs else {}),  # metrics.host_syncs
                # bytes this rank sent to keep the replicas in sync: this step, and since this attempt started
                "comm_bytes": out.comm_bytes, "comm_bytes_total": self.comm.sync_bytes, **self.hooks.step_metrics(),
                **(profile.step(phases, timer.exposed, total, self.share_of_batch(done)) if profile else {})}

    def memory_figures(self, step: int) -> dict[str, float] | None:
        """What step `step` (0-based) gathers with its memory: None when it measures none (not logged); with
        the step profile on, this rank's mean compute per step since the last measured step."""
        if not self.logged(step):
            return None
        profile = self.watch.profile
        return {"compute_s": profile.take_compute()} if profile else {}

    def memory(self, rows: list[dict], done: int) -> dict:
        """What the step's metrics say of every rank's memory (the largest rank's: the one that runs out
        first) and, with the profile on, of their compute (a straggler); the rows are the record's."""
        profile = self.watch.profile
        self.record.memory_per_rank = rows
        m = {"peak_memory_bytes": max(r["peak"] for r in rows),
             **{f"{k}_bytes": max(r[k] for r in rows) for k in STATE_KINDS}}
        if profile:
            m.update(profile.stragglers([r.pop("compute_s") for r in rows], done))
            if "straggler_rank" in m:
                self.sinks.print(f"rank {m['straggler_rank']}: compute {m['straggler_ratio']:.1f}x the median of the "
                                 f"other ranks (steps {m['straggler_steps'][0]}-{done})")
        return m

    def share_of_batch(self, done: int) -> float:
        """This rank's share of step `done`'s samples against an even share (1.0 without balancing)."""
        balance = self.step.balance
        if not balance:
            return 1.0
        split = balance.split_for(done - 1)
        return split[balance.dp_rank] * len(split) / sum(split)

    def validate(self, done: int) -> dict:
        """Collective: the validation metrics after step `done`, printed."""
        self.watch.phase.outside("validation")
        s = self.step
        val = evaluate(s.par, self.source, self.train, s.precision, self.comm, self.device)
        self.sinks.print(f"step {done}: " + ", ".join(f"{k} {v:.4f}" for k, v in val.items()))
        return val

