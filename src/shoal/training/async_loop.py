"""The training loop of an asynchronous parameter-server worker (ps.mode = "async"): units of
data as server 0 deals them (parallel/ps_async.py), until none is left.

A worker's step is the synchronous loop's step on its own world: forward/backward of the unit, the bad
step verdict, the push and pull (the optimizer step). The learning rate follows the run's progress
through the data (the unit's global step), not the worker's own count. Worker 0 writes the metrics
(its own steps, with the staleness the servers saw) and validates; the final validation runs on the
final parameters, once every worker is done.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from shoal import signals
from shoal.metrics.sinks import MetricsSinks
from shoal.metrics.timers import StepTimer
from shoal.models.spec import Batch
from shoal.parallel.ps_async import LinkLost
from shoal.training.loop import Hooks, Record, Trainer, step_metrics, train_step, validate
from shoal.training.optim import lr_factor


def async_train_loop(t: Trainer, hooks: Hooks, unit_batches: Callable[[int], list[Batch]], sinks: MetricsSinks,
                     record: Record, workers: int, is_main: bool) -> bool:
    """Train the units dealt to this worker; returns False when it was asked to stop early. A broken
    link (the servers died, or dropped this worker as stalled) drops the unit in hand and joins the
    servers again: restarted servers resume from their checkpoint and deal what it lacks."""
    ps = t.par.push_pull
    timer = StepTimer(t.device)
    done, m, out = 0, None, {"stop": False}
    joined = False
    while True:
        try:
            if not joined:
                ps.join()  # the current parameters and a first unit
                joined = True
            while ps.unit >= 0:
                unit = ps.unit
                t.phase.begin_step(done + 1)
                timer.start()
                micro_batches = unit_batches(unit)
                timer.mark("data_wait_s")
                lr = t.train.lr * lr_factor(unit // workers, t.train)
                for group in t.optimizer.param_groups:
                    group["lr"] = lr
                out = train_step(t, hooks, micro_batches, timer, measure_memory=False)  # pushes, pulls the next unit
                if out["bad"]:
                    t.bad_steps.record_bad(done + 1, out["loss"], out["grad_norm"])  # "abort" raises here
                else:
                    t.bad_steps.record_good()
                done += 1
                m = {**step_metrics(t, done, lr, out, timer), "unit": unit, "data_step": unit // workers}
                if ps.unit < 0 or out["stop"]:
                    break
                if is_main and t.train.val_interval and done % t.train.val_interval == 0:
                    m.update(validate(t, sinks, done))
                log(t, m, sinks, record)
            t.par.finish()  # slot 0: the final parameters, once every unit is applied
            break
        except LinkLost as e:
            t.optimizer.forget()
            say = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
            if not ps.rejoin(str(e), stop=lambda: signals.requested() > 0, say=say):
                out = {**out, "stop": True}  # stopped meanwhile (the servers too, by the same signal)
                break
    if m is not None:  # (none: this worker joined when every unit was dealt)
        if is_main and not out["stop"]:
            m.update(validate(t, sinks, done))
        log(t, m, sinks, record, last=True)
    return not out["stop"]


def log(t: Trainer, m: dict, sinks: MetricsSinks, record: Record, last: bool = False) -> None:
    record.history.append(m)
    sinks.step(m)
    if last or any(k.startswith("val_") for k in m) or m["step"] % t.metrics.log_interval == 0:
        sinks.log(m)


def make_unit(sampler, source, unit: int, workers: int, train) -> list[Batch]:
    """Unit `unit` of the data: share `unit % workers` of global step `unit // workers`, in micro-batches."""
    return [source.train_batch(i, sampler.data_step(unit // workers)) for i in
            sampler.local_micro_batches(unit // workers, unit % workers, workers, train.micro_batch_size)]
