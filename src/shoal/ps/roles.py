"""An asynchronous parameter-server run as separate elastic jobs, so that workers can come and go.

torch elastic treats the processes of a job as one: when one fails, the agent stops and restarts them
all. That is right for collectives (a world with a hole cannot all-reduce) and wrong for an
asynchronous parameter server, whose point is that a worker's death does not stop the others. So
`shoal train` with `ps.mode = "async"` (on one machine) starts the roles apart, each under an
elastic agent of its own (the same `shoal train` command with SHOAL_PS_ROLE set):

  the servers: one job of ps.servers processes, `--max-restarts` as given: when one dies its
               agent restarts them all, and they resume from their newest checkpoint (the servers
               save alone: checkpoints.py); their workers' links break, and each worker
               joins the restarted servers (retrying for parallel.timeout_s) and is dealt what the
               checkpoint lacks
  each worker: a job of one process, `--max-restarts` as given: its agent restarts only it, and the
               restarted worker registers again, pulls the current parameters and is dealt units

They meet through a TCPStore that server 0 hosts on a free port (loopback), named in SHOAL_PS_STORE;
the links between servers and workers are made from it (links.py). The run succeeds when
the servers and the worker of slot 0 (which writes the results) do; a worker that failed for good is
named, one line each, and does not fail the run: its units were dealt to the others.
"""

from __future__ import annotations

import datetime
import os
import sys

from shoal.launch.ports import free_port
from shoal.launch.supervisor import Child, Supervisor

ROLE, STORE, SLOT, WORKERS = "SHOAL_PS_ROLE", "SHOAL_PS_STORE", "SHOAL_PS_SLOT", "SHOAL_PS_WORKERS"


def role() -> str | None:
    """"server" or "worker" inside a role's job; None otherwise."""
    return os.environ.get(ROLE)


def reports(rank: int) -> bool:
    """Whether this process prints the run's result: rank 0, or in the roles' jobs the worker of slot 0."""
    if role() is None:
        return rank == 0
    return role() == "worker" and os.environ.get(SLOT) == "0"


def total_world(nproc: int) -> int:
    """The run's world (workers + servers) as the layout sees it; `nproc` outside a role's job."""
    return int(os.environ["SHOAL_PS_WORLD"]) if role() else nproc


def open_store(host_it: bool, timeout_s: float):
    """The store the roles meet through; server 0 hosts it."""
    from torch.distributed import TCPStore

    host, port = os.environ[STORE].rsplit(":", 1)
    return TCPStore(host, int(port), is_master=host_it, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=timeout_s))


def launch_roles(train_argv: list[str], nproc: int, servers: int, max_restarts: int) -> int:
    """Run `shoal <train_argv>` as the servers' job and one job per worker, under the launcher's
    supervisor; returns the exit code. The servers and worker slot 0 (which writes the results) are
    required: the run fails, and the rest are stopped at once, when one of them fails, and is done when
    both end well (a worker still starting, or stalled, is then not needed)."""
    workers = nproc - servers
    env = {**os.environ, STORE: f"127.0.0.1:{free_port()}", WORKERS: str(workers), "SHOAL_PS_WORLD": str(nproc)}
    shoal = [sys.executable, "-m", "shoal", *train_argv, "--max-restarts", str(max_restarts)]
    jobs = [Child("servers", [*shoal, "--nproc", str(servers)], env={**env, ROLE: "server"})]
    jobs += [Child(f"worker {slot}", [*shoal, "--nproc", "1"], env={**env, ROLE: "worker", SLOT: str(slot)},
                   required=slot == 0) for slot in range(workers)]
    return Supervisor("shoal", grace_s=0.0).run(jobs)
