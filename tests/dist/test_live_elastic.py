"""A live elastic run (--nnodes MIN:MAX) of one-worker nodes on loopback: a worker dies at a random step
(the survivors go on without restarting), a replacement heals from a live peer, and a node asked to stop
(SIGTERM) leaves cleanly; `shoal report` shows each change, and the weights equal one process's."""

import html
import json
import os
import random
import signal

import pytest

from live_runs import (
    RUN,
    changes,
    end_all,
    equals_one_process,
    gloo_loops,
    leave_while_held,
    membership,
    outputs,
    progress,
    start_node,
    wait_for,
    worker_of,
    world,
)
from shoal.cli import main
from shoal.launch.ports import free_port
from shoal.live.membership import PREFIX
from shoal.live.membership import connect as membership_store

pytestmark = pytest.mark.timeout(240)


def test_a_worker_killed_rejoined_and_a_node_leaving_equal_one_process(tmp_path, shared_dir):
    run_dir, port = tmp_path / "live", free_port()
    rng = random.Random()
    kill_at = rng.randrange(5, 20)
    print(f"killing node 1's worker after step {kill_at}")
    gate = tmp_path / "gate"  # while it exists, the workers wait at their next forward (tests/fixtures/gate.py)
    nodes = [start_node(i, run_dir, port, max_restarts=1, env={"SHOAL_TEST_GATE": str(gate)}) for i in range(3)]
    try:
        wait_for(f"step {kill_at} on all three", lambda: progress(run_dir) >= kill_at and world(run_dir) == 3, 120, nodes)
        loops = gloo_loops(worker_of(nodes[0]))
        # the survivors are held until the replacement has asked to join: its start (a new interpreter, torch's
        # import) took longer under load than the 2 survivors took to finish the run's 20 or more other steps
        gate.touch()
        # counted before the kill: a node whose worker started after the first generation formed has asked
        # to join too (membership() in live_runs.py), and "more than 0" once let the survivors go on early
        store = membership_store(f"127.0.0.1:{port}")
        before = int(store.add(PREFIX + "join_requests", 0))
        os.kill(worker_of(nodes[1]), signal.SIGKILL)
        wait_for("the replacement's request to join", lambda: int(store.add(PREFIX + "join_requests", 0)) > before,
                 120, nodes)
        gate.unlink()
        # the survivors go on without it, and its replacement joins: one change or two (the survivors may
        # take longer to give up on the dead worker than the replacement takes to start)
        wait_for("the replacement's join", lambda: any("joined" in m["membership"] for m in membership(run_dir)),
                 120, nodes)
        # each ended generation's groups were freed: a survivor runs no more gloo event loops than at the
        # start (a mesh kept across generations once kept them all, and their loops spun on cut sockets)
        assert gloo_loops(worker_of(nodes[0])) == loops
        leave_while_held(nodes[2], gate)  # node 2 leaves; the others finish the run
        outs = outputs(nodes, 120)
    finally:
        end_all(nodes)
    codes = [p.returncode for p in nodes]
    assert codes == [0, 0, 128 + signal.SIGTERM], "\n".join(outs)
    summary = json.loads((run_dir / "summary.json").read_text())
    events = changes(run_dir)
    *shrink_and_join, leave = events
    assert [e["world"] for e in shrink_and_join] in ([2, 3], [3]) and leave["world"] == 2, events
    assert shrink_and_join[0]["left"] == ["node 1 local rank 0"] and shrink_and_join[0]["why"] == ["its process ended"]
    assert shrink_and_join[-1]["joined"] == ["node 1 local rank 0"] and shrink_and_join[-1]["healed_from"] is not None
    assert leave["left"] == ["node 2 local rank 0"] and leave["why"] == ["it was asked to stop"], events
    assert [m["world"] for m in membership(run_dir)] == [e["world"] for e in events]
    said = [line for line in "".join(outs).splitlines() if ": world " in line]  # by rank 0, on any node
    assert any("node 1 local rank 0 left (its process ended)" in line for line in said), (said, events)
    assert summary["steps"] == 40
    # no survivor waited out a timeout for a peer that had gone (parallel.timeout_s is 600 s here)
    assert max(e["regroup_s"] for e in events) < 60, events
    print("\n".join(e["line"] for e in events))

    # the report shows each change: its table row and the timeline's marks
    page = tmp_path / "report.html"
    assert main(["report", str(run_dir), "--out", str(page)]) == 0
    shown = page.read_text()
    assert all(html.escape(e["line"]) in shown for e in events), events
    equals_one_process(run_dir, shared_dir)


def test_a_worker_killed_in_the_first_step_sends_the_survivors_back_to_the_start(tmp_path, shared_dir):
    """Nothing is held before the first step completes (DCP's state dict of an optimizer that has not
    stepped would initialise AdamW by a counted step of lr 0): the survivors start again from the start,
    and the weights still equal one process's."""
    run = [*RUN, "--set", "train.steps=30"]
    run_dir, port, gate = tmp_path / "live", free_port(), tmp_path / "gate"
    gate.touch()  # every worker waits at its first forward
    nodes = [start_node(i, run_dir, port, max_restarts=0, run=run, env={"SHOAL_TEST_GATE": str(gate)})
             for i in range(3)]
    try:
        # rank 0 writes the resolved config once the group has formed and every worker is building
        wait_for("the group", lambda: (run_dir / "config.toml").exists(), 120, nodes)
        os.kill(worker_of(nodes[1]), signal.SIGKILL)
        gate.unlink()
        outs = outputs(nodes, 120)
    finally:
        end_all(nodes)
    assert [p.returncode for p in nodes] == [0, 137, 0], "\n".join(outs)
    events = changes(run_dir)
    assert [(e["step"], e["world"]) for e in events] == [(0, 2)], events
    assert [m["world"] for m in membership(run_dir)] == [2]  # said in metrics.jsonl too, though it began again
    equals_one_process(run_dir, shared_dir, run)
