"""One worker process: check, join the group, train, report, exit.

Runs inside a process started by torch elastic (`shoal train --nproc N`, or torchrun with
`-m shoal train`). Errors are written to the elastic error file so the launcher can name the rank
that failed and why; the process ends through dist.exit_process ([Note: exit] in dist.py), but for a
forked worker's success, which returns to torch's multiprocessing ([Note: forked workers] in
launch/restart.py).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import traceback
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import get_error_handler

from shoal import dist, signals
from shoal.allocator import frees_layer_buffers, release_freed_memory
from shoal.comm.collectives import Comm
from shoal.comm.phase import Phase
from shoal.comm.report import hang_report
from shoal.comm.watchdog import Watchdog
from shoal.config import Config, load_config
from shoal.errors import TrainingError, UserError
from shoal.launch import RESUME_COMMAND
from shoal.live import membership
from shoal.preflight import Job, check_job
from shoal.ps.roles import reports, total_world
from shoal.rundir import choose_run_dir
from shoal.training.summary import say_done

FAILED_KEY = "shoal/failed"


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
             phase: Phase | None = None) -> dict:
    """This rank's part of the job: training, or, under sync.mode = "parameter-server", serving or
    training as the parameter server's ranks do (ps/rank.py). Returns the run's summary."""
    if job.layout.servers:
        from shoal.ps.rank import run_job  # heavy imports come here, after set_num_threads

        return run_job(cfg, job.layout, job.source, run_dir, env, comm, resume=resume, phase=phase)
    from shoal.training.train import run_training

    return run_training(cfg, job.layout, job.source, run_dir, env, comm, resume=resume, phase=phase)



def forked(config_path: str | None, sets: list[str], run_dir: str | None, resume: str, env: dict[str, str]) -> int:
    """The entry of a worker forked by `shoal train`: what `python -m shoal train CONFIG --set ...` does in
    a worker (the config is checked in the launcher first, so a UserError here is rare: one line, exit 2),
    with `env` (what the launch hands it beyond its server's environment: launch/restart.py's Forked) set
    first. Success returns (multiprocessing reads the return value, then ends the process with os._exit
    itself); a failure ends the process with its code."""
    os.environ.update(env)
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
        from shoal.live.generations import train_live

        return train_live(cfg, run_dir, config_path, resume, joined)
    torch.set_num_threads(dist.threads_per_worker(cfg, int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    if frees_layer_buffers(cfg.parallel.zero, cfg.parallel.cp) and not torch.cuda.is_available():  # so that
        release_freed_memory()  # sharding (and cp's split) shows in peak RSS
    # a torchrun launch reaches here unchecked; under `shoal train` this repeats the launcher's checks (its
    # memory too: no worker holds a model before all have passed here and joined the group)
    job = check_job(cfg, [total_world(int(os.environ["WORLD_SIZE"]))], cuda=torch.cuda.is_available(), quiet=True,
                    local_workers=int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    env = dist.init(job.layout.backend, cfg.parallel.timeout_s, device=job.layout.device)
    dist.name_process(f"shoal rank {env.rank}")
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
    say_done(summary, path, cfg.train.steps, reports(env.rank))
    watchdog.stop()
    dist.shutdown()


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
