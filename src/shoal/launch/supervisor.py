"""The one supervisor of the process trees shoal starts beside torch elastic's: several children run as
one job, signals reach all of them, and the worst exit code wins.

Used for the asynchronous parameter server's roles (ps/roles.py: the servers' job and one job per
worker), for the hosts of the one-machine testbed (testbed/nodes.py: a node agent per host) and for the
nodes of a Ray cluster (launch/ray_nodes.py: a node agent per Ray node, started by an actor there). Each
child is, or runs, a torch elastic agent, which restarts its own workers (`--max-restarts`), so
restarts stay with the engine; what this adds is the job of several agents:

  start      every child in a session of its own (its process group is its tree: a signal to the
             group reaches the agent and the workers it spawned)
  signals    SIGINT and SIGTERM received here are passed on to every child still running
  failure    a required child that fails: after `grace_s` (the others often end on their own, their
             agents seeing lost peers) the rest are stopped with SIGTERM, and `kill_after_s` later
             with SIGKILL; a child that is not required and fails is named in one line and the job
             goes on without it
  done       once every required child has ended well, children still running are not needed: their
             whole trees are killed (stopped first, so that no agent starts a new worker meanwhile)
  exit code  the worst of the required children's, not counting those stopped here; a child killed by
             signal N counts as 128 + N, as a shell says
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str] | None = None
    required: bool = True  # its failure fails the job, and the job is done when every required child is
    preexec_fn: Callable[[], None] | None = None  # runs in the child before exec (e.g. joining a cgroup)


class Process(Protocol):
    """What the supervisor needs of a started child, wherever it runs."""

    returncode: int | None  # as Popen's: negative when a signal ended it

    def poll(self) -> int | None: ...

    def signal(self, signum: int) -> None: ...  # to its whole tree

    def kill(self) -> None: ...  # its whole tree, at once

    def wait(self) -> int: ...


class LocalProcess:
    """A child on this machine, in a session of its own: its process group is its tree (a signal to the
    group reaches the agent and the workers it spawned)."""

    def __init__(self, popen: subprocess.Popen):
        self.popen = popen

    @classmethod
    def start(cls, _index: int, child: Child) -> LocalProcess:
        return cls(subprocess.Popen(child.argv, env=child.env, start_new_session=True, preexec_fn=child.preexec_fn))

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def poll(self) -> int | None:
        return self.popen.poll()

    def signal(self, signum: int) -> None:
        _signal_group(self.popen.pid, signum)

    def kill(self) -> None:
        kill_tree(self.popen.pid)

    def wait(self) -> int:
        return self.popen.wait()


class Supervisor:
    def __init__(self, label: str, grace_s: float, kill_after_s: float = 15.0):
        """`label`: how its lines begin ("shoal", "shoal cluster")."""
        self.label, self.grace_s, self.kill_after_s = label, grace_s, kill_after_s

    def run(self, children: list[Child], start: Callable[[int, Child], Process] | None = None) -> int:
        """Start `children` and wait until every one has ended; returns the job's exit code. `start(i, child)`
        starts one elsewhere (default: a local process in a session of its own, LocalProcess)."""
        procs = [(start or LocalProcess.start)(i, c) for i, c in enumerate(children)]

        def forward(signum, _frame=None) -> None:
            for p in procs:
                if p.poll() is None:
                    p.signal(signum)

        old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            stopped = self._wait(children, procs, forward)
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        return max((exit_code(p.returncode) for i, (c, p) in enumerate(zip(children, procs, strict=True))
                    if c.required and i not in stopped), default=0)

    def _wait(self, children: list[Child], procs: list[Process], forward) -> set[int]:
        """Poll until every child has ended, acting on failures and completion; returns the indices of
        the children stopped here (their exit codes say nothing new)."""
        failed_at = stopped_at = None
        stopped: set[int] = set()
        named: set[int] = set()
        while [p.poll() for p in procs].count(None):  # every one polled: a list, not a short-circuit
            now = time.monotonic()
            for i, (c, p) in enumerate(zip(children, procs, strict=True)):
                if p.returncode and not c.required and i not in named and i not in stopped:
                    named.add(i)
                    print(f"{self.label}: {c.name} failed for good (exit code {exit_code(p.returncode)}); the run "
                          f"goes on without it", file=sys.stderr, flush=True)
            bad = next((i for i, (c, p) in enumerate(zip(children, procs, strict=True))
                        if c.required and p.returncode and i not in stopped), None)
            if failed_at is None and bad is not None:
                failed_at = now
            if failed_at is not None and stopped_at is None and now - failed_at >= self.grace_s:
                running = [i for i, p in enumerate(procs) if p.returncode is None]
                ago = f" {self.grace_s:g} s ago" if self.grace_s else ""
                print(f"{self.label}: {children[bad].name} failed (exit code {exit_code(procs[bad].returncode)}){ago}; "
                      f"stopping {', '.join(children[i].name for i in running)}", file=sys.stderr, flush=True)
                stopped |= set(running)
                forward(signal.SIGTERM)
                stopped_at = now
            if stopped_at is not None and now - stopped_at > self.kill_after_s:
                forward(signal.SIGKILL)
            if failed_at is None and all(p.returncode == 0 for c, p in zip(children, procs, strict=True)
                                         if c.required):
                for p in procs:  # the job is done: the rest are not needed
                    if p.returncode is None:
                        p.kill()
                for p in procs:
                    p.wait()
            time.sleep(0.1)
        return stopped


def exit_code(returncode: int) -> int:
    """A process's exit code as a shell reports it: 128 + N when signal N ended it."""
    return returncode if returncode >= 0 else 128 - returncode


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it, stopped first so that nothing new is started meanwhile."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGSTOP)
    for p in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children first found through /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _signal_group(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)
