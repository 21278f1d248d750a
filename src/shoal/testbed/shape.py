"""The limits of a host: its link's rate and delay (tc), its share of the CPU (a cgroup).

Rate: a token bucket (tbf) on both ends of each host's veth pair, the host's own end (what it sends)
and the bridge's end (what it receives), so a host's link is limited in each direction as a switch
port is. Delay: netem, if the kernel has it (it is a module, sch_netem, that many small kernels leave
out; this machine's kernel answers "Specified qdisc kind is unknown"), so it is probed on a scratch
namespace before anything is made. CPU: a cgroup v1 cpu group per host whose CFS quota is the host's
share of one core (cpu.cfs_quota_us / cpu.cfs_period_us); every process started on the host is placed
in it.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

from shoal.errors import UserError
from shoal.testbed.system import sh

CPU_ROOT = Path("/sys/fs/cgroup/cpu")  # the cgroup v1 cpu controller
CPU_GROUP = "shoal-cluster"  # the parent group of every host's group
# a host with half a core should be a slower host, not one that stops: under the kernel's default
# 100 ms period a half-core host runs at full speed for 50 ms and then stops for 50, longer than a
# training step, so a step's compute reads anywhere from full to a third of the speed. Over 10 ms it
# runs 5 and stops 5, and a step's end still moves by up to 5 ms (dp 2 balanced across a full and a
# half-core host: 1.11-1.18 of the ideal step; over 5 ms, 1.08-1.09, the full-core host ~5% slower
# for its own quota accounting; over 2 ms that host lost ~18%)
CFS_PERIOD_US = 5_000
MIN_QUOTA_US = 1_000  # the kernel refuses a smaller quota (EINVAL): a small share gets a longer period
PROBE_NETNS = "shoal-probe"

_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
_DELAY_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def parse_rate(text: str) -> int:
    """--rate as bits per second: a number and bit, kbit, mbit or gbit (tc's units), e.g. 100mbit."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]+)\s*", text.lower())
    if not m or m.group(2) not in _RATE_UNITS or float(m.group(1)) <= 0:
        raise UserError(f"--rate {text!r}: expected a number and kbit, mbit or gbit (bits per second), "
                        f"for example --rate 100mbit")
    bits = round(float(m.group(1)) * _RATE_UNITS[m.group(2)])
    if bits < 8000:
        raise UserError(f"--rate {text}: at least 8kbit")
    return bits


def parse_delay(text: str) -> float:
    """--delay in seconds: a number and us, ms or s, e.g. 20ms."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]+)\s*", text.lower())
    if not m or m.group(2) not in _DELAY_UNITS:
        raise UserError(f"--delay {text!r}: expected a number and us, ms or s, for example --delay 20ms")
    return float(m.group(1)) * _DELAY_UNITS[m.group(2)]


def parse_cpu(text: str, hosts: int) -> list[float]:
    """--cpu as each host's share of one core: one value per host (1,0.5) or one for all."""
    try:
        shares = [float(x) for x in text.split(",")]
    except ValueError:
        raise UserError(f"--cpu {text!r}: expected each host's share of a core, for example --cpu 1,0.5") from None
    if len(shares) == 1:
        shares *= hosts
    if len(shares) != hosts:
        raise UserError(f"--cpu {text}: {len(shares)} shares for --hosts {hosts}; give one share of a core per "
                        f"host (or one for all), for example --cpu {','.join(['1'] * hosts)}")
    if min(shares) < 0.01:
        raise UserError(f"--cpu {text}: each share must be at least 0.01 of a core")
    return shares


def describe_rate(bits: int) -> str:
    for unit, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits >= scale:
            return f"{bits / scale:g}{unit}"
    return f"{bits}bit"


def netem_available() -> tuple[bool, str]:
    """Whether this kernel has netem, tried on the loopback device of a scratch namespace; the answer."""
    sh("ip", "netns", "delete", PROBE_NETNS, check=False)
    sh("ip", "netns", "add", PROBE_NETNS)
    try:
        proc = sh("tc", "-n", PROBE_NETNS, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms", check=False)
        return proc.returncode == 0, (proc.stderr.strip().splitlines() or [""])[0]
    finally:
        sh("ip", "netns", "delete", PROBE_NETNS, check=False)


def shape_link(netns: str | None, dev: str, rate_bits: int | None, delay_s: float | None) -> None:
    """Limit what `dev` sends (in namespace `netns`, or the root one): netem delay, then tbf rate."""
    tc = ["tc", *(["-n", netns] if netns else []), "qdisc", "add", "dev", dev]
    tbf = []
    if rate_bits:
        rate_bytes = rate_bits // 8
        burst = max(64 * 1024, rate_bytes // 100)  # at least 10 ms of traffic: tbf needs rate / HZ
        tbf = ["tbf", "rate", f"{rate_bits}bit", "burst", str(burst), "latency", "50ms"]
    if delay_s:
        # a queue long enough for twice the packets in flight during the delay at the rate
        limit = max(1000, 2 * int((rate_bits or 10**10) / 8 * delay_s / 1500))
        sh(*tc, "root", "handle", "1:", "netem", "delay", f"{delay_s * 1e6:.0f}us", "limit", str(limit))
        if tbf:
            sh(*tc, "parent", "1:1", "handle", "10:", *tbf)
    elif tbf:
        sh(*tc, "root", *tbf)


def require_cpu_controller() -> None:
    if not (CPU_ROOT / "cpu.cfs_quota_us").exists():
        raise UserError(f"--cpu needs the cgroup v1 cpu controller mounted at {CPU_ROOT} (cpu.cfs_quota_us), which "
                        f"this machine does not have: leave --cpu out")


def make_cpu_group(host: str, share: float) -> Path:
    """A cgroup that caps its processes at `share` of one core; returns its folder."""
    require_cpu_controller()
    group = CPU_ROOT / CPU_GROUP / host
    group.mkdir(parents=True, exist_ok=True)
    period = cfs_period_us(share)
    (group / "cpu.cfs_period_us").write_text(str(period))
    (group / "cpu.cfs_quota_us").write_text(str(round(share * period)))
    return group


def cfs_period_us(share: float) -> int:
    """The CFS period for `share` of a core: CFS_PERIOD_US, longer where the quota would be below the
    kernel's 1 ms minimum."""
    return max(CFS_PERIOD_US, math.ceil(MIN_QUOTA_US / share))


def join_cpu_group(group: str) -> None:
    """Move the calling process into `group` (its children follow): call between fork and exec."""
    (Path(group) / "cgroup.procs").write_text(str(os.getpid()))


def cpu_groups() -> list[Path]:
    """The host groups that exist now, and their parent last."""
    parent = CPU_ROOT / CPU_GROUP
    if not parent.is_dir():
        return []
    return [*sorted(p for p in parent.iterdir() if p.is_dir()), parent]


def group_pids(group: Path) -> list[int]:
    try:
        return [int(x) for x in (group / "cgroup.procs").read_text().split()]
    except OSError:
        return []
