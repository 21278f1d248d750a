"""One rank's Run (run.py), assembled once, for `shoal train` (train.py) and `shoal.Session` (session.py) alike:

    assemble()  the model laid out by the strategy, its optimizer, number format, checkpoints, the
                Stepper built whole (its stop / save / regroup controls one object), the sampler, and every
                stateful part registered for checkpoints: a Run
    trainer()   the Run's loop: its metrics sinks, the step profile and traces, the hooks (checkpoint when
                due, heartbeat, rollback)

What differs between the two is only what comes before: `shoal train` builds the model from the config
and the optimizer from train.*; a Session is handed the user's model and optimizer (its class and
hyperparameters), and refuses the keys it cannot honour (session.py: refuse_unhonoured, refuse_conflicts).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from shoal import signals
from shoal.checkpoint.manager import CheckpointManager
from shoal.checkpoint.resume import newest_valid
from shoal.checkpoint.train_state import TrainState
from shoal.data.loader import prefetch_depth
from shoal.data.sampler import GlobalBatchSampler
from shoal.errors import TrainingError
from shoal.metrics.host_syncs import HostSyncs
from shoal.metrics.profile import Profiler
from shoal.metrics.sinks import MetricsSinks
from shoal.metrics.trace import StepTrace
from shoal.models.moe import Stages, bias_balance, expert_figures
from shoal.models.spec import ModelBundle
from shoal.parallel.balance import ComputeClock, ThroughputBalance
from shoal.parallel.parallelized import Parallelized
from shoal.parallel.precision import Precision, one_kind_per_group
from shoal.parallel.zero import local_optimizer
from shoal.rundir import Heartbeat
from shoal.training.bad_steps import BadStepPolicy
from shoal.training.loop import Hooks, Trainer, Watch
from shoal.training.optim import Schedule
from shoal.training.run import Run, Start
from shoal.training.step import Controls, Stepper


def assemble(start: Start, bundle: ModelBundle, optimizer: Callable[[Parallelized], torch.optim.Optimizer], *,
             n_params: int, num_train: int, resume_path: Path | None = None, sample: dict | None = None,
             regroup_wanted: Callable[[], bool] | None = None) -> Run:
    """Collective: `bundle`'s model laid out, `optimizer(par)` over it, and every part of the run around
    them. `num_train`: the samples the sampler draws from; `sample`: one pipeline micro-batch to time the
    layers with; `regroup_wanted`: a live elastic run's (live/generation.py)."""
    cfg, env, run, strategy = start.cfg, start.env, start.dir, start.strategy
    par = strategy.parallelize(bundle, sample)
    # the layer a hang report names is where a collective inside the model waits: one process has none to wait
    # in (and no live peer to check on), and its hooks cost a tiny model's forward 0.1 ms of 0.8; a compiled
    # model runs its layers as one graph
    if not cfg.train.compile and (env.world_size > 1 or regroup_wanted is not None):
        start.phase.track(par.model, bundle.block_types)
    torch.manual_seed(cfg.train.seed + 1 + env.rank)  # dropout etc. differ per rank, reproducibly
    opt = optimizer(par)
    one_kind_per_group(local_optimizer(opt))
    precision = Precision(cfg.precision.dtype, env.device)
    checkpoints = CheckpointManager(run.checkpoints, strategy.checkpointing(cfg.checkpoint), start.comm,
                                    before_write=strategy.before_save)
    controls = Controls(stop_requested=signals.requested, stop_age=signals.age, save_wanted=checkpoints.wants_save,
                        before_update=checkpoints.wait_staged, regroup_wanted=regroup_wanted)
    step = Stepper(par=par, optimizer=opt, schedule=Schedule(opt, cfg.train), precision=precision,
                   bad_steps=BadStepPolicy(cfg.train.on_bad_step, cfg.train.max_bad_steps,
                                           scaled=precision.scaler is not None),
                   comm=start.comm, device=env.device, count_fn=bundle.count_fn, grad_clip=cfg.train.grad_clip,
                   phase=start.phase, controls=controls, balance=balance(start, par))
    sampler = GlobalBatchSampler(num_train, cfg.train.global_batch_size, cfg.train.seed)
    # the loop counts a step once its update is done; the step measures memory on logged steps
    step.expert_figures = balance_experts(start, par, bundle.model, opt, lambda: sampler.step + 1,
                                          lambda: step.measuring)
    stateful = {"sampler": sampler, "scheduler": step.schedule, "scaler": precision, "bad_steps": step.bad_steps,
                "sync": par.sync, **({"balance": step.balance} if step.balance else {})}
    if getattr(start.source, "streamed", False):  # data.streaming: this dp rank's place in the stream
        from shoal.data.stream import StreamPosition

        stateful["stream"] = StreamPosition(start.source.train_stream(par.data_rank, par.data_ranks), sampler)
    state = TrainState(par.model, strategy.saved_optimizer(opt), stateful, replicas_differ=start.layout.replicas > 1)
    if env.rank == 0:
        run.path.mkdir(parents=True, exist_ok=True)
        run.config.write_text(cfg.to_toml(), encoding="utf-8")
    return Run(start=start, bundle=bundle, n_params=n_params, step=step, sampler=sampler, state=state,
               resume_path=resume_path, checkpoints=checkpoints)


def balance_experts(start: Start, par: Parallelized, whole: torch.nn.Module, opt: torch.optim.Optimizer,
                    step: Callable[[], int], logged: Callable[[], bool]) -> Callable[[int], dict]:
    """A mixture of experts' counts (models/moe.py) summed over the dp ranks after each update, as step `step()`'s:
    they move each layer's loss-free bias, and metrics.jsonl reports them (on the steps `logged()`, which are
    all that need them without the bias; under a pipeline gathered then from the stages that hold `whole`'s
    layers). Returns what a logged step records of them (expert_figures)."""
    stage_group = getattr(par, "stage_group", None)  # a pipeline's: each rank trains some of the layers
    stages = None if stage_group is None else Stages(
        par.model, lambda t: start.comm.all_reduce(t, group=stage_group, label="pp"), start.env.device)
    model = par.model if stages is None else whole
    hook = bias_balance(model, (lambda t: start.comm.all_reduce(t, group=par.dp_group, label="dp"))
                        if par.dp > 1 else None, step, logged, stages)
    if hook:
        opt.register_step_post_hook(hook)
        return lambda done: expert_figures(model, done)
    return lambda done: {}


def balance(start: Start, par: Parallelized) -> ThroughputBalance | None:
    """balance.mode = "throughput": the split of each step's batch by measured speed. A new split waits until
    the batches prefetched before it are used."""
    cfg = start.cfg
    if cfg.balance.mode != "throughput":
        return None
    return ThroughputBalance(cfg.train.global_batch_size, start.layout.dims.dp, par.dp_rank,
                             interval=cfg.balance.interval,
                             lag=prefetch_depth(cfg.data.prefetch, start.source) + 1, comm=start.comm,
                             dp_group=par.dp_group, clock=ComputeClock(par.model, start.env.device),
                             device=start.env.device)


def trainer(run: Run, *, items_name: str, profiler: Callable[[], tuple[Profiler, str]] | None,
            validates: bool) -> str | None:
    """The Run's loop (run.trainer from now on); returns the line saying what MFU is measured against (None: no
    step profile). `profiler()`: metrics.profile's profiler and that line."""
    cfg, where = run.cfg, run.dir
    sinks = MetricsSinks(where.path if run.is_main else None, cfg.train.steps, run.sampler.step, items_name,
                         cfg.metrics.tensorboard, cfg.metrics.progress)
    watch, line = Watch(phase=run.step.phase), None
    if cfg.metrics.profile and profiler is not None:
        watch.profile, line = profiler()
    if cfg.metrics.trace_steps:
        watch.trace = StepTrace(cfg.metrics.trace_steps, where.traces, run.env.rank, run.env.device)
    if cfg.metrics.host_syncs:
        watch.syncs = HostSyncs(run.env.device, lambda: watch.phase.step).open()
    run.trainer = Trainer(train=cfg.train, metrics=cfg.metrics, step=run.step, sampler=run.sampler, source=run.source,
                          items_name=items_name, hooks=hooks(run), watch=watch, sinks=sinks, validates=validates)
    return line


def hooks(run: Run) -> Hooks:
    """The loop's hooks: the checkpoint when due, the heartbeat (rank 0), the rollback of a bad step."""
    checkpoints = run.checkpoints

    def save_if_due(m: dict, last: bool, by_time: bool) -> None:
        if checkpoints.due(m["step"], last, by_time):
            run.save(m["step"])
        checkpoints.poll()

    def rollback(bad_data_step: int) -> None:
        """Collective: back to the newest checkpoint, never to train on data step `bad_data_step` again."""
        checkpoints.wait()
        path = run.comm.agree("rollback", lambda: str(newest_valid(run.dir.checkpoints) or ""))
        if not path:
            raise TrainingError('train.on_bad_step = "rollback" found no checkpoint to go back to; save one '
                                'earlier (checkpoint.interval) or use "skip"')
        run.reload(Path(path), keep=("bad_steps",))  # counting rollbacks goes on
        run.sampler.skip_data_step(bad_data_step)

    # the heartbeat a restart reads (the step a failed attempt had reached): with each logged line, not every
    # step, where a new file and a rename cost a small step's host as much as the rest of it
    heartbeat = Heartbeat(run.dir.progress)
    logged = [lambda m: heartbeat.write({"step": m["step"], "time": m["time"],
                                         "world": run.comm.world_size})] if run.is_main else []
    return Hooks(rollback=rollback, after_step=[save_if_due], logged=logged, step_metrics=run.strategy.step_metrics,
                 due=lambda done: checkpoints.due(done, last=False))

