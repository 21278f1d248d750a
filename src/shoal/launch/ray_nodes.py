"""One shoal node agent per node of a running Ray cluster: `shoal train --ray [ADDRESS]`, `shoal run --ray`,
shoal.train(ray=...).

Ray places, shoal launches. The driver (this process, anywhere `ray.init(ADDRESS)` reaches the cluster)
reserves a placement group of --nnodes bundles with the STRICT_SPREAD strategy (one bundle per Ray node;
each bundle --nproc CPUs, and --nproc GPUs when the cluster has GPUs), puts one NodeAgent actor in each,
and each actor starts `python -m shoal <command> --nnodes N --node-rank i --rdzv-endpoint ADDR:PORT` on its
node: the same node agent as on any machine (torch elastic's agent, its workers, --max-restarts, the
hang report), the rendezvous on actor 0's node address. The driver supervises the nodes as the testbed
does its hosts (launch/supervisor.py): SIGINT and SIGTERM reach every node agent (a checkpoint, then
exit 143), a node that fails leaves the others FAIL_GRACE_S to end on their own before they are
stopped, and the exit code is the worst node's. The actors are Ray's: when the driver dies, Ray ends
them, and each node agent with its actor (its parent-death signal is SIGTERM: it saves and stops).

Files: every node runs in the driver's working directory and writes to the run dir there (or
--run-dir). Every rank writes its checkpoint shards into the run dir, so both must be paths that every
Ray node sees (a shared filesystem: NFS, a cluster's home). This is checked before anything starts:
node 0 writes a mark file, the others look for it; a node that does not see it is named in one line.

Output: each actor reads its node agent's stdout and stderr, and the driver prints them, each line after
`[node i]`, on the same stream (RemoteProcess); a node counts as ended only when all of its output is
printed. Ray's own log streaming is off for this job: it lagged, and a driver that ended at once lost
the nodes' last lines (the checkpoint and the command that resumes it).

Each node agent gets the driver's PYTHONPATH and its SHOAL_* variables (as sbatch passes on the submitting
shell's environment); everything else is the Ray node's own (GLOO_SOCKET_IFNAME, CUDA_VISIBLE_DEVICES as
Ray sets it for the actor's GPUs).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from shoal.errors import UserError, require
from shoal.launch.ports import free_port
from shoal.launch.supervisor import Child, Supervisor, exit_code, kill_tree

FAIL_GRACE_S = 30.0
KILL_AFTER_S = 15.0
REACH_TIMEOUT_S = 10.0  # to connect to the head's port
OUTPUT_EVERY_S = 0.2  # how often the driver fetches each node's new output
MARK = ".shoal-ray-"  # + a token: the mark file of the shared-directory check
PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when the thread that started it ends


def run(command: list[str], address: str, nnodes: int | None, nproc: int | None, shared: list[Path],
        env: dict[str, str], timeout_s: float) -> int:
    """Run `shoal <command>` (`train ...` or `run ...`, without node flags) as one node per Ray node of the
    cluster at `address`; `shared`: the directories every node must see (the working directory first).
    Returns the worst node's exit code."""
    ray = require("ray", "ray", "shoal --ray")
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    _connect(ray, address)
    pg, agents = None, []
    try:
        bundle, nnodes, nproc = _bundles(ray, address, nnodes, nproc)
        pg = placement_group([bundle] * nnodes, strategy="STRICT_SPREAD")
        _wait_placed(ray, pg, address, bundle, nnodes, timeout_s)
        actor = ray.remote(NodeAgent)
        agents = [actor.options(max_concurrency=2, num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, i)).remote()
                  for i in range(nnodes)]
        addresses = ray.get([a.address.remote() for a in agents])
        _check_shared(ray, agents, addresses, [str(p) for p in shared])
        endpoint = ray.get(agents[0].endpoint.remote())
        print(f"shoal: {nnodes} nodes on the Ray cluster at {address} ({', '.join(addresses)}), {nproc} "
              f"worker{'s' * (nproc != 1)} each; node 0's rendezvous at {endpoint}", file=sys.stderr, flush=True)
        children = [Child(f"node {i} ({ip})", [command[0], "--nnodes", str(nnodes), "--node-rank", str(i),
                                               "--rdzv-endpoint", endpoint, "--nproc", str(nproc), *command[1:]],
                          env={**env, "PYTHONUNBUFFERED": "1"})
                    for i, ip in enumerate(addresses)]
        cwd = str(shared[0])
        return Supervisor("shoal ray", grace_s=FAIL_GRACE_S, kill_after_s=KILL_AFTER_S).run(
            children, start=lambda i, child: RemoteProcess(ray, agents[i], child, cwd, f"[node {i}]"))
    finally:
        _release(ray, agents, pg)


def _wait_placed(ray, pg, address: str, bundle: dict, nnodes: int, timeout_s: float) -> None:
    if not ray.wait([pg.ready()], timeout=timeout_s)[0]:
        raise UserError(f"--ray {address}: {nnodes} Ray nodes with {_describe(bundle)} free each were not free "
                        f"within {timeout_s:g} s (other work holds them: `ray status` shows it; --rdzv-timeout "
                        f"waits longer)")


def _release(ray, agents: list, pg) -> None:
    from ray.util.placement_group import remove_placement_group

    for a in agents:
        with contextlib.suppress(Exception):
            ray.kill(a)
    if pg is not None:
        with contextlib.suppress(Exception):
            remove_placement_group(pg)
    ray.shutdown()


def without_ray(argv: list[str], address: str) -> list[str]:
    """The command line without --ray and its address (--ray ADDRESS, --ray=ADDRESS, or --ray alone)."""
    out, i = [], 0
    while i < len(argv):
        flag = argv[i].split("=", 1)[0]
        if flag in ("--ra", "--ray"):  # argparse takes a unique prefix too
            i += 1 if "=" in argv[i] or i + 1 == len(argv) or argv[i + 1] != address else 2
            continue
        out.append(argv[i])
        i += 1
    return out


def launch_args(args) -> int | None:
    """What `--ray` takes from the command's flags, checked: the address, and --nnodes (one number, or none:
    every node). --node-rank and --rdzv-endpoint are its to set, and --cluster places nodes too."""
    address = args.ray
    if address.endswith(".toml") or Path(address).is_file():
        raise UserError(f"--ray took {address!r} as the Ray cluster's address: put the config before --ray "
                        f"(shoal train cfg.toml --ray), or give the address (--ray auto, --ray HEAD:6379)")
    if args.node_rank is not None or args.rdzv_endpoint:
        raise UserError("--ray sets --node-rank and --rdzv-endpoint for each node; leave them out")
    if args.cluster:
        raise UserError("--cluster and --ray both place the nodes: give one")
    if args.nnodes is None:
        return None
    if not args.nnodes.isdigit() or int(args.nnodes) < 1:
        raise UserError(f"--nnodes {args.nnodes}: --ray takes a fixed number of nodes (its nodes are placed once)")
    return int(args.nnodes)


def node_env() -> dict[str, str]:
    """What the driver passes on to every node agent: its PYTHONPATH and its SHOAL_* variables."""
    return {k: v for k, v in os.environ.items() if k == "PYTHONPATH" or k.startswith("SHOAL_")}


def _connect(ray, address: str) -> None:
    import logging

    _check_reachable(address)
    try:
        # the nodes' output comes through the actors (RemoteProcess), not Ray's log streaming
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    except ConnectionError as e:
        why = str(e).splitlines()[0].split(". ")[0][:120]
        raise UserError(f"--ray {address}: no Ray cluster reached ({why}): start one with "
                        f"`ray start --head` (and `ray start --address HEAD:6379` on each other node), or give "
                        f"its address, e.g. --ray 10.0.0.1:6379") from None


def _check_reachable(address: str) -> None:
    """A head's HOST:PORT that nothing answers on is one line: ray.init retried such an address without end
    (measured with Ray 2.60: 127.0.0.1 on a closed port, still waiting after 10 minutes)."""
    host, _, port = address.rpartition(":")
    if address == "auto" or "://" in address or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=REACH_TIMEOUT_S).close()
    except OSError as e:
        raise UserError(f"--ray {address}: nothing answers there ({e.strerror or e}): give the head's address as "
                        f"`ray start --head` printed it (port 6379 by default), or --ray auto on a Ray node") from None


def _bundles(ray, address: str, nnodes: int | None, nproc: int | None) -> tuple[dict, int, int]:
    """Each node's bundle, the number of nodes and the workers per node: --nnodes default every Ray node
    the bundle fits on; --nproc default 1, or the fewest GPUs of a GPU node when the cluster has GPUs."""
    alive = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    gpus = sorted(int(r["GPU"]) for r in alive if r.get("GPU", 0) >= 1)
    nproc = nproc or (gpus[0] if gpus else 1)
    bundle = {"CPU": float(nproc), **({"GPU": float(nproc)} if gpus else {})}
    fits = sum(all(r.get(k, 0) >= v for k, v in bundle.items()) for r in alive)
    nnodes = nnodes or fits
    if not nnodes or fits < nnodes:
        raise UserError(f"--ray {address}: {nnodes or 'one or more'} nodes of {_describe(bundle)} each were asked for, "
                        f"one per Ray node (STRICT_SPREAD), but {fits} of the cluster's {len(alive)} alive nodes "
                        f"have that much: give a smaller --nnodes or --nproc, or add nodes (`ray start --address`)")
    return bundle, nnodes, nproc


def _describe(bundle: dict) -> str:
    return " and ".join(f"{v:g} {k}" for k, v in bundle.items())


def _check_shared(ray, agents, addresses: list[str], paths: list[str]) -> None:
    """Node 0 writes a mark file in each of `paths`; every other node must see it there."""
    token = uuid.uuid4().hex
    problem = ray.get(agents[0].mark.remote(paths, token))
    if problem:
        raise UserError(f"--ray: node 0 ({addresses[0]}) {problem}: the working directory and the run dir must be "
                        f"on a filesystem every Ray node shares")
    try:
        unseen = ray.get([a.unseen.remote(paths, token) for a in agents[1:]])
    finally:
        agents[0].unmark.remote(paths, token)
    for ip, missing in zip(addresses[1:], unseen, strict=True):
        if missing:
            raise UserError(f"--ray: the Ray node {ip} does not see {missing} as node 0 ({addresses[0]}) does: the "
                            f"working directory and the run dir must be on a filesystem every Ray node shares (NFS, "
                            f"a cluster's home); run from there, or give --run-dir there")


class RemoteProcess:
    """A node agent started by its actor, as the supervisor sees a process (launch/supervisor.Process). Its
    output is fetched from the actor and printed here, each line after `[node i]`, on the stream it was
    written to; all of it before the node counts as ended (Ray's own log streaming lags: a driver that
    left at once lost the nodes' last lines)."""

    def __init__(self, ray, agent, child: Child, cwd: str, label: str):
        self.ray, self.agent, self.name, self.label = ray, agent, child.name, label
        self.ref = agent.run.remote(child.argv, child.env, cwd)
        self.returncode: int | None = None
        self.seen, self.fetched_at = 0, 0.0

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        done = bool(self.ray.wait([self.ref], timeout=0)[0])
        if done or time.monotonic() - self.fetched_at > OUTPUT_EVERY_S:
            self._print_output()
        if done:
            try:
                self.returncode = self.ray.get(self.ref)
            except self.ray.exceptions.RayError as e:  # its actor or its node died
                print(f"shoal ray: {self.name}: its actor ended ({str(e).strip().splitlines()[0][:160]})",
                      file=sys.stderr, flush=True)
                self.returncode = -signal.SIGKILL
        return self.returncode

    def _print_output(self) -> None:
        self.fetched_at = time.monotonic()
        try:
            lines = self.ray.get(self.agent.output.remote(self.seen), timeout=10)
        except self.ray.exceptions.RayError:
            return
        self.seen += len(lines)
        for to_stderr, line in lines:
            print(f"{self.label} {line}", end="", file=sys.stderr if to_stderr else sys.stdout, flush=True)

    def signal(self, signum: int) -> None:
        self.agent.signal.remote(signum)

    def kill(self) -> None:
        self.agent.kill.remote()

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(0.1)
        return self.returncode


class NodeAgent:
    """The actor on one Ray node (a threaded actor: `signal` and `kill` come while `run` waits)."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.pending: int | None = None  # a signal that came before the node agent started
        self.lock = threading.Lock()
        self.lines: list[tuple[bool, str]] = []  # (written to stderr, the line) in the order read

    def address(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def endpoint(self) -> str:
        ip = self.address()
        return f"{ip}:{free_port(ip)}"

    def mark(self, paths: list[str], token: str) -> str | None:
        for p in paths:
            try:
                Path(p).mkdir(parents=True, exist_ok=True)
                (Path(p) / f"{MARK}{token}").touch()
            except OSError as e:
                return f"cannot write in {p} ({e.strerror})"
        return None

    def unseen(self, paths: list[str], token: str) -> str | None:
        return next((p for p in paths if not (Path(p) / f"{MARK}{token}").exists()), None)

    def unmark(self, paths: list[str], token: str) -> None:
        for p in paths:
            with contextlib.suppress(OSError):
                (Path(p) / f"{MARK}{token}").unlink()

    def run(self, argv: list[str], env: dict[str, str], cwd: str) -> int:
        with self.lock:
            if self.pending is not None:
                return exit_code(-self.pending)
            self.proc = subprocess.Popen([sys.executable, "-m", "shoal", *argv], cwd=cwd, env={**os.environ, **env},
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
                                         start_new_session=True, preexec_fn=_end_with_parent)
        readers = [threading.Thread(target=self._read, args=(stream, to_stderr), daemon=True)
                   for stream, to_stderr in ((self.proc.stdout, False), (self.proc.stderr, True))]
        for r in readers:
            r.start()
        code = self.proc.wait()
        for r in readers:
            r.join()
        return exit_code(code)

    def _read(self, stream, to_stderr: bool) -> None:
        for line in stream:
            with self.lock:
                self.lines.append((to_stderr, line))

    def output(self, since: int) -> list[tuple[bool, str]]:
        with self.lock:
            return self.lines[since:]

    def signal(self, signum: int) -> None:
        with self.lock:
            if self.proc is None:
                self.pending = signum
            elif self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signum)

    def kill(self) -> None:
        with self.lock:
            if self.proc is not None and self.proc.poll() is None:
                kill_tree(self.proc.pid)


def _end_with_parent() -> None:
    """In the node agent before exec: SIGTERM when its actor ends (Ray kills the actors of a driver that
    died; the agent, in a session of its own, would otherwise train on alone)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
