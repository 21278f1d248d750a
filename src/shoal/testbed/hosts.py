"""The cluster: N hosts, each a network namespace with one link to a shared bridge.

Host i is namespace `shoal-h<i>`; its link is a veth pair, `eth0` inside the namespace (address
10.200.0.<i+1>/24, the first free /24 of 10.200-10.250.0.0 otherwise) and `shoal-b<i>` in the root
namespace, a port of the bridge `shoal-br0`. The bridge has no address: the hosts reach each other,
not the machine. What was made is written to a state file, so `status`, `run` and `down` know the
cluster; `down` also removes anything else carrying these names (a cluster whose `up` was cut short),
and `up` runs `down` first.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from shoal.errors import UserError
from shoal.testbed import ray, shape, slurm
from shoal.testbed.system import netns_exec, sh

STATE_FILE = Path("/run/shoal-cluster/state.json")
BRIDGE = "shoal-br0"
HOST_IF = "eth0"
NETNS_RE = re.compile(r"shoal-h\d+")
PORT_RE = re.compile(r"shoal-b\d+")
MAX_HOSTS = 250


@dataclass
class Host:
    name: str  # h0, h1, ...
    netns: str  # its network namespace
    ifname: str  # its interface, inside the namespace
    port: str  # the other end of its veth pair: a port of the bridge
    addr: str
    cpu: float | None = None  # share of one core; None: not capped
    cgroup: str | None = None


@dataclass
class Cluster:
    subnet: str
    bridge: str
    rate_bits: int | None = None
    delay_s: float | None = None
    hosts: list[Host] = field(default_factory=list)
    complete: bool = False  # False while `up` is making it

    def save(self) -> None:
        STATE_FILE.parent.mkdir(parents=True, exist_ok=True)
        tmp = STATE_FILE.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.replace(STATE_FILE)


def load() -> Cluster | None:
    """The cluster that is up, or None (no state file, or an `up` that did not finish)."""
    try:
        data = json.loads(STATE_FILE.read_text())
    except (OSError, ValueError):
        return None
    hosts = [Host(**h) for h in data.pop("hosts")]
    cluster = Cluster(**data, hosts=hosts)
    return cluster if cluster.complete else None


def require_up() -> Cluster:
    cluster = load()
    if cluster is None:
        raise UserError("no cluster is up: make one first with `shoal cluster up --hosts N`")
    missing = [h.netns for h in cluster.hosts if not Path(f"/run/netns/{h.netns}").exists()]
    if missing:
        raise UserError(f"the cluster is broken ({', '.join(missing)} gone): make it again with "
                        f"`shoal cluster up --hosts {len(cluster.hosts)}`")
    return cluster


def up(n: int, rate: str | None = None, delay: str | None = None, cpu: str | None = None) -> Cluster:
    """Make an n-host cluster (after removing any earlier one); returns it."""
    if not 1 <= n <= MAX_HOSTS:
        raise UserError(f"--hosts {n}: between 1 and {MAX_HOSTS}")
    rate_bits = shape.parse_rate(rate) if rate else None
    delay_s = shape.parse_delay(delay) if delay else None
    shares = shape.parse_cpu(cpu, n) if cpu else [None] * n
    if cpu:
        shape.require_cpu_controller()
    if delay_s:
        has_netem, answer = shape.netem_available()
        if not has_netem:
            raise UserError(f"--delay {delay}: this kernel has no netem qdisc (tc answers: {answer}); leave --delay "
                            f"out, or use a kernel with sch_netem (modprobe sch_netem)")
    removed = down()
    if removed:
        print(f"shoal cluster: removed the earlier cluster first ({', '.join(removed)})", file=sys.stderr)
    net = free_subnet()
    cluster = Cluster(subnet=str(net), bridge=BRIDGE, rate_bits=rate_bits, delay_s=delay_s)
    cluster.save()  # before anything is made: `down` finds a half-made cluster through it and by its names
    sh("ip", "link", "add", BRIDGE, "type", "bridge")
    sh("ip", "link", "set", BRIDGE, "up")
    addrs = list(net.hosts())
    for i in range(n):
        host = Host(name=f"h{i}", netns=f"shoal-h{i}", ifname=HOST_IF, port=f"shoal-b{i}", addr=str(addrs[i]),
                    cpu=shares[i])
        cluster.hosts.append(host)
        cluster.save()
        sh("ip", "netns", "add", host.netns)
        sh("ip", "link", "add", host.port, "type", "veth", "peer", "name", host.ifname, "netns", host.netns)
        sh("ip", "link", "set", host.port, "master", BRIDGE)
        sh("ip", "link", "set", host.port, "up")
        sh("ip", "-n", host.netns, "addr", "add", f"{host.addr}/{net.prefixlen}", "dev", host.ifname)
        sh("ip", "-n", host.netns, "link", "set", host.ifname, "up")
        sh("ip", "-n", host.netns, "link", "set", "lo", "up")
        if rate_bits or delay_s:
            half = delay_s / 2 if delay_s else None  # one way between two hosts: half on each host's link
            shape.shape_link(host.netns, host.ifname, rate_bits, half)  # what the host sends
            shape.shape_link(None, host.port, rate_bits, half)  # what it receives
        if host.cpu is not None:
            host.cgroup = str(shape.make_cpu_group(host.name, host.cpu))
    check_reachable(cluster)
    cluster.complete = True
    cluster.save()
    return cluster


def free_subnet() -> ipaddress.IPv4Network:
    """10.200.0.0/24, or the next 10.X.0.0/24 (X up to 250) that no address or route here overlaps."""
    used = []
    for line in sh("ip", "-o", "-4", "addr", "show").stdout.splitlines() + \
            sh("ip", "-4", "route", "show").stdout.splitlines():
        for word in line.split():
            try:
                used.append(ipaddress.ip_network(word, strict=False))
            except ValueError:
                continue
    for x in range(200, 251):
        net = ipaddress.ip_network(f"10.{x}.0.0/24")
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return net
    raise UserError("no free subnet among 10.200.0.0/24 .. 10.250.0.0/24 for the cluster's hosts")


def check_reachable(cluster: Cluster, timeout: float = 10.0) -> None:
    """Every host connects to host 0 over TCP (a bridge whose traffic a firewall drops is found here)."""
    if len(cluster.hosts) < 2:
        return
    h0 = cluster.hosts[0]
    port = 29399
    listener = subprocess.Popen(
        [*netns_exec(h0.netns), sys.executable, "-c",
         "import socket,sys\ns=socket.create_server((sys.argv[1], int(sys.argv[2])))\nprint('ready', flush=True)\n"
         "s.settimeout(float(sys.argv[4]))\n"
         "for _ in range(int(sys.argv[3])): s.accept()[0].close()", h0.addr, str(port), str(len(cluster.hosts) - 1),
         str(timeout)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if listener.stdout.readline().strip() != "ready":
            raise UserError(f"could not listen in {h0.netns}: {listener.communicate()[1].strip()[-200:]}")
        connect = ("import socket,sys\nsocket.create_connection((sys.argv[1], int(sys.argv[2])), "
                   "timeout=float(sys.argv[3])).close()")
        for host in cluster.hosts[1:]:
            proc = subprocess.run([*netns_exec(host.netns), sys.executable, "-c", connect, h0.addr, str(port),
                                   str(timeout)], capture_output=True, text=True)
            if proc.returncode != 0:
                why = (proc.stderr.strip().splitlines() or ["?"])[-1]
                raise UserError(f"host {host.name} ({host.addr}) cannot reach host h0 ({h0.addr}) across the bridge "
                                f"{BRIDGE}: {why}; a firewall filtering bridged traffic (net.bridge.bridge-nf-call-"
                                f"iptables = 1 with a DROP forward policy) does this")
        listener.wait(timeout=timeout)
    finally:
        if listener.poll() is None:
            listener.kill()
            listener.wait()


def down() -> list[str]:
    """Remove the cluster and anything else carrying its names; returns what was removed."""
    removed = []
    netns = [w.split()[0] for w in sh("ip", "netns", "list").stdout.splitlines() if w.strip()]
    ours = sorted((ns for ns in netns if NETNS_RE.fullmatch(ns)), key=lambda ns: int(ns[7:]))
    stop_processes(ours)
    for name in (ln.split(":")[1].strip().split("@")[0] for ln in sh("ip", "-o", "link", "show").stdout.splitlines()):
        if PORT_RE.fullmatch(name) or name == BRIDGE:  # deleting a veth end deletes its pair
            sh("ip", "link", "delete", name, check=False)
            if name == BRIDGE:
                removed.append(f"bridge {name}")
    for ns in ours:
        sh("ip", "netns", "delete", ns, check=False)
    if ours:
        removed.append(f"{len(ours)} namespace{'s' * (len(ours) != 1)} ({', '.join(ours)})")
    groups = shape.cpu_groups()
    for group in groups:
        for _ in range(50):
            try:
                group.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:  # processes still leaving it
                time.sleep(0.1)
    if groups:
        removed.append(f"{len(groups) - 1} cpu group{'s' * (len(groups) != 2)}")
    if slurm.down():  # its daemons ran in the namespaces: stopped above
        removed.append("Slurm's files")
    if ray.down():  # the same
        removed.append("Ray's files")
    if STATE_FILE.exists():
        STATE_FILE.unlink()
    return removed


def stop_processes(namespaces: list[str], grace: float = 5.0) -> None:
    """Stop what still runs on the hosts (SIGTERM, then SIGKILL after `grace` seconds)."""
    pids = {int(p) for ns in namespaces for p in sh("ip", "netns", "pids", ns, check=False).stdout.split()}
    pids |= {p for g in shape.cpu_groups() for p in shape.group_pids(g)}
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 0)):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + wait
        while pids and time.monotonic() < end:
            pids = {p for p in pids if Path(f"/proc/{p}").exists()}
            time.sleep(0.1)


def status_text(cluster: Cluster | None) -> str:
    if cluster is None:
        return "no cluster is up (make one with `shoal cluster up --hosts N`)"
    rate = shape.describe_rate(cluster.rate_bits) if cluster.rate_bits else "unlimited"
    delay = f"{cluster.delay_s * 1e3:g} ms" if cluster.delay_s else "none"
    lines = [f"cluster: {len(cluster.hosts)} hosts on bridge {cluster.bridge}, subnet {cluster.subnet}",
             f"{'host':<6}{'namespace':<12}{'interface':<11}{'address':<14}{'rate':<12}{'cpu':<10}"]
    for h in cluster.hosts:
        there = Path(f"/run/netns/{h.netns}").exists()
        cpu = f"{h.cpu:g} core" if h.cpu is not None else "unlimited"
        lines.append(f"{h.name:<6}{h.netns:<12}{h.ifname:<11}{h.addr:<14}{rate:<12}{cpu:<10}"
                     + ("" if there else "  MISSING: run `shoal cluster up` again"))
    lines.append(f"rate: each host's link, in each direction (tbf on its {HOST_IF} for what it sends and on its "
                 f"bridge port for what it receives); delay between two hosts: {delay}; cpu: cgroup cpu quota")
    if slurm.CONF.exists():
        lines.append(slurm.status_line(cluster))
    if ray.running():
        lines.append(ray.status_line(cluster))
    return "\n".join(lines)
