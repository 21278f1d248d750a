"""A live elastic run (--nnodes MIN:MAX) of one-worker nodes on loopback, its weights compared with one
process's after each story:
- a worker dies at a random step (the survivors go on without restarting), a replacement heals from a
  live peer, and a node asked to stop (SIGTERM) leaves cleanly; `shoal report` shows each change;
- a whole node goes silent (SIGSTOP: its connections stay open), the last other worker dies with no
  replacement allowed (below MIN: the survivor waits), a new node joins, then every node is stopped (a
  job's cancel: a checkpoint, exit 143) and the same command resumes the run, elastic again, to its end."""

import contextlib
import html
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, TINY_GPT, read_weights, train_in_process
from shoal.cli import main
from shoal.launch.supervisor import descendants
from shoal.ps.roles import free_port

pytestmark = pytest.mark.timeout(240)

RUN = [*TINY_GPT, "--set", "train.steps=160", "--set", "train.global_batch_size=48", "--set",
       "train.micro_batch_size=2", "--set", "train.val_interval=0", "--set", "checkpoint.interval=50",
       "--set", "metrics.log_interval=20"]


def progress(run_dir) -> int:
    try:
        return json.loads((run_dir / "progress.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return 0


def membership(run_dir) -> list[dict]:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    return [m for m in map(json.loads, filter(None, lines)) if "membership" in m]


def wait_for(what, until, timeout: float, nodes) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        if time.monotonic() > deadline:
            for p in nodes:  # each worker's stacks (faulthandler), then the nodes' whole output
                for pid in descendants(p.pid):
                    os.kill(pid, signal.SIGUSR1)
            time.sleep(1)
            for p in nodes:
                for pid in [p.pid, *descendants(p.pid)]:
                    os.kill(pid, signal.SIGKILL)
            outs = "\n".join(f"--- node {i}\n{p.communicate()[0]}" for i, p in enumerate(nodes))
            pytest.fail(f"{what} did not happen within {timeout} s\n{outs}")
        time.sleep(0.05)


def start_node(i: int, run_dir, port: int, max_restarts: int) -> subprocess.Popen:
    """Node `i` of a live run of RUN on 2 to 3 one-worker nodes, its own session (signalled whole)."""
    return subprocess.Popen([sys.executable, "-m", "shoal", "train", *RUN, "--run-dir", str(run_dir),
                             "--nnodes", "2:3", "--nproc", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
                             "--node-rank", str(i), "--max-restarts", str(max_restarts)],
                            cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def end_all(nodes) -> None:
    for p in nodes:
        if p.poll() is None:
            for pid in [p.pid, *descendants(p.pid)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    """The final weights of RUN trained by one process: the reference of every story here."""
    reference = tmp_path_factory.mktemp("one")
    train_in_process([a for a in RUN if a != "--set"], reference)
    return read_weights(reference)


def equals_one_process(run_dir, want: dict) -> None:
    got = read_weights(run_dir)
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst <= 1e-5, f"live run differs from one process by {worst}"


def gloo_loops(pid: int) -> int:
    """How many gloo event-loop threads (one per live gloo device) process `pid` runs."""
    names = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/comm") as f:
            names.append(f.read().strip())
    return names.count("gloo_tcp_loop")


def worker_of(node: subprocess.Popen) -> int:
    """The pid of the one worker a node's launcher runs."""
    for pid in descendants(node.pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().split(b"\0")
        if b"shoal" in cmd and b"--nnodes" not in cmd:
            return pid
    raise AssertionError("the node runs no worker")


def test_a_worker_killed_rejoined_and_a_node_leaving_equal_one_process(tmp_path, one_process):
    run_dir, port = tmp_path / "live", free_port()
    rng = random.Random()
    kill_at = rng.randrange(10, 40)
    print(f"killing node 1's worker after step {kill_at}")
    nodes = [start_node(i, run_dir, port, max_restarts=1) for i in range(3)]
    try:
        wait_for(f"step {kill_at}", lambda: progress(run_dir) >= kill_at, 120, nodes)
        loops = gloo_loops(worker_of(nodes[0]))
        os.kill(worker_of(nodes[1]), signal.SIGKILL)
        # the survivors go on without it, and its replacement joins: one change or two (the survivors may
        # take longer to give up on the dead worker than the replacement takes to start)
        wait_for("the replacement's join", lambda: any("joined" in m["membership"] for m in membership(run_dir)),
                 120, nodes)
        # each ended generation's groups were freed: a survivor runs no more gloo event loops than at the
        # start (a mesh kept across generations once kept them all, and their loops spun on cut sockets)
        assert gloo_loops(worker_of(nodes[0])) == loops
        nodes[2].send_signal(signal.SIGTERM)  # node 2 leaves; the others finish the run
        outs = [p.communicate(timeout=120)[0] for p in nodes]
    finally:
        end_all(nodes)
    codes = [p.returncode for p in nodes]
    assert codes == [0, 0, 128 + signal.SIGTERM], "\n".join(outs)
    summary = json.loads((run_dir / "summary.json").read_text())
    events = summary["membership"]
    *shrink_and_join, leave = events
    assert [e["world"] for e in shrink_and_join] in ([2, 3], [3]) and leave["world"] == 2, events
    assert shrink_and_join[0]["left"] == ["node 1 local rank 0"] and shrink_and_join[0]["why"] == ["its process ended"]
    assert shrink_and_join[-1]["joined"] == ["node 1 local rank 0"] and shrink_and_join[-1]["healed_from"] is not None
    assert leave["left"] == ["node 2 local rank 0"] and leave["why"] == ["it was asked to stop"], events
    assert [m["world"] for m in membership(run_dir)] == [e["world"] for e in events]
    said = [line for line in "".join(outs).splitlines() if ": world " in line]  # by rank 0, on any node
    assert any("node 1 local rank 0 left (its process ended)" in line for line in said), (said, events)
    assert summary["steps"] == 160
    # no survivor waited out a timeout for a peer that had gone (parallel.timeout_s is 600 s here)
    assert max(e["regroup_s"] for e in events) < 60, events
    print("\n".join(e["line"] for e in events))

    # the report shows each change: its table row and the timeline's marks
    page = tmp_path / "report.html"
    assert main(["report", str(run_dir), "--out", str(page)]) == 0
    shown = page.read_text()
    assert all(html.escape(e["line"]) in shown for e in events), events
    equals_one_process(run_dir, one_process)


def test_a_silent_node_below_min_then_a_cancel_and_resume_equal_one_process(tmp_path, one_process):
    run_dir, port = tmp_path / "live", free_port()
    silent_at = random.randrange(10, 40)
    print(f"node 2 goes silent after step {silent_at}")
    nodes = [start_node(i, run_dir, port, max_restarts=0) for i in range(3)]
    try:
        wait_for(f"step {silent_at}", lambda: progress(run_dir) >= silent_at, 120, nodes)
        silent = [nodes[2].pid, *descendants(nodes[2].pid)]  # the worker has a session of its own
        for pid in silent:  # launcher and worker: no process ends, no connection closes
            os.kill(pid, signal.SIGSTOP)
        wait_for("node 2 marked gone", lambda: membership(run_dir), 60, nodes)
        for pid in silent:
            os.kill(pid, signal.SIGKILL)
        nodes[2].wait()
        # node 1's worker dies and may not be replaced: 1 worker left, below MIN (2): it waits for a joiner
        os.kill(worker_of(nodes[1]), signal.SIGKILL)
        lost = nodes[1].communicate(timeout=60)[0]
        assert nodes[1].returncode == 128 + signal.SIGKILL, lost
        nodes[1] = start_node(1, run_dir, port, max_restarts=0)  # a new node
        wait_for("the new node's join", lambda: len(membership(run_dir)) >= 2, 120, nodes[:2])
        cancel_at = progress(run_dir) + 5
        wait_for(f"step {cancel_at}", lambda: progress(run_dir) >= cancel_at, 60, nodes[:2])
        for p in nodes[:2]:  # a job's cancel: every node, within a few milliseconds
            p.send_signal(signal.SIGTERM)
        outs = [p.communicate(timeout=60)[0] for p in nodes[:2]]
    finally:
        end_all(nodes)
    assert [p.returncode for p in nodes[:2]] == [128 + signal.SIGTERM] * 2, "\n".join(outs)
    silent, replaced = membership(run_dir)
    assert silent["world"] == 2 and "node 2 local rank 0 left (no heartbeat for 10 s" in silent["membership"], silent
    # no generation below MIN formed: the survivor waited, and the new node came into a world of 2 again
    assert replaced["world"] == 2 and "node 1 local rank 0 left (its process ended)" in replaced["membership"] \
        and "node 1 local rank 0 joined" in replaced["membership"], replaced
    stopped = max(int(d.name.split("_")[1]) for d in (run_dir / "checkpoints").glob("step_*"))
    assert stopped >= cancel_at, (stopped, outs)

    # the same command again: it resumes from that checkpoint, elastic again, and trains to the end
    port = free_port()
    nodes = [start_node(i, run_dir, port, max_restarts=0) for i in range(2)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in nodes]
    finally:
        end_all(nodes)
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(outs)
    assert f"resumed from {run_dir / 'checkpoints'}" in outs[0] and json.loads((run_dir / "summary.json").read_text())["steps"] == 160, outs[0]
    equals_one_process(run_dir, one_process)
