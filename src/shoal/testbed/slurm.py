"""A real Slurm on the cluster's hosts (`shoal cluster up --slurm`): the scheduler that job files are
submitted to, not an imitation of its environment.

Debian's slurm-wlm and munge, started by hand as a small site would: munged (its own key and socket
under SLURM_DIR), slurmctld on host 0, one slurmd per host (NodeName h<i>, NodeAddr its address: names
that do not resolve, as on clusters that declare NodeAddr), one partition `shoal` over them all. Every
daemon runs in the foreground inside a host's namespace (slurmd in the host's cpu group, so the tasks it
starts are capped as the host is), so `shoal cluster down` stops them with the hosts' other processes.
Client commands (sbatch, srun, squeue, scancel) run inside host 0 with SLURM_CONF set: `client()`.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
from pathlib import Path

from shoal.errors import UserError
from shoal.testbed import shape
from shoal.testbed.system import netns_exec, wait_up

SLURM_DIR = Path("/run/shoal-cluster/slurm")
CONF = SLURM_DIR / "slurm.conf"
PARTITION = "shoal"
DAEMONS = ("munged", "slurmctld", "slurmd", "sinfo")


def find(name: str) -> str | None:
    """A Slurm or munge program: on PATH, or in /usr/sbin (where Debian puts the daemons, off a user's PATH)."""
    return shutil.which(name) or (f"/usr/sbin/{name}" if Path(f"/usr/sbin/{name}").exists() else None)


def require_slurm() -> None:
    missing = [d for d in DAEMONS if find(d) is None]
    try:
        pwd.getpwnam("munge")  # munged runs as it; the package makes it
    except KeyError:
        missing.append("the user munge")
    if missing:
        raise UserError(f"--slurm needs Slurm and munge ({', '.join(missing)} not found): install them, e.g. "
                        f"apt-get install slurm-wlm munge")


def _exe(name: str) -> str:
    return find(name) or name


def conf_text(hosts, cpus: int) -> str:
    """slurm.conf for `hosts` (testbed.hosts.Host), each with `cpus` CPUs. The controller's name must be
    this machine's short hostname (every namespace shares it); only its address is host 0's."""
    d = SLURM_DIR
    lines = [
        "ClusterName=shoal",
        f"SlurmctldHost={socket.gethostname().split('.')[0]}({hosts[0].addr})",
        "SlurmUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={d / 'munge' / 'munge.socket'}",
        # no cgroup plugins: the hosts' cpu groups are the testbed's own (slurmd's tasks stay in its group)
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SchedulerType=sched/backfill",
        # heterogeneous jobs are started only by the backfill pass, every 30 s by default: a het job then
        # waited ~20 s on idle nodes
        "SchedulerParameters=bf_interval=1",
        "MpiDefault=none",
        "ReturnToService=2",
        f"StateSaveLocation={d / 'ctld'}",
        f"SlurmdSpoolDir={d / 'spool' / '%n'}",
        f"SlurmctldPidFile={d / 'slurmctld.pid'}",
        f"SlurmdPidFile={d / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={d / 'slurmctld.log'}",
        f"SlurmdLogFile={d / 'slurmd-%n.log'}",
        *(f"NodeName={h.name} NodeAddr={h.addr} CPUs={cpus} State=UNKNOWN" for h in hosts),
        f"PartitionName={PARTITION} Nodes={','.join(h.name for h in hosts)} Default=YES MaxTime=INFINITE State=UP",
    ]
    return "\n".join(lines) + "\n"


def up(cluster) -> None:
    """Start munge and Slurm on `cluster`'s hosts and wait until every node is idle."""
    require_slurm()
    if SLURM_DIR.exists():
        shutil.rmtree(SLURM_DIR)
    munge_dir = SLURM_DIR / "munge"
    for sub in ("ctld", "spool", "munge"):
        (SLURM_DIR / sub).mkdir(parents=True, mode=0o755)
    CONF.write_text(conf_text(cluster.hosts, os.cpu_count() or 1))
    # slurmd 22.05 cannot run without a cgroup.conf; v1 with automount is one it accepts here
    (SLURM_DIR / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupAutomount=yes\n")
    munge = pwd.getpwnam("munge")
    key = munge_dir / "munge.key"
    key.write_bytes(os.urandom(1024))  # this cluster's own key: munged wants it owned by munge, mode 0400
    key.chmod(0o400)
    for path in (munge_dir, key):
        os.chown(path, munge.pw_uid, munge.pw_gid)
    host0 = cluster.hosts[0]
    _start(host0.netns, ["runuser", "-u", "munge", "--", _exe("munged"), "--foreground", "--force",
                         f"--socket={munge_dir / 'munge.socket'}", f"--key-file={key}",
                         f"--log-file={munge_dir / 'munged.log'}", f"--pid-file={munge_dir / 'munged.pid'}",
                         f"--seed-file={munge_dir / 'munged.seed'}"], SLURM_DIR / "munged.out")
    wait_up("Slurm", lambda: (munge_dir / "munge.socket").exists(), "munged's socket", munge_dir / "munged.log")
    _start(host0.netns, [_exe("slurmctld"), "-D", "-f", str(CONF)], SLURM_DIR / "slurmctld.out")
    for host in cluster.hosts:
        join = (lambda g=host.cgroup: shape.join_cpu_group(g)) if host.cgroup else None
        _start(host.netns, [_exe("slurmd"), "-D", "-f", str(CONF), "-N", host.name], SLURM_DIR / f"{host.name}.out",
               join)
    wait_up("Slurm", lambda: _idle(cluster) == len(cluster.hosts), f"{len(cluster.hosts)} idle Slurm nodes",
          SLURM_DIR / "slurmctld.log")


def _start(netns: str, argv: list[str], out: Path, preexec_fn=None) -> None:
    with open(out, "w") as log:
        subprocess.Popen([*netns_exec(netns), *argv], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                         start_new_session=True, preexec_fn=preexec_fn)


def _idle(cluster) -> int:
    out = client(cluster, ["sinfo", "--noheader", "--Node", "--format=%T"], check=False)
    return sum(state.strip() == "idle" for state in out.stdout.split())


def client(cluster, argv: list[str], check: bool = True, timeout: float = 60, cwd=None,
           env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a Slurm client command (sbatch, srun, squeue, ...) on host 0; `env`: its environment (sbatch
    passes it on to the job), default this process's."""
    proc = subprocess.run([*netns_exec(cluster.hosts[0].netns), "env", f"SLURM_CONF={CONF}", *argv],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
    if check and proc.returncode != 0:
        raise UserError(f"`{' '.join(argv)}` failed: {(proc.stderr.strip() or proc.stdout.strip())[:300]}")
    return proc


def status_line(cluster) -> str:
    return (f"slurm: partition {PARTITION} over {', '.join(h.name for h in cluster.hosts)}, slurmctld on "
            f"{cluster.hosts[0].name}; its commands run there: ip netns exec {cluster.hosts[0].netns} env "
            f"SLURM_CONF={CONF} sbatch FILE")


def down() -> bool:
    """Remove Slurm's files (its daemons ran in the hosts' namespaces and were stopped with them)."""
    if not SLURM_DIR.exists():
        return False
    shutil.rmtree(SLURM_DIR, ignore_errors=True)
    return True
