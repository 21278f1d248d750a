"""Run one command per host of the cluster that is up: a node agent each, as on real machines.

`shoal train ...` gets `--nnodes N --node-rank i --rdzv-endpoint <h0's address>:<port>` (node 0, on
host h0, hosts the rendezvous); any other command learns the same from SHOAL_NNODES, SHOAL_NODE_RANK
and SHOAL_RDZV_ENDPOINT. Each runs in its host's namespace with GLOO_SOCKET_IFNAME set to the host's
interface, inside its cpu group when it has one. SIGINT and SIGTERM are passed on to every node; when
one node fails, the others have FAIL_GRACE_S seconds to end on their own (their agents usually see the
lost peers) before they are stopped. The exit code is the worst of the nodes' (of those not stopped).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from shoal.cluster import hosts, shape
from shoal.cluster.system import netns_exec, require_root
from shoal.errors import UserError

FAIL_GRACE_S = 30.0
KILL_AFTER_S = 15.0
SET_BY_CLUSTER = ("--nnodes", "--node-rank", "--rdzv-endpoint")
RESUME_COMMAND = "SHOAL_RESUME_COMMAND"  # read by shoal's workers: the command that continues the run
NODE_ENV = "SHOAL_CLUSTER_HOST"  # set on every node: the host it runs on


def run(command: list[str], resume_command: str | None = None) -> int:
    """Start `command` on every host and wait for all; returns the worst exit code."""
    require_root("run")
    if not command:
        raise UserError("shoal cluster run needs a command after --, for example: shoal cluster run -- shoal train "
                        "cfg.toml --nproc 1")
    cluster = hosts.require_up()
    if Path(command[0]).name == "shoal":  # the same shoal (and its virtualenv) in every namespace
        command = [sys.executable, "-m", "shoal", *command[1:]]
    is_train = command[1:4] == ["-m", "shoal", "train"]
    if is_train:
        given = [a for a in command if a.split("=")[0] in (*SET_BY_CLUSTER, "--cluster")]
        if given:
            raise UserError(f"{given[0]}: on the cluster, --nnodes, --node-rank and --rdzv-endpoint are set for each "
                            f"host (and --cluster is implied); leave them out")
    endpoint = f"{cluster.hosts[0].addr}:{free_port(cluster.hosts[0])}"
    n = len(cluster.hosts)
    procs = []
    for rank, host in enumerate(cluster.hosts):
        argv = [*command, *(["--nnodes", str(n), "--node-rank", str(rank), "--rdzv-endpoint", endpoint]
                            if is_train else [])]
        env = {**os.environ, "GLOO_SOCKET_IFNAME": host.ifname, NODE_ENV: host.name, "SHOAL_NNODES": str(n),
               "SHOAL_NODE_RANK": str(rank), "SHOAL_RDZV_ENDPOINT": endpoint}
        if resume_command:
            env[RESUME_COMMAND] = resume_command
        join = (lambda g=host.cgroup: shape.join_cpu_group(g)) if host.cgroup else None
        procs.append(subprocess.Popen([*netns_exec(host.netns), *argv], env=env, start_new_session=True,
                                      preexec_fn=join))
    return wait_all(procs, [h.name for h in cluster.hosts])


def free_port(host: hosts.Host) -> int:
    """A port free on `host` (its namespace has nothing else listening but shoal's own runs)."""
    out = subprocess.run([*netns_exec(host.netns), sys.executable, "-c",
                          "import socket\ns = socket.socket()\ns.bind(('', 0))\nprint(s.getsockname()[1])"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise UserError(f"cannot run in {host.netns}: {(out.stderr.strip().splitlines() or ['?'])[-1]}")
    return int(out.stdout)


def wait_all(procs: list[subprocess.Popen], names: list[str]) -> int:
    def forward(sig, _frame):
        for p in procs:
            if p.poll() is None:
                _signal(p.pid, sig)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    failed_at = stopped_at = None
    stopped: set[int] = set()  # nodes stopped because another failed: their exit codes say nothing new
    try:
        while [p.poll() for p in procs].count(None):  # every one polled: a list, not a short-circuit
            now = time.monotonic()
            if failed_at is None and any(p.returncode for p in procs):
                failed_at = now
            if failed_at is not None and stopped_at is None and now - failed_at > FAIL_GRACE_S:
                bad = next(i for i, p in enumerate(procs) if p.returncode)
                left = [names[i] for i, p in enumerate(procs) if p.returncode is None]
                print(f"shoal cluster: {names[bad]} failed (exit code {procs[bad].returncode}) {FAIL_GRACE_S:g} s "
                      f"ago; stopping {', '.join(left)}", file=sys.stderr, flush=True)
                stopped = {i for i, p in enumerate(procs) if p.returncode is None}
                forward(signal.SIGTERM, None)
                stopped_at = now
            if stopped_at is not None and now - stopped_at > KILL_AFTER_S:
                forward(signal.SIGKILL, None)
            time.sleep(0.1)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return max(rc if rc >= 0 else 128 - rc for i, rc in enumerate(p.returncode for p in procs) if i not in stopped)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
