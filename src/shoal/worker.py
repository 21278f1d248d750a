"""One worker process: check, join the group, train, report, exit.

Runs inside a process started by torch elastic (`shoal train --nproc N`, or torchrun with
`-m shoal train`). Errors are written to the elastic error file so the launcher can name the rank
that failed and why; the process ends through dist.exit_process ([Note: exit] in dist.py), but for a
forked worker's success, which returns to torch's multiprocessing ([Note: forked workers] in
launch/restart.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import faulthandler
import gc
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import torch
from torch.distributed import PrefixStore
from torch.distributed.elastic.multiprocessing.errors import get_error_handler

from shoal import dist, membership, signals
from shoal.allocator import release_freed_memory
from shoal.comm.collectives import Comm
from shoal.comm.phase import Phase
from shoal.comm.report import hang_report
from shoal.comm.watchdog import Watchdog
from shoal.config import Config, load_config
from shoal.errors import TrainingError, UserError
from shoal.launch import RESUME_COMMAND
from shoal.preflight import Job, check_job
from shoal.ps.roles import reports, total_world
from shoal.rundir import default_run_dir, holds_a_run, move_aside

FAILED_KEY = "shoal/failed"


def threads_per_worker(cfg: Config, local_world_size: int) -> int:
    return cfg.parallel.threads_per_worker or share_of_cores(local_world_size)


def share_of_cores(local_world_size: int) -> int:
    """The cores this process may use, shared among the node's workers (at least 1 each)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // local_world_size)


def choose_run_dir(given: str | None, config_path: str | None, cfg: Config, resume: str, first_attempt: bool) -> Path:
    """The run dir: the one given, or the stable default ([Note: stable run dir] in rundir.py). A fresh
    start (--resume never) over an earlier run moves that run aside first; a restarted attempt of the
    same job never does."""
    path = Path(given) if given else default_run_dir(config_path, cfg)
    if resume == "never" and first_attempt and holds_a_run(path):
        moved = move_aside(path)
        print(f"shoal: --resume never: the earlier run in {path} was moved to {moved}", file=sys.stderr, flush=True)
    return path


def finished_message(run_dir, step: int, steps: int) -> str:
    return (f"{run_dir} already holds this run, finished at step {step} of train.steps = {steps}: nothing to "
            f"train (raise train.steps to train on, or --resume never to start over); results in {run_dir}/")


def resume_hint(resume: str) -> str:
    command = os.environ.get(RESUME_COMMAND)
    if command:
        return f"to resume, run: {command}"
    return "to resume, run the same command" + (" with --resume auto" if resume != "auto" else "")


def _quiet(fn, default):
    """fn(), or `default` if it raises: for best-effort store calls while a run is failing."""
    try:
        return fn()
    except Exception:  # noqa: BLE001
        return default


def run_rank(cfg: Config, job: Job, run_dir: Path, env, comm: Comm, resume: str = "auto",
             phase: Phase | None = None, live=None) -> dict:
    """This rank's part of the job: training, or, under sync.mode = "parameter-server", serving or
    training as the parameter server's ranks do (ps/run.py). Returns the run's summary."""
    if job.layout.servers:
        from shoal.ps.run import run_job  # heavy imports come here, after set_num_threads

        return run_job(cfg, job.layout, job.source, run_dir, env, comm, resume=resume, phase=phase)
    from shoal.training.train import run_training

    return run_training(cfg, job.layout, job.source, run_dir, env, comm, resume=resume, phase=phase, live=live)



def forked(config_path: str | None, sets: list[str], run_dir: str | None, resume: str) -> int:
    """The entry of a worker forked by `shoal train`: what `python -m shoal train CONFIG --set ...` does in
    a worker (the config is checked in the launcher first, so a UserError here is rare: one line, exit 2).
    Success returns (multiprocessing reads the return value, then ends the process with os._exit itself);
    a failure ends the process with its code."""
    try:
        cfg = load_config(config_path, sets)
    except UserError as e:
        print(f"shoal: error: {e}", file=sys.stderr)
        dist.exit_process(2)
    code = run(cfg, run_dir, config_path, resume)
    if code:
        dist.exit_process(code)
    return 0


def main(cfg: Config, run_dir: str | None, config_path: str | None, resume: str = "auto") -> None:
    """Entry point of a worker started as `python -m shoal train`; never returns."""
    dist.exit_process(run(cfg, run_dir, config_path, resume))


def run(cfg: Config, run_dir: str | None, config_path: str | None, resume: str = "auto") -> int:
    """Train this rank; returns the process's exit code (a failure's traceback and report already shown)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: where is this rank?
    handler = get_error_handler()
    handler.initialize()
    joined: list[Watchdog] = []  # once the rank is in the group: its watchdog, for the hang report
    try:
        train(cfg, run_dir, config_path, resume, joined)
        return 0
    except signals.Interrupted as e:
        handler.record_exception(e)
        if reports(int(os.environ.get("RANK", "-1"))):  # (an asynchronous parameter server's: worker slot 0)
            print(f"shoal: {e}; {resume_hint(resume)}", file=sys.stderr, flush=True)
        return 128 + e.signum
    except (UserError, TrainingError) as e:  # one line, no traceback: the message says what to do
        handler.record_exception(e)
        print(f"shoal: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, UserError) else 1
    except BaseException as e:  # noqa: BLE001 - any failure must end this rank with its traceback shown
        handler.record_exception(failed(e, joined[0] if joined else None, cfg.parallel.timeout_s))
        return 1


def train(cfg: Config, run_dir: str | None, config_path: str | None, resume: str, joined: list) -> None:
    """Check, join the group, agree the run dir, train, say the result; `joined` gets the watchdog."""
    if membership.is_live_worker():
        return train_live(cfg, run_dir, config_path, resume, joined)
    torch.set_num_threads(threads_per_worker(cfg, int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    if cfg.parallel.zero >= 2 and not torch.cuda.is_available():  # so that sharding shows in peak RSS
        release_freed_memory()
    # a torchrun launch reaches here unchecked; under `shoal train` this repeats the launcher's checks (its
    # memory too: no worker holds a model before all have passed here and joined the group)
    job = check_job(cfg, [total_world(int(os.environ["WORLD_SIZE"]))], cuda=torch.cuda.is_available(), quiet=True,
                    local_workers=int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    env = dist.init(job.layout.backend, cfg.parallel.timeout_s, device=job.layout.device)
    name_process(f"shoal rank {env.rank}")
    comm, phase = Comm(env.store, env.rank, env.world_size), Phase()
    watchdog = Watchdog(comm.log, env.status_store, env.rank, phase)
    joined.append(watchdog)
    # SIGTERM / Ctrl-C: finish the step, save, exit; but at once when another rank failed (signals.py)
    signals.install(lambda: _quiet(lambda: env.status_store.check([FAILED_KEY]), False))
    first_attempt = env.restart_count == 0
    # every rank must write to the same place: rank 0 names it
    path = Path(comm.agree("run_dir", lambda: str(choose_run_dir(run_dir, config_path, cfg, resume, first_attempt))))
    # a restarted attempt continues from the newest checkpoint of the attempt before it
    summary = run_rank(cfg, job, path, env, comm, resume if first_attempt else "auto", phase)
    say_done(summary, path, env.rank, cfg)
    watchdog.stop()
    dist.shutdown()


DRAIN_S = 1.0  # how long an ended generation's failed collectives get to run their callbacks


def train_live(cfg: Config, run_dir: str | None, config_path: str | None, resume: str, joined: list) -> None:
    """A worker of a live elastic run ([Note: live membership] in membership.py): one generation of the
    group after another, each trained from where the last one left this rank (training/live.py), until
    the run ends, this worker leaves on a signal, or it is left out of a run that finished."""
    from shoal.training.live import Live, Regroup, heal, peer_failed

    member = membership.Member.from_env(evict_s=cfg.parallel.timeout_s)
    torch.set_num_threads(threads_per_worker(cfg, int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    worlds = list(range(member.min_world, member.max_world + 1))
    job = check_job(cfg, worlds, cuda=torch.cuda.is_available(), quiet=True)
    gen, held, path, events, record, live = None, None, None, [], None, None
    started, lost_at = time.perf_counter(), time.time()
    # what exists now (imported modules, the checked job) lives as long as the process: out of gc.collect()'s
    # scan at each regroup, which took ~0.1 s of it here with torch's ~300k objects in view
    gc.freeze()
    if member.current() >= 0:  # the run is going: ask the group to take this worker in
        member.request_join()
    while True:
        opened, comm = dist.open_sockets(), None  # what this generation opens is cut when it ends
        gen = next_generation(member, gen, held)
        if gen is None:  # the run ended while this worker waited to join
            print(f"shoal: {member.where(member.id)}: the run finished before this worker could join", flush=True)
            return
        # a member of it lost from now on (before the group has formed too) cuts what this generation opened
        member.watch(gen, lambda o=opened: dist.cut_connections(dist.open_sockets() - o))
        try:
            env, comm, watchdog = join_generation(cfg, job, member, gen, joined)
            # every generation agrees it (a joiner learns it so); a joiner never moves the run it joins aside
            path = Path(comm.agree("run_dir", lambda p=path, fresh=gen.number == 0: str(
                p or choose_run_dir(run_dir, config_path, cfg, resume, fresh))))
            t_heal = time.perf_counter()
            healed, source = heal(comm, held, env.device, from_one=cfg.sync.mode in ("local-sgd", "diloco"))
            if gen.number > 0:
                events.append(describe_change(member, gen, source, time.time() - lost_at,
                                              time.perf_counter() - t_heal, healed.step if healed else 0))
            live = Live(healed, regroup_wanted(member, gen, env.rank), events, record, started, opened)
            layout = job.layouts[worlds.index(env.world_size)]
            summary = run_rank(cfg, dataclasses.replace(job, layouts=[layout]), path, env, comm,
                               resume if gen.number == 0 else "auto", live=live)
            break
        except Regroup as e:  # in training: its state at the step it reached
            gc.disable()  # the generation's objects become garbage from here: see leave_generation
            held, record, lost_at, live = e.snapshot, live.record, time.time(), None
        except Exception as e:  # before training began (forming the group, healing): the state it came with
            if not peer_failed(e):
                raise
            gc.disable()
            lost_at, live = time.time(), None
        if signals.requested():  # asked to stop: said before the others regroup, so none waits for it
            member.leave()
        leave_generation(member, joined, opened, comm.log if comm else None)
        if signals.requested():  # the others go on without this worker
            leave_run(member, held)
    member.watch(None)
    membership.finish(member.store)
    say_done(summary, path, env.rank, cfg)
    watchdog.stop()
    member.stop()
    dist.shutdown()


def leave_generation(member, joined: list, opened: set[tuple[int, str]], log) -> None:
    """Let the ended generation go (automatic garbage collection is off since it ended): its watch and
    watchdog stopped, its connections cut (peers still waiting on this rank fail now: [Note: cutting a
    group's connections] in dist.py), the Python callbacks of its failed collectives run (`log`, its
    CollectiveLog), its group destroyed, its garbage collected."""
    member.watch(None)
    if joined:
        joined[0].stop()
    dist.cut_connections(dist.open_sockets() - opened)
    # freeing a gloo group whose queued work still has a Python callback to run deadlocks (its destructor
    # joins the worker thread that waits for the GIL): once they have run, the collector may free it
    settled = log is None or log.drain(DRAIN_S)
    dist.shutdown()
    if settled:
        # the old generation's model, DDP and optimizer sit in reference cycles: left to the collector, a
        # run that regrouped every 30 s got slower with each generation (steps per 30 s: 148, 122, ... 46).
        # What existed before the first generation is frozen (train_live): this scans only the generations'
        gc.collect()
    else:  # kept for the life of the process rather than risk that deadlock
        print(f"shoal: {member.where(member.id)}: a failed collective's callback did not run within {DRAIN_S:g} s; "
              "the ended generation's memory is kept", file=sys.stderr, flush=True)
        gc.freeze()
    gc.enable()


def next_generation(member, gen, held):
    """The next generation this worker is in (None: the run ended first). A worker left out of one (it
    came too late, or the group is full) asks again for the one after. A stop signal meanwhile (say, while
    too few workers are left and the rest wait for joiners): this worker leaves."""
    while True:
        got = member.regroup(gen, give_up=signals.requested)
        if signals.requested():
            leave_run(member, held)
        if got is not None or membership.is_done(member.store):
            return got
        gen = None
        member.request_join()


def leave_run(member, held) -> None:
    """This worker was asked to stop while others train on: it leaves the run (exit 128 + the signal)."""
    member.leave()  # none of the others waits for it at a regroup
    step = held.step if held is not None else 0
    print(f"shoal: {member.where(member.id)} left the run after step {step} "
          f"({signal.Signals(signals.requested()).name})", file=sys.stderr, flush=True)
    member.stop()
    raise signals.Interrupted(signals.requested(), step, None)


def join_generation(cfg: Config, job: Job, member, gen, joined: list):
    """The process group of generation `gen`, over its own store prefix; this rank's Comm and watchdog."""
    rank, world = gen.rank_of(member.id), gen.world
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))  # for what reads them (the hang report, reports())
    # connections of its own (cut with it when a member is lost: [Note: live membership])
    store, side = membership.connect(member.endpoint), membership.connect(member.endpoint)
    env = dist.join(job.layout.backend, cfg.parallel.timeout_s,
                    PrefixStore(gen.prefix, store), PrefixStore(gen.prefix, side), rank, world,
                    int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1)), gen.number,
                    device=job.layout.device)
    name_process(f"shoal rank {env.rank}")
    comm = Comm(env.store, env.rank, env.world_size)
    watchdog = Watchdog(comm.log, env.status_store, env.rank)
    joined[:] = [watchdog]
    signals.install()  # a signal here means: leave at the next step's end (the flags carry it)
    return env, comm, watchdog


def regroup_wanted(member, gen, rank: int):
    """This rank's wish, at each step's end, that the group change: (rank 0) a joiner waits. A rank asked
    to stop says so in the step's flags of its own (training/step.py decides when it leaves)."""

    def wanted() -> bool:
        return rank == 0 and member.join_wanted(gen)

    return wanted


def describe_change(member, gen, source: int | None, lost_s: float, heal_s: float, step: int) -> dict:
    """The change of the group that formed `gen`, as one line and its numbers."""
    before = member.generation(gen.number - 1)
    left = [m for m in before.members if m not in gen.members] if before else []
    came = [m for m in gen.members if before is None or m not in before.members]
    why = {m: (membership.EVICTED if m in gen.evicted else member.why_gone(m)) for m in left}
    parts = [f"{member.where(m)} left ({why[m]})" for m in left]
    parts += [f"{member.where(m)} joined" + (f" (healed from rank {source} in {heal_s:.2f} s)" if source is not None
                                             else "") for m in came]
    line = (f"step {step}: world {before.world if before else '?'} -> {gen.world}: {'; '.join(parts) or 'regrouped'}; "
            f"regrouped in {lost_s:.1f} s")
    return {"step": step, "time": time.time(), "generation": gen.number, "world": gen.world,
            "left": [member.where(m) for m in left], "left_ranks": [before.rank_of(m) for m in left],
            "joined": [member.where(m) for m in came],
            "why": [why[m] for m in left], "regroup_s": round(lost_s, 3), "heal_s": round(heal_s, 3),
            "healed_from": source, "line": line}


def say_done(summary: dict, path: Path, rank: int, cfg: Config) -> None:
    if reports(rank) and summary.get("already_finished"):
        print(finished_message(path, summary["steps"], cfg.train.steps), flush=True)
    elif reports(rank):
        val = f", val loss {summary['val_loss']:.4f}" if summary.get("val_loss") is not None else ""
        loss = f"{summary['final_loss']:.4f}" if summary.get("final_loss") is not None else "-"
        print(f"done: {summary['steps']} steps in {summary['total_time_s']:.1f} s; final loss {loss}{val}\n"
              f"results in {path}/ (summary.json, metrics.jsonl, config.toml, checkpoints/, tensorboard/)", flush=True)


def name_process(name: str) -> None:
    """This process's name as top and `ps -o comm` show it (Linux; 15 bytes): a forked worker's command
    line is its server's, so the name says which rank it is."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


def failed(e: BaseException, watchdog: Watchdog | None, timeout_s: float) -> BaseException:
    """A rank that failed: its traceback, and when a collective failed, the report of who did not arrive and
    where everyone was; the other ranks are told (the agent's coming SIGTERM means "leave now"). Returns
    what the elastic error file records."""
    rank = os.environ.get("RANK", "?")
    print(f"[rank {rank}] " + "".join(traceback.format_exception(e)), file=sys.stderr)
    if watchdog is None:
        return e
    _quiet(lambda: watchdog.store.set(FAILED_KEY, rank), None)
    report = hang_report(e, watchdog, int(os.environ["WORLD_SIZE"]), f"{timeout_s:.0f} s (parallel.timeout_s)")
    if not report:
        return e
    print(f"shoal: {report}", file=sys.stderr, flush=True)
    return RuntimeError(report.splitlines()[0])
