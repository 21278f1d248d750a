"""Start the worker processes through torch.distributed.elastic, the machinery behind torchrun; on a
failure its agent restarts every worker, and they resume from the newest checkpoint (--max-restarts). The
other elasticity, a live run that goes on without a restart, is the live package's (live/node.py).

One node: a c10d rendezvous on a free loopback port. Several nodes: every node runs the same command
with --nnodes, --rdzv-endpoint HOST:PORT (node 0's address) and its --node-rank; node 0 hosts the
rendezvous store (explicitly: the hostname heuristic fails inside containers and network namespaces;
measured with two namespaces here, both nodes time out after 60 s without `is_host` on node 0).

[Note: node address] Left alone, torch elastic names each node by `socket.getfqdn()`: the agent that
becomes rendezvous rank 0 hosts the workers' store on that name and hands it to every worker as
MASTER_ADDR, and gloo binds the address the hostname resolves to. On a multi-homed machine (an
InfiniBand and an Ethernet address) or in a network namespace the hostname resolves to an address the
other nodes cannot reach (here: "vm" -> 127.0.0.1 in every namespace), so the workers of the other
node wait on their own loopback until the store timeout: two namespaces joined by a veth pair hung
past the rendezvous with no output, `GLOO_SOCKET_IFNAME` set or not. Each node therefore passes its
address on the route to the endpoint as `local_addr` (node 0: the endpoint's own address when it is
one of its addresses), and gloo binds the interface holding that address unless GLOO_SOCKET_IFNAME
says otherwise. A node other than 0 first waits for the endpoint to accept connections, so one that
cannot reach it says so in one line when the rendezvous timeout runs out.

[Note: forked workers] `shoal train` starts its workers by fork from one server process that imported
torch and shoal's training stack once (torch elastic's forkserver start method, a Forked entry), not as
fresh interpreters that each import it again: a worker's imports are ~3 s of CPU here (torch, its
distributed packages, the dynamo import the optimizers trigger), so a 2-worker start pays for one import
instead of two (a one-step run: 5.3 s of CPU in all against 8.2 s with fresh interpreters, medians of
5, benchmarks/startup.py), and an elastic restart forks its workers at once. The server forks
before any thread or tensor exists. A Python caller's workers (shoal.train() from a script, api.py)
stay fresh interpreters: a forkserver re-imports the caller's __main__, which in a script without a
main guard would run it again.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous.api import RendezvousError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from shoal.errors import UserError

RDZV_TIMEOUT_S = 600  # torch elastic's default join timeout


@dataclass(frozen=True)
class Forked:
    """Workers as `entry(*args, env)` forked from a server process that has imported `preload` once
    ([Note: forked workers]); `entry` must be importable by name, put `env` (variables the launch hands each
    worker beyond what its server started with: [Note: node address]) into its environment first, and
    return normally on success."""

    entry: Callable
    args: tuple
    preload: tuple[str, ...]


def launch(worker: list[str] | Forked, nproc: int, nnodes: tuple[int, int] = (1, 1), node_rank: int = 0,
           rdzv_endpoint: str | None = None, threads: int | None = None, max_restarts: int = 0,
           rdzv_timeout: float | None = None, worst_code: bool = False) -> int:
    """Run nproc local workers: `python <worker>` each (a list: the arguments after the interpreter), or
    forked from one preloaded server (Forked); returns the exit code for the CLI (report_failures)."""
    check_launch_args(nproc, nnodes, node_rank, rdzv_endpoint, max_restarts, rdzv_timeout)
    rdzv_timeout = rdzv_timeout or RDZV_TIMEOUT_S
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)  # inherited by the workers before torch starts
    endpoint = rdzv_endpoint or "127.0.0.1:0"
    local_addr, handed = "127.0.0.1", {}
    if nnodes[1] > 1:  # [Note: node address]
        try:
            local_addr = route_workers(endpoint, node_rank, rdzv_timeout,
                                       handed if isinstance(worker, Forked) else os.environ)
        except EndpointUnreachable as e:
            print(f"shoal: {e}", file=sys.stderr)
            return 1
    config = LaunchConfig(
        min_nodes=nnodes[0], max_nodes=nnodes[1], nproc_per_node=nproc,
        run_id=f"shoal-{endpoint}", role="shoal",
        rdzv_backend="c10d", rdzv_endpoint=endpoint,
        rdzv_configs={"is_host": node_rank == 0, "join_timeout": max(1, round(rdzv_timeout))},
        local_addr=local_addr,
        max_restarts=max_restarts, monitor_interval=0.1,
        start_method="forkserver" if isinstance(worker, Forked) else "spawn",
    )
    entrypoint, args = _entrypoint(worker, handed)
    try:
        elastic_launch(config, entrypoint=entrypoint)(*args)
    except ChildFailedError as e:
        return report_failures(e, worst_code)
    except RendezvousError as e:
        print(f"shoal: could not form the job at the rendezvous {endpoint}: {str(e).splitlines()[0]} "
              f"(is node 0 running, with the same --nnodes?)", file=sys.stderr)
        return 1
    except SignalException as e:  # the launcher itself was asked to stop; workers saved and stopped
        print(f"shoal: interrupted by {signal.Signals(e.sigval).name}", file=sys.stderr)
        return 128 + e.sigval
    return 0


def _entrypoint(worker: list[str] | Forked, handed: dict[str, str]) -> tuple:
    """What torch elastic starts, and its arguments: the interpreter, or a Forked entry (its server told
    what to preload), handed what the launch learnt for its workers after their server may have started
    (a forked worker's environment is its server's)."""
    if not isinstance(worker, Forked):
        return sys.executable, worker
    import torch.multiprocessing

    from shoal.launch import forkserver

    forkserver.use_or_stop()  # one started as the command began, if this process's environment is still its
    torch.multiprocessing.get_context("forkserver").set_forkserver_preload(list(worker.preload))
    # a failed forked worker is logged with torch's own traceback of the join (not the worker's, which the
    # worker printed itself): the line is kept, as for a worker started as a binary, the traceback not
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_without_traceback)
    return worker.entry, (*worker.args, handed)


def _without_traceback(record: logging.LogRecord) -> bool:
    record.exc_info, record.exc_text = None, None
    return True


def parse_nnodes(text: str) -> tuple[int, int]:
    """--nnodes as (min, max) nodes: N, or an elastic range MIN:MAX (torchrun's syntax), which makes a live
    run (live/node.py)."""
    lo, colon, hi = text.partition(":")
    try:
        nodes = (int(lo), int(hi)) if colon else (int(text), int(text))
    except ValueError:
        raise UserError(f"--nnodes {text!r}: expected a number of nodes or a range MIN:MAX, for example --nnodes 2 "
                        f"or --nnodes 1:4") from None
    if nodes[0] < 1:
        raise UserError(f"--nnodes {text}: {'MIN ' if colon else ''}must be >= 1")
    if nodes[0] > nodes[1]:
        raise UserError(f"--nnodes {text}: MIN ({nodes[0]}) is above MAX ({nodes[1]}); give MIN:MAX, for example "
                        f"--nnodes {nodes[1]}:{nodes[0]}")
    return nodes


class EndpointUnreachable(RuntimeError):
    """This node found no way to the rendezvous endpoint within the rendezvous timeout."""


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    try:
        return (host.strip("[]") or endpoint), int(port)
    except ValueError:
        raise UserError(f"--rdzv-endpoint {endpoint}: expected HOST:PORT, for example 10.0.0.1:29400") from None


def node_address(endpoint: str, node_rank: int, timeout: float) -> str:
    """This node's address as the other nodes see it: the source address of its route to the endpoint
    (on node 0 that is the endpoint's address itself when it is one of node 0's). A node other than 0
    also waits, up to `timeout` seconds, for the endpoint to accept a connection."""
    host, port = split_endpoint(endpoint)
    deadline = time.monotonic() + timeout
    why = "not tried"
    while True:
        try:
            family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
            with socket.socket(family, socket.SOCK_DGRAM) as udp:
                udp.connect(sockaddr)  # no packet is sent: this only asks the kernel for the route
                local = udp.getsockname()[0]
            if node_rank == 0:
                return local
            with socket.socket(family, socket.SOCK_STREAM) as tcp:
                tcp.settimeout(max(0.1, min(5.0, deadline - time.monotonic())))
                tcp.connect(sockaddr)
                return local
        except socket.gaierror as e:
            if node_rank == 0:
                raise UserError(f"--rdzv-endpoint {endpoint}: cannot resolve {host!r} ({e.strerror}): give node "
                                f"0's address") from None
            why = f"cannot resolve {host!r}: {e.strerror}"
        except OSError as e:
            if node_rank == 0:  # node 0 hosts the store itself; without a route, let torch name the node
                return socket.getfqdn()
            why = e.strerror or str(e) or (errno.errorcode.get(e.errno, "") if e.errno else "") or type(e).__name__
        left = deadline - time.monotonic()
        if left <= 0:
            raise EndpointUnreachable(
                f"node {node_rank} cannot reach the rendezvous endpoint {endpoint} within {timeout:g} s ({why}): "
                f"check that node 0 is running with --rdzv-endpoint {endpoint} and that {host} is its address on a "
                f"network this node reaches (route, firewall; --rdzv-timeout waits longer)")
        time.sleep(min(0.5, left))


def route_workers(endpoint: str, node_rank: int, timeout: float, env: MutableMapping[str, str] = os.environ) -> str:
    """This node's address on the route to `endpoint` (node_address), with gloo told to bind the interface
    holding it unless GLOO_SOCKET_IFNAME says otherwise: in `env`, the workers' (by default this process's
    environment, which they inherit: [Note: node address])."""
    addr = node_address(endpoint, node_rank, timeout)
    ifname = interface_of(addr)
    if ifname and "GLOO_SOCKET_IFNAME" not in os.environ:
        env["GLOO_SOCKET_IFNAME"] = ifname
    return addr


def interface_of(addr: str) -> str | None:
    """The network interface holding the IPv4 address `addr` (None if none here does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                got = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(got[20:24]) == addr:
                return name
    return None


def check_launch_args(nproc: int, nodes: tuple[int, int], node_rank: int, rdzv_endpoint: str | None,
                      max_restarts: int, rdzv_timeout: float | None = None) -> None:
    nnodes = nodes[1]
    if rdzv_timeout is not None and rdzv_timeout <= 0:
        raise UserError(f"--rdzv-timeout ({rdzv_timeout:g}) must be > 0 seconds")
    shown = f"{nodes[0]}:{nnodes}" if nodes[0] < nnodes else nnodes  # as given
    if rdzv_endpoint and nnodes > 1:
        split_endpoint(rdzv_endpoint)
    if nproc < 1:
        raise UserError(f"--nproc ({nproc}) must be >= 1")
    if max_restarts < 0:
        raise UserError(f"--max-restarts ({max_restarts}) must be >= 0")
    if nnodes > 1 and not rdzv_endpoint:
        raise UserError(f"--nnodes {shown} needs --rdzv-endpoint HOST:PORT (node 0's address)")
    if not 0 <= node_rank < nnodes:
        raise UserError(f"--node-rank {node_rank} must be in [0, {nnodes - 1}] for --nnodes {shown}")


def report_failures(e: ChildFailedError, worst_code: bool = False) -> int:
    """One line per failed rank (its own traceback is already on stderr); returns the exit code: 2 when
    every failed worker failed on a user error, else 1; or, with worst_code, the worst of the failed
    workers' own codes (128 + N for one ended by signal N): a user's script's codes mean what it says.

    When one rank fails, torch elastic sends the others SIGTERM and records them as failed too (its
    timestamps are whole seconds, so they do not tell which came first): a rank ended by SIGTERM beside
    one that failed on its own was stopped by the launcher, and neither its line nor its code is the
    cause (measured: a rank exiting 3 while its peer still ran came back as 143, not 3)."""
    failures = dict(e.failures)
    failures.update({r: f for r, f in recorded_failures(e).items() if r not in failures})
    own = [f for f in e.failures.values() if f.exitcode != -signal.SIGTERM]
    codes = []
    for rank, failure in sorted(failures.items()):
        msg = failure.message if isinstance(failure.message, str) else failure.message.get("message", "")
        # no error file (a script's worker): torch's text says only how to get one; the output above has it all
        why = "" if not msg or not msg.strip() or msg.startswith("To enable traceback") else \
            ": " + msg.strip().splitlines()[-1]
        if rank not in e.failures:  # known from its error file only: no pid, no exit code
            print(f"shoal: rank {rank} failed{why}", file=sys.stderr)
            continue
        if own and failure.exitcode == -signal.SIGTERM:
            print(f"shoal: rank {rank} (pid {failure.pid}) was stopped (SIGTERM) when another rank failed",
                  file=sys.stderr)
            continue
        codes.append(failure.exitcode)
        how = f"exit code {failure.exitcode}" if failure.exitcode >= 0 else \
            f"signal {signal.Signals(-failure.exitcode).name}"
        print(f"shoal: rank {rank} (pid {failure.pid}) failed with {how}{why}", file=sys.stderr)
    if worst_code:
        return max((128 - c if c < 0 else c for c in codes), default=1)
    return 2 if codes and all(c == 2 for c in codes) else 1


def recorded_failures(e: ChildFailedError) -> dict[int, ProcessFailure]:
    """Every local rank whose error file records a failure, by global rank. Workers started as binaries
    are all polled; forked ones (a function entry) run in torch's multiprocessing context, whose join
    reports only the first failed process it finds, and when a crashed rank's peers fail within the same
    monitor interval (their collective's connection closed) that may be a peer. The others' error files
    lie beside its own (`<attempt dir>/<local rank>/error.json`, torch elastic's log layout); a rank the
    agent stopped wrote none (signals.py)."""
    found = {}
    for rank, failure in e.failures.items():
        if not os.path.isfile(failure.error_file):
            continue
        attempt = os.path.dirname(os.path.dirname(failure.error_file))
        for local in filter(str.isdigit, os.listdir(attempt)):
            path = os.path.join(attempt, local, "error.json")
            if os.path.isfile(path):  # pid and exit code unknown: 0 and 1 stand in, never printed
                found[rank - failure.local_rank + int(local)] = ProcessFailure(int(local), 0, 1, path)
    return found
