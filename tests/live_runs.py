"""What the live elastic tests share: the run (RUN, one-worker nodes on loopback at --nnodes 2:3), how to
start, watch and end its nodes, and one process's weights to compare a story's run with."""

import contextlib
import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import FIXTURES, ROOT, TINY_GPT, read_weights, train_in_process
from shoal.launch.supervisor import descendants
from shoal.training.flags import LEAVE_GRACE_S

# the tests' tiny GPT as a user model that a test can hold at its next forward (tests/fixtures/gate.py); the
# global batch splits evenly over 2 and 3 ranks (micro-batches of 4 rather than 2: half the forwards, half
# the time of every live test, as the cost of a step here is per forward). 40 steps: every story makes its
# changes by about step 20 (the cancel story's came at step 21 at the latest in 8 runs beside a busy core),
# and holds the workers at the gate where it must act before a given step. A line every step: the tests watch
# progress.json to act at a step, and it is written with each logged line
GLOBAL, MICRO = 48, 4
RUN = [*TINY_GPT, "--set", 'model.name="gate:build"', "--set", "train.steps=40", "--set",
       f"train.global_batch_size={GLOBAL}", "--set", f"train.micro_batch_size={MICRO}", "--set", "train.val_interval=0", "--set", "checkpoint.interval=50",
       "--set", "metrics.log_interval=1"]


def progress(run_dir) -> int:
    try:
        return json.loads((run_dir / "progress.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return 0


def world(run_dir) -> int:
    """The world size of the run's last step (progress.json), 0 before its first."""
    try:
        return json.loads((run_dir / "progress.json").read_text())["world"]
    except (OSError, ValueError, KeyError):
        return 0


def membership(run_dir) -> list[dict]:
    """The run's membership changes as metrics.jsonl logged them (one line each), without the joins that
    only complete its first generation (`story`)."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    changes = [m for m in map(json.loads, filter(None, lines)) if "membership" in m]
    return story(changes, lambda m: "joined" in m["membership"] and "left" not in m["membership"])


def changes(run_dir) -> list[dict]:
    """The run's membership changes as summary.json records them (who left, why, who joined), without the
    joins that only complete its first generation (`story`)."""
    events = json.loads((run_dir / "summary.json").read_text())["membership"]
    return story(events, lambda e: e["joined"] and not e["left"])


def story(changes: list, only_joins) -> list:
    """`changes` from the first one a test made: a node whose worker started more than the last call (2 s)
    after the others, as one does on a loaded machine, joins at the first step's end, before any."""
    while changes and only_joins(changes[0]):
        changes = changes[1:]
    return changes


def wait_for(what, until, timeout: float, nodes) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        if time.monotonic() > deadline:
            fail_with_stacks(f"{what} did not happen within {timeout} s", nodes)
        time.sleep(0.05)


def outputs(nodes, timeout: float) -> list[str]:
    """Each node's whole output once all have ended, within `timeout` s in all; past it the test fails with
    every node's output and its workers' stacks (a node waiting on the others says nothing of why)."""
    deadline, outs = time.monotonic() + timeout, []
    for p in nodes:
        try:
            outs.append(p.communicate(timeout=max(deadline - time.monotonic(), 0.1))[0])
        except subprocess.TimeoutExpired:
            fail_with_stacks(f"the nodes did not end within {timeout} s", nodes)
    return outs


def fail_with_stacks(why: str, nodes) -> None:
    for p in nodes:  # each worker's stacks (faulthandler), then the nodes' whole output
        for pid in descendants(p.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)
    time.sleep(1)
    end_all(nodes)
    outs = "\n".join(f"--- node {i} (exit {p.wait()})\n{p.communicate()[0]}" for i, p in enumerate(nodes))
    pytest.fail(f"{why}\n{outs}")


def held_after(gate: Path, step: int, world: int = 3, run: list[str] = RUN) -> dict:
    """The environment of nodes of `run` at `world` whose workers hold themselves at the gate after `step`
    steps (tests/fixtures/gate.py): a test acts at a known point of the run, however late it looks (a
    loaded machine once ran a short run to its end between two looks at its progress)."""
    sets = dict(a.split("=", 1) for a in run if "=" in a and not a.startswith("model.name"))
    forwards = int(sets["train.global_batch_size"]) // (int(sets["train.micro_batch_size"]) * world)  # per step, rank
    return {"SHOAL_TEST_GATE": str(gate), "SHOAL_TEST_HOLD_AT": str(step * forwards + 1)}


def stop_reached(gate: Path, workers: int, timeout: float = 60) -> None:
    """Wait until `workers` workers held at `gate` have been asked to stop (tests/fixtures/gate.py writes
    `<gate>.stop.<pid>` once a held worker's SIGTERM handler has run)."""
    deadline = time.monotonic() + timeout
    while len(list(gate.parent.glob(f"{gate.name}.stop.*"))) < workers:
        if time.monotonic() > deadline:
            pytest.fail(f"the stop did not reach {workers} held workers within {timeout} s")
        time.sleep(0.05)


def release(gate: Path) -> None:
    """Open the gate for good: a hold at a set forward (held_after) will not close it again."""
    gate.with_name(gate.name + ".released").touch()
    gate.unlink()


def leave_while_held(node: subprocess.Popen, gate: Path) -> None:
    """Ask `node` to stop (SIGTERM) while the workers wait at the gate until the request is old enough to
    count (LEAVE_GRACE_S): the others would otherwise finish a short or fast run before the node leaves."""
    asked = len(list(gate.parent.glob(f"{gate.name}.stop.*")))
    gate.touch()
    node.send_signal(signal.SIGTERM)
    # the request's age counts from when the worker took it, which the node passes the signal on to: timed from
    # the send instead, four pytest workers on two cores delayed the worker's handler enough that the held step's
    # flags found the request younger than the grace, and the node left a round late
    stop_reached(gate, asked + 1)
    time.sleep(LEAVE_GRACE_S + 0.5)
    release(gate)


def start_node(i: int, run_dir, port: int, max_restarts: int, run: list[str] = RUN,
               env: dict | None = None, host: str | None = None, address: str = "127.0.0.1") -> subprocess.Popen:
    """Node `i` of a live run of `run` on 2 to 3 one-worker nodes, its own session (signalled whole); the
    test fixtures importable (a user model of tests/fixtures); `env`: more environment. `host`: a host of
    `shoal cluster` to run in (its network namespace), node 0's at `address`."""
    inside = ["ip", "netns", "exec", f"shoal-{host}"] if host else []  # exec's the command: the pid is the node's
    return subprocess.Popen([*inside, sys.executable, "-m", "shoal", "train", *run, "--run-dir", str(run_dir),
                             "--nnodes", "2:3", "--nproc", "1", "--rdzv-endpoint", f"{address}:{port}",
                             "--node-rank", str(i), "--max-restarts", str(max_restarts)],
                            cwd=ROOT, env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1",
                                           "PYTHONPATH": f"{FIXTURES}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"},
                            stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def end_all(nodes) -> None:
    for p in nodes:
        if p.poll() is None:
            for pid in [p.pid, *descendants(p.pid)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def one_process(shared: Path, run: list[str] = RUN) -> dict:
    """The final weights of `run` trained by one process: the reference of a story. Trained once per test
    session in `shared` (conftest's shared_dir), by the first pytest worker that asks; the
    others wait on the lock and read the same weights."""
    reference = shared / f"live-one-process-{hashlib.sha1(' '.join(run).encode()).hexdigest()[:12]}"
    with open(f"{reference}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (reference / "model.safetensors").is_file():
            sys.path.insert(0, str(FIXTURES))  # the run's user model
            try:
                train_in_process([a for a in run if a != "--set"], reference)
            finally:
                sys.path.remove(str(FIXTURES))
    return read_weights(reference)


def equals_one_process(run_dir: Path, shared: Path, run: list[str] = RUN) -> None:
    got, want = read_weights(run_dir), one_process(shared, run)
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst <= 1e-5, f"live run differs from one process by {worst}"


def gloo_loops(pid: int) -> int:
    """How many gloo event-loop threads (one per live gloo device) process `pid` runs."""
    names = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/comm") as f:
            names.append(f.read().strip())
    return names.count("gloo_tcp_loop")


def node_of_rank(nodes, rank: int) -> int:
    """Which of `nodes` (one worker each) runs the worker of rank `rank` now (worker.name_process names it)."""
    for i, p in enumerate(nodes):
        with open(f"/proc/{worker_of(p)}/comm") as f:
            if f.read().strip() == f"shoal rank {rank}":
                return i
    raise AssertionError(f"no node runs rank {rank}")


def worker_of(node: subprocess.Popen) -> int:
    """The pid of the one worker a node's launcher runs."""
    for pid in descendants(node.pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().split(b"\0")
        if b"shoal" in cmd and b"--nnodes" not in cmd:
            return pid
    raise AssertionError("the node runs no worker")
