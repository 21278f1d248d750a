"""A NaN loss is caught before the optimizer step and handled by train.on_bad_step. The policies run
in the harness; how an abort reaches the user (one line, exit 1) is a CLI run."""

import json

from conftest import read_metrics
from harness import train as train_on_ranks
from shoal.errors import TrainingError
from test_checkpoint import CONFIG, FORWARDS_PER_STEP, STEPS, args, fault, train

STEP5 = 4 * FORWARDS_PER_STEP + 1  # rank 1's first forward of step 5 (dp=2)


def nan_at(at_call, once_file=None, mode="nan"):
    """Rank 1's `at_call`-th forward returns NaN (once, when once_file is set)."""
    once = [f'model.once_file="{once_file}"'] if once_file else []
    return [*CONFIG, "model.rank=1", f'model.mode="{mode}"', f"model.at_call={at_call}", *once]


def summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def train_until_it_stops(env, overrides, run_dir):
    """The run must end with a TrainingError on this rank; returns its message."""
    try:
        train_on_ranks(env, overrides, run_dir)
    except TrainingError as e:
        return str(e)
    raise AssertionError("the run should have stopped")


def test_skip_drops_the_update_and_counts_it(tmp_path, ranks):
    run_dir = tmp_path / "run"
    [(_, out), _] = ranks(2).run(train_on_ranks, nan_at(STEP5, tmp_path / "fired"), str(run_dir))
    assert "step 5: loss nan, gradient norm nan: update skipped" in out
    m = {x["step"]: x for x in read_metrics(run_dir)}
    assert m[5]["skipped"] is True and m[5]["loss"] is None  # NaN is written as null
    assert all(m[s]["loss"] is not None and "skipped" not in m[s] for s in m if s != 5)
    s = summary(run_dir)
    assert s["steps"] == STEPS and s["bad_steps"] == 1 and s["rollbacks"] == 0


def test_skip_aborts_after_too_many_in_a_row(tmp_path, ranks):
    messages = ranks(2).run(train_until_it_stops, [*nan_at(STEP5, mode="nan-from"), "train.max_bad_steps=2"],
                            str(tmp_path / "run"))
    for message in messages:  # every rank takes the same decision
        assert message.startswith("step 7: loss nan, gradient norm nan: 3 bad steps in a row, more than "
                                  "train.max_bad_steps (2)"), message


def test_abort_stops_with_a_clear_message(tmp_path):
    r = train(*args(tmp_path / "run", 2, *fault(1, STEP5, tmp_path / "fired", mode="nan"),
                    "--set", "train.on_bad_step=abort"), expect=1)
    assert 'shoal: error: step 5: loss nan, gradient norm nan; train.on_bad_step = "abort" stops the run' in r.stderr
    assert "Traceback" not in r.stderr


def test_rollback_reloads_the_checkpoint_and_skips_the_batch(tmp_path, ranks):
    run_dir = tmp_path / "run"
    step7 = 6 * FORWARDS_PER_STEP + 1
    [(_, out), _] = ranks(2).run(train_on_ranks, [*nan_at(step7, tmp_path / "fired"), "train.on_bad_step=rollback"],
                                 str(run_dir))
    assert "step 7: loss nan; rolled back to step 4" in out
    m = read_metrics(run_dir)
    assert [x["step"] for x in m] == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8, 9, 10, 11, 12]
    assert m[4]["loss"] == m[6]["loss"] and m[5]["loss"] == m[7]["loss"]  # steps 5, 6 redone on the same data
    assert all(x["loss"] is not None for x in m)
    s = summary(run_dir)
    assert s["steps"] == STEPS and s["rollbacks"] == 1 and s["bad_steps"] == 1
    train_state = json.loads((run_dir / "checkpoints/step_00000012/train_state.json").read_text())
    assert train_state["parts"]["sampler"]["skipped"] == [6]  # data step 6 (0-based) fed step 7: never trained on


# steps that are not logged are read a step late (training/loop.py): the bad step is found once the next
# step is queued, and that step's work is what a rollback throws away
LATE = ["metrics.log_interval=100"]


def test_a_bad_step_read_late_is_skipped_and_counted(tmp_path, ranks):
    run_dir = tmp_path / "run"
    [(_, out), _] = ranks(2).run(train_on_ranks, [*nan_at(STEP5, tmp_path / "fired"), *LATE], str(run_dir))
    assert "step 5: loss nan, gradient norm nan: update skipped" in out
    m = {x["step"]: x for x in read_metrics(run_dir)}
    assert sorted(m) == [5, STEPS] and m[5]["skipped"] is True  # the skipped step's line, and the last
    s = summary(run_dir)
    assert s["steps"] == STEPS and s["bad_steps"] == 1 and s["final_loss"] is not None


def test_a_bad_step_read_late_rolls_back(tmp_path, ranks):
    run_dir = tmp_path / "run"
    step7 = 6 * FORWARDS_PER_STEP + 1
    [(_, out), _] = ranks(2).run(train_on_ranks, [*nan_at(step7, tmp_path / "fired"), "train.on_bad_step=rollback",
                                                  *LATE], str(run_dir))
    assert "step 7: loss nan; rolled back to step 4" in out
    s = summary(run_dir)
    assert s["steps"] == STEPS and s["rollbacks"] == 1 and s["bad_steps"] == 1
    train_state = json.loads((run_dir / "checkpoints/step_00000012/train_state.json").read_text())
    assert train_state["parts"]["sampler"]["skipped"] == [6]
