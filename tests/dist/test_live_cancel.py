"""A live elastic run (--nnodes MIN:MAX) of one-worker nodes on loopback: a whole node goes silent
(SIGSTOP: its connections stay open), the last other worker dies with no replacement allowed (below MIN:
the survivor waits), a new node joins, then every node is stopped (a job's cancel: a checkpoint, exit 143)
and the same command resumes the run, elastic again, to its end, equal to one process."""

import json
import os
import random
import signal

import pytest

from live_runs import (end_all, equals_one_process, membership, outputs, progress, start_node, wait_for, worker_of,
                       world)
from shoal.launch.ports import free_port
from shoal.launch.supervisor import descendants

pytestmark = pytest.mark.timeout(240)


def test_a_silent_node_below_min_then_a_cancel_and_resume_equal_one_process(tmp_path, shared_dir):
    run_dir, port = tmp_path / "live", free_port()
    # $SILENT_AT pins it to replay a failure (at 9, 2 of 5 runs once ended a step ahead: fixed in run.py)
    silent_at = int(os.environ.get("SILENT_AT", random.randrange(5, 15)))
    print(f"node 2 goes silent after step {silent_at}")
    nodes = [start_node(i, run_dir, port, max_restarts=0) for i in range(3)]
    try:
        wait_for(f"step {silent_at} on all three", lambda: progress(run_dir) >= silent_at and world(run_dir) == 3, 120,
                 nodes)
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
        outs = outputs(nodes, 120)
    finally:
        end_all(nodes)
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(outs)
    said = "".join(outs)  # by rank 0, which need not be node 0's worker
    assert f"resumed from {run_dir / 'checkpoints'}" in said and json.loads((run_dir / "summary.json").read_text())["steps"] == 40, said
    equals_one_process(run_dir, shared_dir)
