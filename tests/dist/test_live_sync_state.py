"""A live run's heal carries the sync state: with int8 compression and error feedback, a node that leaves
cleanly (SIGTERM) gives its residuals to the merge before it goes, and the run goes on exactly as one
resumed from disk at the same step on the new world size (every rank then takes the mean of the old
ranks' residuals, from their files). The same resume with the residuals dropped differs: the merge is
what makes them equal."""

import json
import os
import random
import shutil
import signal

import pytest

from conftest import read_weights
from harness import train as train_on_ranks
from live_runs import (
    RUN,
    changes,
    end_all,
    held_after,
    leave_while_held,
    membership,
    node_of_rank,
    outputs,
    release,
    start_node,
    wait_for,
    worker_of,
)
from shoal.checkpoint import manifest
from shoal.launch.ports import free_port

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]  # the CLI, besides the harness

STEPS = 48
# RUN with int8 compression and a constant learning rate (the reference trains to the leave's step in
# one run and on from its checkpoint in another, so the schedule must not depend on train.steps)
INT8 = [*RUN, "--set", f"train.steps={STEPS}", "--set", 'comm.compression="int8"', "--set", "train.warmup_steps=0",
        "--set", "train.min_lr_ratio=1.0"]


def overrides(steps: int) -> list[str]:
    return [a for a in INT8 if a != "--set"] + [f"train.steps={steps}"]


def worst(got: dict, want: dict) -> float:
    return max((got[k] - want[k]).abs().max().item() for k in want)


def a_node_leaves(run_dir, gate, run: list[str], rank: int | None = None) -> int:
    """A live run of `run` on 3 nodes from which node 2 (`rank` given: the node whose worker holds that rank)
    leaves on SIGTERM, asked while the workers hold after a random step; the step it left at."""
    hold, port = random.Random().randrange(8, 30), free_port()
    nodes = [start_node(i, run_dir, port, max_restarts=0, run=run, env=held_after(gate, hold, run=run)) for i in range(3)]
    try:
        wait_for(f"the hold after step {hold}", gate.exists, 120, nodes)
        leaver = 2 if rank is None else node_of_rank(nodes, rank)
        leave_while_held(nodes[leaver], gate)
        outs = outputs(nodes, 120)
    finally:
        end_all(nodes)
    assert [p.returncode for p in nodes] == [128 + signal.SIGTERM if i == leaver else 0 for i in range(3)], "\n".join(outs)
    changes = membership(run_dir)
    assert [m["world"] for m in changes] == [2] and "left (it was asked to stop)" in changes[0]["membership"], changes
    assert hold < changes[0]["step"] <= hold + 3, (hold, changes)  # the held step's end, or its round's
    return changes[0]["step"]


def resumed_from_disk(ranks, run: list[str], step: int, ref, replica: int = 0, also=None) -> None:
    """The reference of a change at `step`: 3 ranks to that step, then 2 ranks on from its checkpoint, from
    the replica of rank `replica` (a resume on another world size goes on from rank 0's file: it is made
    rank `replica`'s, its twin the old rank 0's, and the checkpoint sealed again). `also`: a second run dir
    resumed from the same checkpoint as it was written (from rank 0's replica)."""
    sets = [a for a in run if a != "--set"]
    ranks(3).run(train_on_ranks, [*sets, f"train.steps={step}"], str(ref))
    if also is not None:
        shutil.copytree(ref, also)
        ranks(2).run(train_on_ranks, sets, str(also))
    if replica:
        folder = ref / "checkpoints" / f"step_{step:08d}"
        first, other = folder / "state_rank00000.safetensors", folder / f"state_rank{replica:05d}.safetensors"
        first.rename(folder / "swap")
        other.rename(first)
        (folder / "swap").rename(other)
        info = {k: v for k, v in manifest.read_manifest(folder).items() if k not in ("format", "files")}
        manifest.write_manifest(folder, info)
    ranks(2).run(train_on_ranks, sets, str(ref))


def test_a_clean_leave_with_int8_equals_a_resume_from_disk(tmp_path, ranks):
    run_dir = tmp_path / "live"
    step = a_node_leaves(run_dir, tmp_path / "gate", INT8)

    # the reference: 3 ranks to that step, then 2 ranks on from its checkpoint
    ref = tmp_path / "ref"
    ranks(3).run(train_on_ranks, overrides(step), str(ref))
    dropped = tmp_path / "dropped"
    shutil.copytree(ref, dropped)
    ranks(2).run(train_on_ranks, overrides(STEPS), str(ref))
    for f in (dropped / "checkpoints" / f"step_{step:08d}").glob("state_rank*.safetensors"):
        f.unlink()  # the residuals: without them the resume starts error feedback afresh
    ranks(2).run(train_on_ranks, overrides(STEPS), str(dropped))

    live, from_disk = read_weights(run_dir), read_weights(ref)
    print(f"leave at step {step}: live vs resume from disk {worst(live, from_disk):.3g}, "
          f"vs the resume without residuals {worst(live, read_weights(dropped)):.3g}")
    assert worst(live, from_disk) <= 1e-5, f"the live run differs from the resume from disk by {worst(live, from_disk)}"
    assert worst(live, read_weights(dropped)) > 1e-4, "dropping the residuals changed nothing: the test shows nothing"


# DiLoCo: 3 inner steps per round, the paper's outer lr and Nesterov momentum
DILOCO = [*RUN, "--set", f"train.steps={STEPS}", "--set", 'sync.mode="diloco"', "--set", "sync.every=3",
          "--set", "sync.outer_momentum=0.9", "--set", "train.warmup_steps=0", "--set", "train.min_lr_ratio=1.0"]


def a_worker_killed(run_dir, gate, run: list[str], kill_at: int, rank: int | None = None) -> tuple[int, int]:
    """A live run of `run` on 3 nodes whose node 1 worker (`rank` given: the worker that holds that rank) is
    SIGKILLed while the workers hold after step `kill_at`; the step the survivors' world of 2 started from,
    and the rank the killed worker held."""
    print(f"killing {'node 1' if rank is None else f'rank {rank}'}'s worker after step {kill_at}")
    port = free_port()
    nodes = [start_node(i, run_dir, port, max_restarts=0, run=run, env=held_after(gate, kill_at, run=run)) for i in range(3)]
    try:
        wait_for(f"the hold after step {kill_at}", gate.exists, 120, nodes)
        victim = 1 if rank is None else node_of_rank(nodes, rank)
        os.kill(worker_of(nodes[victim]), signal.SIGKILL)
        release(gate)
        outs = outputs(nodes, 120)
    finally:
        end_all(nodes)
    assert [p.returncode for p in nodes] == [137 if i == victim else 0 for i in range(3)], "\n".join(outs)
    print("\n".join(outs))  # shown if the test fails
    logged = membership(run_dir)
    assert [m["world"] for m in logged] == [2], logged
    (lost,) = changes(run_dir)[0]["left_ranks"]
    return logged[0]["step"], lost


def test_diloco_survivors_redo_the_round_and_equal_a_resume_from_its_start(tmp_path, ranks):
    """DiLoCo's replicas differ within a round, so a worker killed mid-round takes the round's work with it:
    the survivors go back to the round's start (where the replicas were one model) and redo it between them,
    each replica from the lowest survivor's inner optimizer state, with the outer state (anchor, Nesterov
    momentum) carried. That equals a resume from a checkpoint at the round's start on the new world size,
    from the same replica. Rank 0's worker is the one killed: the survivors cannot go on from its replica,
    as a resume from disk would (rank 0's file), but from rank 1's."""
    # $KILL_AT pins it to replay a failure (at 11 once, under make test's load, the survivors regrouped at 12, not
    # 9: not reproduced alone or beside two busy loops since)
    kill_at = int(os.environ.get("KILL_AT", random.Random().randrange(10, 30)))
    start, lost = a_worker_killed(tmp_path / "live", tmp_path / "gate", DILOCO, kill_at, rank=0)
    assert start == kill_at - kill_at % 3 and lost == 0, (start, lost)  # the start of the round the kill fell in
    resumed_from_disk(ranks, DILOCO, start, tmp_path / "ref", replica=1, also=tmp_path / "plain")
    live, from_disk = read_weights(tmp_path / "live"), read_weights(tmp_path / "ref")
    plain = read_weights(tmp_path / "plain")
    print(f"killed in the round from step {start}: live vs resume from disk {worst(live, from_disk):.3g}, "
          f"vs the resume from rank 0's replica {worst(live, plain):.3g}")
    assert worst(live, from_disk) <= 1e-5, f"the live run differs from the resume from disk by {worst(live, from_disk)}"
    assert worst(live, plain) > 1e-4, "the replica gone on from changed nothing: the test shows nothing"


def test_a_diloco_worker_killed_in_the_first_round_sends_the_survivors_back_to_the_start(tmp_path, ranks):
    """Nothing is copied before the first step (DCP's state dict of an optimizer that has not stepped would
    initialise AdamW by a counted step of lr 0): a loss in the first round starts the survivors afresh,
    equal to 2 ranks trained from the start."""
    run = [*DILOCO, "--set", "train.steps=12"]
    assert a_worker_killed(tmp_path / "live", tmp_path / "gate", run, random.Random().randrange(1, 3))[0] == 0
    ranks(2).run(train_on_ranks, [a for a in run if a != "--set"], str(tmp_path / "ref"))
    live, fresh = read_weights(tmp_path / "live"), read_weights(tmp_path / "ref")
    assert worst(live, fresh) <= 1e-5, f"the live run differs from 2 ranks from the start by {worst(live, fresh)}"


def test_a_diloco_leave_waits_for_the_round_s_end_and_equals_a_resume_from_there(tmp_path, ranks):
    """A node asked to stop leaves at the end of a round, where the replicas are one model (a leave mid-round
    would take its replica's work with it), and the run goes on as one resumed from disk there. The node
    that leaves is rank 0's, whose replica a resume from disk goes on from: it hands it to the others
    before it goes."""
    run_dir, ref = tmp_path / "live", tmp_path / "ref"
    step = a_node_leaves(run_dir, tmp_path / "gate", DILOCO, rank=0)
    assert step % 3 == 0 and step < STEPS, step  # a round's end, not the run's
    resumed_from_disk(ranks, DILOCO, step, ref)
    live, from_disk = read_weights(run_dir), read_weights(ref)
    print(f"left at step {step}: live vs resume from disk {worst(live, from_disk):.3g}")
    assert worst(live, from_disk) <= 1e-5, f"the live run differs from the resume from disk by {worst(live, from_disk)}"
