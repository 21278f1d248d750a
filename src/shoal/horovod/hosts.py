"""horovodrun's `-np N` and `-H host:slots,...` as shoal's launcher takes them.

horovodrun starts N processes over the hosts' slots, reaching other machines over ssh. shoal's
launcher starts the processes of one node, on the node itself; several nodes each run the same
`shoal run` (by hand, or through Slurm, a PyTorchJob or SageMaker, which start it on every node).
So:
  - hosts that are all this machine (localhost, 127.0.0.1, its host name): one node of N processes;
  - the hosts of the cluster on this machine (`shoal cluster up`: h0, h1, ... or their addresses), all of
    them, the same slots each: `--cluster`, one node per host;
  - `--cluster` without -H: -np spread evenly over the cluster's hosts;
  - any other machine: refused in one line that gives the command to run on each machine instead.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from shoal.errors import UserError

LOCAL = {"localhost", "127.0.0.1", "::1"}


@dataclass(frozen=True)
class Placement:
    nproc: int  # processes per node
    cluster: bool  # one node per host of the cluster on this machine


def parse_hosts(text: str) -> list[tuple[str, int]]:
    """`host1:2,host2:2` (a host without slots has 1, as in horovodrun)."""
    hosts = []
    for item in text.split(","):
        name, _, slots = item.strip().rpartition(":") if ":" in item else (item.strip(), "", "1")
        if not name or not slots.isdigit() or int(slots) < 1:
            raise UserError(f"-H {text}: expected HOST:SLOTS[,HOST:SLOTS...], for example -H localhost:2")
        hosts.append((name, int(slots)))
    return hosts


def is_local(name: str) -> bool:
    return name in LOCAL or name in (socket.gethostname(), socket.getfqdn())


def placement(np: int | None, hosts: str | None, nproc: int | None, cluster: bool,
              cluster_hosts: list[tuple[str, str]] | None) -> Placement:
    """Where -np / -H put the processes. `cluster_hosts`: the (name, address) of each host of the cluster on
    this machine, None when none is up."""
    given = parse_hosts(hosts) if hosts else None
    total = sum(s for _, s in given) if given else None
    np = np if np is not None else total
    if np is None or np < 1:
        raise UserError(f"-np {np}: give the number of processes, at least 1")
    if total is not None and np > total:
        raise UserError(f"-np {np}: more processes than -H {hosts} has slots ({total})")
    if given is None and cluster:
        return _spread(np, cluster_hosts)
    if given is None or all(is_local(h) for h, _ in given):
        return _checked(Placement(np, False), nproc)
    known = {n for pair in (cluster_hosts or []) for n in pair}
    if cluster_hosts and all(h in known for h, _ in given):
        return _checked(_on_cluster(np, given, hosts, cluster_hosts), nproc)
    first = next(h for h, _ in given if not is_local(h))
    raise UserError(f"-H {hosts}: shoal starts no processes on other machines (no ssh); on each machine run `shoal "
                    f"run --horovod --nproc SLOTS --nnodes {len(given)} --node-rank I --rdzv-endpoint {first}:29400 "
                    f"SCRIPT`, or start it under Slurm, a PyTorchJob or SageMaker with no node flags "
                    f"(docs/your-cluster.md)")


def _spread(np: int, cluster_hosts: list[tuple[str, str]] | None) -> Placement:
    n = len(cluster_hosts or [])
    if n == 0 or np % n:
        raise UserError(f"-np {np} with --cluster: the cluster's {n} hosts take the same number of processes each; "
                        f"give a multiple of {n}" if n else "--cluster: no cluster is up (shoal cluster up --hosts N)")
    return Placement(np // n, True)


def _on_cluster(np: int, given: list[tuple[str, int]], hosts: str, cluster_hosts: list[tuple[str, str]]) -> Placement:
    names = sorted({name for name, addr in cluster_hosts for h, _ in given if h in (name, addr)})
    slots = {s for _, s in given}
    if len(names) != len(cluster_hosts) or len(given) != len(cluster_hosts) or len(slots) != 1:
        every = ",".join(f"{name}:{max(slots)}" for name, _ in cluster_hosts)
        raise UserError(f"-H {hosts}: the cluster on this machine runs one node on each of its hosts, the same "
                        f"processes each; give them all, e.g. -H {every}")
    if np != sum(s for _, s in given):
        raise UserError(f"-np {np}: on the cluster every slot of -H {hosts} runs a process; give -np "
                        f"{sum(s for _, s in given)}")
    return Placement(slots.pop(), True)


def _checked(place: Placement, nproc: int | None) -> Placement:
    if nproc is not None and nproc != place.nproc:
        raise UserError(f"--nproc {nproc} and -np/-H ({place.nproc} per node) disagree; give one of them")
    return place


def without_flags(flags: list[str]) -> list[str]:
    """`flags` less -np and -H with their values (a node of the cluster gets --nproc instead)."""
    out, skip = [], False
    for a in flags:
        if skip:
            skip = False
        elif a in ("-np", "-H"):
            skip = True
        elif not a.startswith(("-np=", "-H")):
            out.append(a)
    return out
