"""One node of a live elastic run (`--nnodes MIN:MAX`): its workers started and watched, a failed one
replaced by a worker that heals from a live peer, signals passed on; node 0 also hosts the
membership store ([Note: live membership] in membership.py).

torch elastic's agent is not used here: it restarts every local worker (and, through re-rendezvous,
every node's) on any failure, and a node joining a running job hangs its re-rendezvous (torch 2.13).
Its process layer is: each worker is started by torch.distributed.elastic.multiprocessing (its own
error file, its output as is), one context per worker so that one ending does not end the others.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

from shoal.launch.restart import EndpointUnreachable, route_workers, split_endpoint
from shoal.live import membership

POLL_S = 0.05  # how soon a worker's end is seen (and its peers stop waiting on it)
STACKS_S = 1.0  # a worker being ended: how long it has to print its stacks before SIGKILL


class _Worker:
    def __init__(self, local_rank: int, member: int, ctx):
        self.local_rank, self.member, self.ctx = local_rank, member, ctx
        self.ending: float | None = None  # when it was told to print its stacks, on its way out


def launch_live(worker: list[str], nproc: int, nnodes: tuple[int, int], node_rank: int, endpoint: str,
                threads: int | None, max_restarts: int, rdzv_timeout: float, start_nodes: int | None = None) -> int:
    """Run this node's `nproc` workers (`python <worker>`) in the live run at `endpoint`; returns the node's
    exit code: 0 when its workers finished the run, 128 + N when they left on signal N, else 1 (2 when
    every failure was a user error). `start_nodes`: the nodes a scheduler started together (the first
    generation waits for them all)."""
    host, port = split_endpoint(endpoint)
    server = None
    if node_rank == 0:  # the store lives as long as this launcher: losing it ends the run (resume from disk)
        server = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                               timeout=timedelta(seconds=rdzv_timeout))
    try:
        addr = route_workers(endpoint, node_rank, rdzv_timeout)
    except EndpointUnreachable as e:
        print(f"shoal: {e}", file=sys.stderr)
        return 1
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)
    store = membership.connect(endpoint, rdzv_timeout)
    name = f"node {node_rank}" + (f" ({addr})" if addr != "127.0.0.1" else "")
    world = f"{nnodes[0] * nproc}:{nnodes[1] * nproc}" + (f":{start_nodes * nproc}" if start_nodes else "")
    env = {membership.STORE_ENV: endpoint, membership.WORLD_ENV: world,
           "LOCAL_WORLD_SIZE": str(nproc)}
    stop = _Signals()

    def start(local_rank: int) -> _Worker:
        member = membership.draw_id(store, name, local_rank)
        ctx = start_processes(f"shoal-live-{member}", sys.executable, {0: tuple(worker)},
                              {0: {**env, membership.ID_ENV: str(member), "LOCAL_RANK": str(local_rank)}},
                              DefaultLogsSpecs())
        stop.install()  # starting workers installs torch elastic's own handler, which raises in this loop
        return _Worker(local_rank, member, ctx)

    watching, beats = threading.Event(), None
    if server is not None:  # a node that dies whole closes no connection: its beat going still says so
        beats = threading.Thread(target=membership.watch_beats, args=(membership.connect(endpoint, rdzv_timeout),
                                                                       watching), daemon=True, name="shoal-beats")
        beats.start()
    codes = _watch([start(i) for i in range(nproc)], start, store, stop, max_restarts, name)
    if beats is not None:  # the others may train on (this node's workers left): keep the store till the end
        _serve_until_done(store)
        watching.set()
        # a thread still in a store call as the interpreter exits can abort it ("terminate called without an
        # active exception": 2 of 90 runs of a scratch script doing just that, 0 of 60 once it was joined)
        beats.join(timeout=10)
    if stop.signum:
        return 128 + stop.signum
    if not codes:
        return 0
    return 2 if all(c == 2 for c in codes) else max(codes)


def _watch(workers: list[_Worker], start, store, stop: _Signals, max_restarts: int, name: str) -> list[int]:
    """Until every worker of this node has ended: a signal passed on once, a failed worker replaced by
    `start(local_rank)` while --max-restarts allows and the run goes on. Returns the failed ones' codes."""
    restarts, codes = 0, []
    while workers:
        if stop.signum and not stop.passed:
            for w in workers:  # each leaves at its next step's end; all asked: the run stops and saves
                for pid in w.ctx.pids().values():
                    os.kill(pid, stop.signum)
            stop.passed = True
        for w in list(workers):
            result = w.ctx.wait(0)
            if result is None:
                _end_if_out(w, store, name)
                continue
            workers.remove(w)
            try:
                membership.mark_gone(store, w.member, failed=result.is_failed())
                store_gone, done = False, membership.is_done(store)
            except dist.DistError:  # node 0's launcher ended (the run is over) or its host died
                store_gone, done = True, True
            if not result.is_failed():
                continue
            failure = next(iter(result.failures.values()))
            code = failure.exitcode
            how = f"exit code {code}" if code >= 0 else f"signal {signal.Signals(-code).name}"
            if stop.signum or done or restarts >= max_restarts:
                codes.append(128 - code if code < 0 else code)
                if not stop.signum:
                    why = ("the run's store (node 0's launcher) is gone" if store_gone else
                           f"{max_restarts} replacement(s) allowed (--max-restarts), {restarts} used")
                    print(f"shoal: {name}: worker {w.local_rank} (member {w.member}) failed with {how}; {why}",
                          file=sys.stderr, flush=True)
                continue
            restarts += 1
            print(f"shoal: {name}: worker {w.local_rank} (member {w.member}) failed with {how}; a replacement "
                  f"joins and heals from a live peer ({restarts} of --max-restarts {max_restarts})", file=sys.stderr,
                  flush=True)
            workers.append(start(w.local_rank))
        time.sleep(POLL_S)
    return codes


def _end_if_out(w: _Worker, store, name: str) -> None:
    """A worker the run has marked gone while its process runs (evicted: alive but stalled past
    parallel.timeout_s; or its node fell silent and came back) must not linger: its Python stacks first
    (the workers dump them on SIGUSR1), then SIGKILL STACKS_S later. Its end then counts as a failure,
    replaced while --max-restarts allows."""
    if w.ending is not None:
        if time.monotonic() - w.ending >= STACKS_S:
            _signal(w, signal.SIGKILL)
        return
    try:
        why = membership.why_out(store, w.member)
    except dist.DistError:  # the store is gone: the run is over
        return
    if why is None:
        return
    print(f"shoal: {name}: worker {w.local_rank} (member {w.member}) is out of the run ({why}) but still "
          f"running; its stacks, then it is ended:", file=sys.stderr, flush=True)
    _signal(w, signal.SIGUSR1)
    w.ending = time.monotonic()


def _signal(w: _Worker, signum: int) -> None:
    for pid in w.ctx.pids().values():
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile: the watch loop sees that next
            os.kill(pid, signum)


def _serve_until_done(store) -> None:
    """Node 0 hosts the store: wait while the run goes on (some member's heart beats) and is not done, also
    after a signal (its own workers left; the others may still be training or stopping). Once done, wait
    until every launcher has said its workers ended: the workers of a stopped run end a moment apart, and
    a launcher that found the store gone when it came to write that failed (exit 1 instead of 143)."""
    last, changed = membership.beats(store), time.monotonic()
    while not (membership.is_done(store) and membership.all_gone(store)) \
            and time.monotonic() - changed < 2 * membership.STALE_S:
        time.sleep(membership.BEAT_S)
        now = membership.beats(store)
        if now != last:
            last, changed = now, time.monotonic()


class _Signals:
    """SIGTERM / SIGINT to this launcher: passed on to its workers once."""

    def __init__(self):
        self.signum, self.passed = 0, False
        self.install()

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame) -> None:
        self.signum = self.signum or signum
