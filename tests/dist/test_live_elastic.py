"""A live elastic run (--nnodes MIN:MAX): three one-worker nodes on loopback lose a worker at a random
step (the survivors go on without restarting), get it back (a replacement heals from a live peer), and
lose a node that is asked to stop (SIGTERM: it leaves cleanly); the weights equal one process's, and
`shoal report` shows each change."""

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


def worker_of(node: subprocess.Popen) -> int:
    """The pid of the one worker a node's launcher runs."""
    for pid in descendants(node.pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().split(b"\0")
        if b"shoal" in cmd and b"--nnodes" not in cmd:
            return pid
    raise AssertionError("the node runs no worker")


def test_a_worker_killed_rejoined_and_a_node_leaving_equal_one_process(tmp_path):
    run_dir, port = tmp_path / "live", free_port()
    rng = random.Random()
    kill_at = rng.randrange(10, 40)
    print(f"killing node 1's worker after step {kill_at}")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    nodes = [subprocess.Popen([sys.executable, "-m", "shoal", "train", *RUN, "--run-dir", str(run_dir),
                               "--nnodes", "2:3", "--nproc", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
                               "--node-rank", str(i), "--max-restarts", "1"],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for i in range(3)]
    try:
        wait_for(f"step {kill_at}", lambda: progress(run_dir) >= kill_at, 120, nodes)
        os.kill(worker_of(nodes[1]), signal.SIGKILL)
        # the survivors go on without it, and its replacement joins: one change or two (the survivors may
        # take longer to give up on the dead worker than the replacement takes to start)
        wait_for("the replacement's join", lambda: any("joined" in m["membership"] for m in membership(run_dir)),
                 120, nodes)
        nodes[2].send_signal(signal.SIGTERM)  # node 2 leaves; the others finish the run
        outs = [p.communicate(timeout=120)[0] for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                for pid in [p.pid, *descendants(p.pid)]:
                    os.kill(pid, signal.SIGKILL)
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
    said = [line for line in (outs[0] + outs[1]).splitlines() if ": world " in line]
    assert any("node 1 local rank 0 left (its process ended)" in line for line in said), (said, events, outs[0])
    assert summary["steps"] == 160
    # no survivor waited out a timeout for a peer that had gone (parallel.timeout_s is 600 s here)
    assert max(e["regroup_s"] for e in events) < 60, events
    print("\n".join(e["line"] for e in events))

    # the report shows each change: its table row and the timeline's marks
    page = tmp_path / "report.html"
    assert main(["report", str(run_dir), "--out", str(page)]) == 0
    shown = page.read_text()
    assert all(html.escape(e["line"]) in shown for e in events), events

    reference = tmp_path / "one"
    train_in_process([a for a in RUN if a != "--set"], reference)
    got, want = read_weights(run_dir), read_weights(reference)
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst <= 1e-5, f"live run differs from one process by {worst}"
