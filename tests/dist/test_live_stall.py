"""A live elastic run (--nnodes MIN:MAX) where one worker stalls (alive, its heartbeat going, but stuck
inside a forward): its peers' collective times out after parallel.timeout_s, they regroup without it once
it has been absent as long again (evicted, and named so), and its launcher prints its stacks and ends it
rather than leave it stuck. The run finishes with the others, equal to one process."""

import json
import signal

import pytest

from live_runs import RUN, changes, end_all, equals_one_process, membership, start_node, wait_for
from shoal.launch.ports import free_port

pytestmark = pytest.mark.timeout(240)

# the user model of tests/fixtures/stall.py (gpt-tiny's shape, 2 layers): the worker that is rank 2 stalls
# in its 20th block forward, in step 5 (4 micro-batches a step among 3 workers). Rank 2, since a world of
# 2 has none: a survivor that became rank 1 could otherwise reach its own 20th forward in the redone step
STALL = [*RUN, "--set", "train.steps=30", "--set", 'model.name="stall:build"', "--set", "model.rank=2",
         "--set", "model.at_call=20", "--set", "parallel.timeout_s=5"]


def test_a_stalled_worker_is_evicted_named_and_ended_and_the_others_equal_one_process(tmp_path, shared_dir):
    run_dir, port, mark = tmp_path / "live", free_port(), tmp_path / "stalled_at"
    run = [*STALL, "--set", f'model.mark_file="{mark}"']
    nodes = [start_node(i, run_dir, port, max_restarts=0, run=run) for i in range(3)]
    try:
        wait_for("the stall", mark.exists, 120, nodes)
        wait_for("the eviction", lambda: membership(run_dir), 60, nodes)
        wait_for("the run's end", lambda: all(p.poll() is not None for p in nodes), 120, nodes)
        outs = [p.communicate()[0] for p in nodes]
    finally:
        end_all(nodes)
    codes = sorted(p.returncode for p in nodes)
    assert codes == [0, 0, 128 + signal.SIGKILL], "\n".join(outs)
    stalled = next(out for p, out in zip(nodes, outs, strict=True) if p.returncode)
    assert "is out of the run (stalled past parallel.timeout_s, evicted) but still running" in stalled, stalled
    assert "in stalling_forward" in stalled, stalled  # its stacks, from faulthandler
    (event,) = changes(run_dir)
    assert event["world"] == 2 and event["why"] == ["stalled past parallel.timeout_s, evicted"], event
    assert event["regroup_s"] < 60, event
    equals_one_process(run_dir, shared_dir, run)
