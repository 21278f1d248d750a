"""Run one command per host of the cluster that is up: a node agent each, as on real machines.

`shoal train ...` and `shoal run ...` get `--nnodes N --node-rank i --rdzv-endpoint <h0's address>:<port>`
(node 0, on host h0, hosts the rendezvous); any other command learns the same from SHOAL_NNODES, SHOAL_NODE_RANK
and SHOAL_RDZV_ENDPOINT. Each runs in its host's namespace with GLOO_SOCKET_IFNAME set to the host's
interface, inside its cpu group when it has one. The nodes run under the launcher's supervisor
(launch/supervisor.py): SIGINT and SIGTERM are passed on to every node; when one node fails, the others
have FAIL_GRACE_S seconds to end on their own (their agents usually see the lost peers) before they are
stopped. The exit code is the worst of the nodes' (of those not stopped).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from shoal.errors import UserError
from shoal.launch import RESUME_COMMAND
from shoal.launch.supervisor import Child, Supervisor
from shoal.testbed import hosts, shape
from shoal.testbed.system import netns_exec, require_root

FAIL_GRACE_S = 30.0
KILL_AFTER_S = 15.0
SET_BY_CLUSTER = ("--nnodes", "--node-rank", "--rdzv-endpoint")
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
    launches = command[1:3] == ["-m", "shoal"] and command[3:4] in (["train"], ["run"])  # through torch elastic
    if launches:
        given = [a for a in command if a.split("=")[0] in (*SET_BY_CLUSTER, "--cluster")]
        if given:
            raise UserError(f"{given[0]}: on the cluster, --nnodes, --node-rank and --rdzv-endpoint are set for each "
                            f"host (and --cluster is implied); leave them out")
    endpoint = f"{cluster.hosts[0].addr}:{free_port(cluster.hosts[0])}"
    n = len(cluster.hosts)
    nodes = []
    for rank, host in enumerate(cluster.hosts):
        # right after the command's name: `shoal run` passes what follows its script to the script
        argv = [*command[:4], *(["--nnodes", str(n), "--node-rank", str(rank), "--rdzv-endpoint", endpoint]
                                if launches else []), *command[4:]]
        env = {**os.environ, "GLOO_SOCKET_IFNAME": host.ifname, NODE_ENV: host.name, "SHOAL_NNODES": str(n),
               "SHOAL_NODE_RANK": str(rank), "SHOAL_RDZV_ENDPOINT": endpoint}
        if resume_command:
            env[RESUME_COMMAND] = resume_command
        join = (lambda g=host.cgroup: shape.join_cpu_group(g)) if host.cgroup else None
        nodes.append(Child(host.name, [*netns_exec(host.netns), *argv], env=env, preexec_fn=join))
    return Supervisor("shoal cluster", grace_s=FAIL_GRACE_S, kill_after_s=KILL_AFTER_S).run(nodes)


def free_port(host: hosts.Host) -> int:
    """A port free on `host` (its namespace has nothing else listening but shoal's own runs)."""
    out = subprocess.run([*netns_exec(host.netns), sys.executable, "-c",
                          "import socket\ns = socket.socket()\ns.bind(('', 0))\nprint(s.getsockname()[1])"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise UserError(f"cannot run in {host.netns}: {(out.stderr.strip().splitlines() or ['?'])[-1]}")
    return int(out.stdout)
