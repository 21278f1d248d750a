"""A real Ray cluster on the cluster's hosts (`shoal cluster up --ray`): the engine `shoal train --ray` and
Ray Train run on, not an imitation of it.

`ray start --head` on host 0 and `ray start --address` on every other host, each in its host's namespace
and cpu group, with the host's address as its node address, os.cpu_count() CPUs (as the Slurm nodes
declare) and a small object store. Each runs with `--block`, in a session of its own: the Ray processes
of a host are that command's process group (recorded in RAY_DIR/pgids: stop() ends them), and `shoal
cluster down` stops them with the hosts' other processes. Each node has its own temp dir under RAY_DIR:
nodes sharing one (one machine) each tail every node's logs, and a driver printed every line twice.
GLOO_SOCKET_IFNAME is the host's interface: this machine's hostname resolves to loopback in every
namespace, so a process group that Ray Train makes would bind 127.0.0.1 (as shoal's own workers did:
[Note: node address] in launch/restart.py).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from shoal.errors import UserError, install_hint
from shoal.testbed import shape
from shoal.testbed.system import netns_exec, wait_up

RAY_DIR = Path("/run/shoal-cluster/ray")
PORT = 6379
OBJECT_STORE_BYTES = 100 * 2 ** 20  # Ray's default is 30% of memory per node
STARTED = "Ray runtime started"  # what `ray start` prints once its node is up


def require_ray() -> None:
    if importlib.util.find_spec("ray") is None:
        raise UserError(f"--ray needs the ray package; install it with: {install_hint('ray')}")


def address(cluster) -> str:
    return f"{cluster.hosts[0].addr}:{PORT}"


def up(cluster) -> None:
    """Start a Ray node on every host, the head on host 0, and wait until each says it is up."""
    require_ray()
    if RAY_DIR.exists():
        shutil.rmtree(RAY_DIR)
    RAY_DIR.mkdir(parents=True)
    for i, host in enumerate(cluster.hosts):
        where = (["--head", "--port", str(PORT), "--include-dashboard=false"] if i == 0
                 else ["--address", address(cluster)])
        argv = [sys.executable, "-c", "from ray.scripts.scripts import main; main()", "start", "--block", *where,
                "--node-ip-address", host.addr, "--num-cpus", str(os.cpu_count() or 1), "--disable-usage-stats",
                "--object-store-memory", str(OBJECT_STORE_BYTES), "--temp-dir", str(RAY_DIR / host.name)]
        log = RAY_DIR / f"{host.name}.out"
        join = (lambda g=host.cgroup: shape.join_cpu_group(g)) if host.cgroup else None
        with open(log, "w") as out:
            node = subprocess.Popen([*netns_exec(host.netns), "env", f"GLOO_SOCKET_IFNAME={host.ifname}", *argv],
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, preexec_fn=join)
        with open(RAY_DIR / "pgids", "a") as f:
            f.write(f"{node.pid}\n")
        wait_up("Ray", lambda log=log: STARTED in log.read_text(errors="replace"), f"{STARTED!r} from {host.name}",
                log)


def status_line(cluster) -> str:
    return (f"ray: head on {cluster.hosts[0].name} at {address(cluster)}, a node on every host; from a host: ip netns "
            f"exec {cluster.hosts[0].netns} shoal train CONFIG --ray {address(cluster)}")


def running() -> bool:
    return RAY_DIR.exists()


def stop(grace_s: float = 2.0) -> bool:
    """End the Ray nodes up() started (SIGTERM to each node's process group, SIGKILL what is left after
    `grace_s`) and remove Ray's files; the hosts stay up."""
    if not RAY_DIR.exists():
        return False
    pgids = [int(p) for p in (RAY_DIR / "pgids").read_text().split()] if (RAY_DIR / "pgids").exists() else []
    for signum in (signal.SIGTERM, signal.SIGKILL):
        for pgid in pgids:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signum)
        deadline = time.monotonic() + grace_s
        while signum == signal.SIGTERM and time.monotonic() < deadline and any(_alive(g) for g in pgids):
            time.sleep(0.1)
    shutil.rmtree(RAY_DIR, ignore_errors=True)
    return True


def _alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def down() -> bool:
    """Remove Ray's files (its processes ran in the hosts' namespaces and were stopped with them)."""
    return stop(grace_s=0)
