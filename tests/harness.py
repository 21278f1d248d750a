"""An in-process N-rank harness: N worker processes with a gloo group, no CLI, no elastic agent.

`Ranks(n)` spawns n processes once and keeps them; `ranks.run(fn, *args)` calls `fn(env, *args)` on
every rank, inside a fresh default process group made for that call (env is shoal's DistEnv), and
returns the results in rank order. A strategy can so be checked on its own in a fraction of a second
after the processes exist, where a CLI run pays for the launcher, the agent and the imports each time.

Failures never hang a test: each call has a deadline; past it every rank is asked for its Python stack
(SIGUSR1), the processes are killed, and the test fails showing those stacks. A rank that raises (or dies)
fails the test with every rank's outcome, the others given a few seconds to reply (the first reply is often a
peer's "connection closed", not the cause), and the processes are replaced.
"""

from __future__ import annotations

import faulthandler
import gc
import itertools
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest

from shoal.launch.forkserver import PRELOAD as WORKER_PRELOAD

_calls = itertools.count(1)
# Ranks start by fork from one server process that has imported torch and shoal's training stack once
# (multiprocessing's forkserver, which forks before any thread or tensor exists): a pool of 8 ranks
# costs a fork each instead of 8 fresh interpreters importing torch on 2 cores; what `shoal train`'s
# forked workers preload, and this module
PRELOAD = [*WORKER_PRELOAD, "harness"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _serve(rank: int, world_size: int, port: int, conn, stack_file: str) -> None:
    """A worker: wait for calls, run each in its own process group, send back the result."""
    os.environ.update({"OMP_NUM_THREADS": "1", "RANK": str(rank), "WORLD_SIZE": str(world_size)})
    sys.path.insert(0, str(Path(__file__).parent / "fixtures"))  # the failure-injecting user models
    import torch
    import torch.distributed as dist

    from shoal import dist as shoal_dist

    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR1, file=open(stack_file, "w"), all_threads=True)  # noqa: SIM115
    base = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False, wait_for_workers=False)
    while True:
        msg = conn.recv()
        if msg is None:
            os._exit(0)  # gloo's exit-time destructors can abort: leave without them
        call, fn, args, timeout_s = msg
        try:
            store = dist.PrefixStore(f"call{call}", base)
            env = shoal_dist.join("gloo", timeout_s, store, store, rank, world_size)
            # gloo's connectFullMesh can return on one rank before its peer's side is done: a call that ends at
            # once there (a refusal) destroyed the group under the peer, which failed its join with "Connection
            # closed by peer" (seen in CI; under two busy loops here tens of 1,200 calls failed so, none since). No rank starts the call before every rank has joined; on the store,
            # not a collective, which the group's flight record would count.
            store.set(f"joined{rank}", "1")
            store.wait([f"joined{r}" for r in range(world_size)], timedelta(seconds=timeout_s))
            reply = ("ok", fn(env, *args))
        except BaseException:  # noqa: BLE001 - reported to the test with the traceback
            reply = ("error", traceback.format_exc())
        finally:
            # What the call made (a model, its meshes, DDP's reducer) holds its process groups in reference cycles,
            # and DTensor's caches hold its meshes until shoal's shutdown empties them: left to Python's collector,
            # an earlier call's gloo group was destroyed in the middle of a later call, at a different moment on
            # each rank (its sockets closed during a later call in 1 call of 3 here), where gloo's threads have
            # crashed a rank (SIGABRT, and a fault in pt_gloo_runloop, seen in CI; once, at the final gather of a
            # ZeRO 3 run that followed other DTensor runs). Released and collected here, every group ends at the
            # call's end, on every rank alike (0 of 167 calls).
            shoal_dist.shutdown()
            gc.collect()
        conn.send(reply)


class Ranks:
    def __init__(self, world_size: int):
        import torch.distributed as dist

        self.world_size = world_size
        self.store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False)
        self.tmp = Path(tempfile.mkdtemp(prefix="shoal-ranks-"))
        ctx = _context()
        self.conns, self.procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(rank, world_size, self.store.port, child,
                                                    str(self.tmp / f"stack{rank}")), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def run(self, fn, *args, timeout: float = 180, pg_timeout: float = 60) -> list:
        """`fn(env, *args)` on every rank; the results, rank by rank."""
        call = next(_calls)
        for conn in self.conns:
            conn.send((call, fn, args, pg_timeout))
        deadline = time.monotonic() + timeout
        replies: dict[int, tuple] = {}
        while len(replies) < self.world_size:
            for rank, conn in enumerate(self.conns):
                if rank not in replies and conn.poll(0.05):
                    try:
                        replies[rank] = conn.recv()
                    except EOFError:  # its process ended without replying
                        pytest.fail(self._failure(fn.__name__, None, replies))
                    if replies[rank][0] == "error":
                        pytest.fail(self._failure(fn.__name__, rank, replies))
            if time.monotonic() > deadline:
                stacks = self._stacks()
                self.close(kill=True)
                pytest.fail(f"{fn.__name__} did not finish on every rank within {timeout} s (done: "
                            f"{sorted(replies)}); stacks:\n{stacks}")
            if any(not p.is_alive() for p in self.procs):
                pytest.fail(self._failure(fn.__name__, None, replies))
        return [replies[r][1] for r in range(self.world_size)]

    def _failure(self, name: str, first: int | None, replies: dict[int, tuple], grace: float = 10) -> str:
        """Every rank's outcome once one rank failed (`first`, or None for a process that died), the processes
        killed. The others are given `grace` seconds to reply: the rank that failed first is often not the one
        whose reply came first (a peer that crashed or left makes the others' collectives fail too)."""
        deadline = time.monotonic() + grace
        while len(replies) < self.world_size and time.monotonic() < deadline:
            for rank, conn in enumerate(self.conns):
                if rank not in replies and self.procs[rank].is_alive() and conn.poll(0.05):
                    try:
                        replies[rank] = conn.recv()
                    except EOFError:
                        self.procs[rank].join(timeout=1)
            if all(r in replies or not self.procs[r].is_alive() for r in range(self.world_size)):
                break
        outcomes = []
        for rank in range(self.world_size):
            if rank in replies:
                kind, value = replies[rank]
                outcomes.append(f"--- rank {rank}: " + (f"raised\n{value}" if kind == "error" else "finished"))
            elif not self.procs[rank].is_alive():
                outcomes.append(f"--- rank {rank}: its process died (exit code {self.procs[rank].exitcode})")
            else:
                outcomes.append(f"--- rank {rank}: no reply within {grace} s of the failure")
        self.close(kill=True)
        what = f"rank {first} of {self.world_size} failed" if first is not None else "a rank process died"
        return f"{what} in {name}; every rank:\n" + "\n".join(outcomes)

    @property
    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    def _stacks(self) -> str:
        for p in self.procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGUSR1)
        time.sleep(1)
        return "\n".join(f"--- rank {r}:\n{(self.tmp / f'stack{r}').read_text()}" for r in range(self.world_size))

    def close(self, kill: bool = False) -> None:
        for conn, proc in zip(self.conns, self.procs, strict=True):
            if not kill:
                try:
                    conn.send(None)
                except OSError:
                    pass
            proc.join(timeout=0 if kill else 5)
            if proc.is_alive():
                proc.kill()
        self.procs, self.conns = [], []


class RankPools:
    """One Ranks per world size, made on first use and remade after a failure."""

    def __init__(self):
        self.pools: dict[int, Ranks] = {}

    def __call__(self, world_size: int) -> Ranks:
        pool = self.pools.get(world_size)
        if pool is None or not pool.alive:
            pool = self.pools[world_size] = Ranks(world_size)
        return pool

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()


# --- training through the harness -------------------------------------------------------------------

def train(env, overrides: list[str], run_dir, resume: str = "auto", config: str | None = None) -> tuple[dict, str]:
    """`shoal train [config]` on this rank without the launcher: preflight, then run_training. Returns the
    summary and what the rank printed; rank 0 writes the run dir as a CLI run would."""
    import contextlib
    import io

    from shoal.comm.collectives import Comm
    from shoal.config import load_config
    from shoal.preflight import check_job
    from shoal.worker import run_rank

    cfg = load_config(config, overrides)
    job = check_job(cfg, [env.world_size], cuda=False, quiet=True)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        summary = run_rank(cfg, job, Path(run_dir), env, Comm(env.store, env.rank, env.world_size), resume)
    return summary, out.getvalue()
