"""One worker process: join the group, train, report, exit.

Runs inside a process started by torch elastic (`shoal train --nproc N`, or torchrun with
`-m shoal train`). Errors are written to the elastic error file so the launcher can name the rank
that failed and why; the process always ends through dist.exit_process ([Note: exit] in dist.py).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import get_error_handler

from shoal import dist, signals
from shoal.comm.watchdog import CollectiveLog, Watchdog, collective_report
from shoal.config import Config
from shoal.errors import TrainingError, UserError
from shoal.plan import make_plan


def default_run_dir(config_path: str | None) -> Path:
    stem = Path(config_path).stem if config_path else "run"
    base = Path("runs") / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def threads_per_worker(cfg: Config, local_world_size: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cfg.parallel.threads_per_worker or max(1, cores // local_world_size)


def _quiet(fn, default):
    """fn(), or `default` if it raises: for best-effort store calls while a run is failing."""
    try:
        return fn()
    except Exception:  # noqa: BLE001
        return default


def main(cfg: Config, run_dir: str | None, config_path: str | None, resume: str = "auto") -> None:
    """Entry point of a launched worker; never returns."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: where is this rank?
    failed_key = "shoal/failed"
    handler = get_error_handler()
    handler.initialize()
    code, watchdog = 0, None
    log = CollectiveLog()
    try:
        torch.set_num_threads(threads_per_worker(cfg, int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
        plan = make_plan(cfg, int(os.environ["WORLD_SIZE"]))
        env = dist.init(plan.backend, cfg.parallel.timeout_s)
        watchdog = Watchdog(log, env.status_store, env.rank)
        # SIGTERM / Ctrl-C: finish the step, save, exit; but at once when another rank failed (signals.py)
        signals.install(lambda: _quiet(lambda: env.status_store.check([failed_key]), False))
        # every rank must write to the same place: rank 0 names it, the others read it from the store
        if env.rank == 0:
            env.store.set("run_dir", str(run_dir or default_run_dir(config_path)))
        path = Path(env.store.get("run_dir").decode())
        from shoal.train.run import run_training  # after set_num_threads: heavy imports come here

        summary = run_training(cfg, path, env, resume, log)
        if env.rank == 0:
            val = f", val loss {summary['val_loss']:.4f}" if summary.get("val_loss") is not None else ""
            print(f"done: {summary['steps']} steps in {summary['total_time_s']:.1f} s; final loss "
                  f"{summary['final_loss']:.4f}{val}\nresults in {path}/ (summary.json, metrics.jsonl, "
                  f"config.toml, checkpoints/, tensorboard/)", flush=True)
        dist.shutdown()
    except signals.Interrupted as e:
        handler.record_exception(e)
        if os.environ.get("RANK") == "0":
            print(f"shoal: {e}; run the same command to resume", file=sys.stderr, flush=True)
        code = 128 + e.signum
    except (UserError, TrainingError) as e:  # one line, no traceback: the message says what to do
        handler.record_exception(e)
        print(f"shoal: error: {e}", file=sys.stderr)
        code = 2 if isinstance(e, UserError) else 1
    except BaseException as e:  # noqa: BLE001 - any failure must end this rank with its traceback shown
        rank = os.environ.get("RANK", "?")
        print(f"[rank {rank}] " + "".join(traceback.format_exception(e)), file=sys.stderr)
        if watchdog:  # tell the other ranks: the agent's coming SIGTERM means "leave now"
            _quiet(lambda: watchdog.store.set(failed_key, rank), None)
        report = collective_report(watchdog, int(os.environ["WORLD_SIZE"]), e) if watchdog else None
        if report:  # a collective failed: say who did not arrive and where everyone was
            print(f"shoal: {report}", file=sys.stderr, flush=True)
            e = RuntimeError(report.splitlines()[0])
        handler.record_exception(e)
        code = 1
    dist.exit_process(code)
