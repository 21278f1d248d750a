"""A NaN loss is caught before the optimizer step and handled by train.on_bad_step."""

import json

from conftest import read_metrics
from test_checkpoint import FORWARDS_PER_STEP, STEPS, args, fault, train

STEP5 = 4 * FORWARDS_PER_STEP + 1  # rank 1's first forward of step 5 (dp=2)


def summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def test_skip_drops_the_update_and_counts_it(tmp_path):
    run_dir = tmp_path / "run"
    r = train(*args(run_dir, 2, *fault(1, STEP5, tmp_path / "fired", mode="nan")))
    assert "step 5: loss nan, gradient norm nan: update skipped" in r.stdout
    m = {x["step"]: x for x in read_metrics(run_dir)}
    assert m[5]["skipped"] is True and m[5]["loss"] is None  # NaN is written as null
    assert all(m[s]["loss"] is not None and "skipped" not in m[s] for s in m if s != 5)
    s = summary(run_dir)
    assert s["steps"] == STEPS and s["bad_steps"] == 1 and s["rollbacks"] == 0


def test_skip_aborts_after_too_many_in_a_row(tmp_path):
    r = train(*args(tmp_path / "run", 2, *fault(1, STEP5, None, mode="nan-from"),
                    "--set", "train.max_bad_steps=2"), expect=1)
    assert "step 7: loss nan, gradient norm nan: 3 bad steps in a row, more than train.max_bad_steps (2)" in r.stderr
    assert "Traceback" not in r.stderr


def test_abort_stops_with_a_clear_message(tmp_path):
    r = train(*args(tmp_path / "run", 2, *fault(1, STEP5, tmp_path / "fired", mode="nan"),
                    "--set", "train.on_bad_step=abort"), expect=1)
    assert 'shoal: error: step 5: loss nan, gradient norm nan; train.on_bad_step = "abort" stops the run' in r.stderr
    assert "Traceback" not in r.stderr


def test_rollback_reloads_the_checkpoint_and_skips_the_batch(tmp_path):
    run_dir = tmp_path / "run"
    step7 = 6 * FORWARDS_PER_STEP + 1
    r = train(*args(run_dir, 2, *fault(1, step7, tmp_path / "fired", mode="nan"), "--set", "train.on_bad_step=rollback"))
    assert "step 7: loss nan; rolled back to step 4" in r.stdout
    m = read_metrics(run_dir)
    assert [x["step"] for x in m] == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8, 9, 10, 11, 12]
    assert m[4]["loss"] == m[6]["loss"] and m[5]["loss"] == m[7]["loss"]  # steps 5, 6 redone on the same data
    assert all(x["loss"] is not None for x in m)
    s = summary(run_dir)
    assert s["steps"] == STEPS and s["rollbacks"] == 1 and s["bad_steps"] == 1
    train_state = json.loads((run_dir / "checkpoints/step_00000012/train_state.json").read_text())
    assert train_state["parts"]["sampler"]["skipped"] == [6]  # data step 6 (0-based) fed step 7: never trained on
