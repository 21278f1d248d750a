"""The server `shoal train`'s workers are forked from ([Note: forked workers] in launch/restart.py), started
as the command begins.

[Note: early fork server] The server imports torch and shoal's training stack (~2.3 s of one core here)
before it can fork a worker. Started by torch elastic when the launch begins, that import came after
everything the launcher does first (its config, its own torch import, the job's checks: ~1.9 s), one
after the other: a one-step 2-worker run took 5.8 s where torchrun's took 4.3. Started as the command
begins, the server imports on one core while the launcher works on the other.

A forked worker sees the environment its server started with, and what torch elastic's agent hands each worker
(its rank variables and OMP_NUM_THREADS). So the launch forks from the early server only where the launcher's
environment is still the one the server started with; where the launcher changed it since, the server is
stopped, and torch elastic starts one with the environment as it is. So what the launch will add for its workers
is added before the server starts where it can be known then (LD_PRELOAD of tcmalloc for ZeRO 2/3 on CPU, which
must be there when a process starts: cli/train.py's early_worker_env), and what the launcher's own checks set
alike in each worker is not compared (SET_ALIKE). What the launch learns for its workers
after the server started, GLOO_SOCKET_IFNAME on a node of several, is handed to each forked worker with its
arguments instead (launch/restart.py's Forked), so a node of a fixed-size job of several forks from its early
server too: its workers import while its launcher waits at the rendezvous. The server never outlives the
command: it is stopped when the command ends, whether or not the command forked from it.

Nothing here imports torch: that is the point.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import signal

# what a forked worker's server imports once, before it forks. torch._dynamo is imported by torch's optimizers
# when the first one is made (~0.5 s of CPU a worker here), and the built-in GPT by its builder: in the server,
# a 2-worker run of one step took 6.35 s of CPU in all instead of 6.84 (medians of 5)
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "shoal.models.gpt", "shoal.worker",
           "shoal.training.train", "shoal.ps.rank")
# what the agent hands each worker itself: the server need not have started with it
HANDED = frozenset({"OMP_NUM_THREADS"})
# what the launcher's own checks set, where each worker sets it alike before anything reads it: KERAS_BACKEND's
# default, as shoal imports a user's module (models/registry.py import_user_callable), and torch's inductor cache
# directory, its default written into the environment when the launcher's torch first asks for it. Compared,
# they stopped the early server in every run of a user's model (and ZeRO 2/3's on CPU): the workers came from a
# second server, started once the launch began, and the first one's imports (~2.3 s of a core) were wasted
SET_ALIKE = frozenset({"KERAS_BACKEND", "TORCHINDUCTOR_CACHE_DIR"})

_started_with: dict[str, str] | None = None  # the environment the early server started with (None: none started)


def start_early(preload: tuple[str, ...] = PRELOAD) -> None:
    """Start the fork server now, importing `preload`, in this process's environment as it is (unless this
    process runs one already: that one is left alone)."""
    global _started_with
    if multiprocessing.forkserver._forkserver._forkserver_pid is not None:
        return
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(preload))
    multiprocessing.forkserver.ensure_running()
    _started_with = dict(os.environ)


def use_or_stop() -> None:
    """The launch is about to fork its workers: an early server started in another environment than this
    process's now is stopped (torch elastic then starts one in this one)."""
    if _started_with is not None and _differs(_started_with, dict(os.environ)):
        stop()


def stop() -> None:
    """Stop the early server, if one runs. It is killed rather than asked to end: it may still be importing,
    and it reads its request to end only once it has."""
    global _started_with
    if _started_with is None:
        return
    _started_with = None
    server = multiprocessing.forkserver._forkserver  # the process-wide server that ensure_running() started
    pid = server._forkserver_pid
    if pid is not None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # it ended already
            pass
        server._stop()  # reaps it and forgets it, so that a later launch starts a fresh one


def _differs(before: dict[str, str], now: dict[str, str]) -> bool:
    keys = (before.keys() | now.keys()) - HANDED - {k for k in SET_ALIKE if k not in before}
    return any(before.get(k) != now.get(k) for k in keys)
