"""train.gc_interval: Python's collector never runs inside a training step; it collects fully between steps,
every gc_interval steps, at the same steps on every rank, after freezing what the first steps built
(training/collector.py). Left to itself (gc_interval = 0) it collects in the middle of steps."""

import pytest

from conftest import TINY_GPT
from harness import train

STEPS = 30
CONFIG = [*TINY_GPT[1::2], f"train.steps={STEPS}", "train.global_batch_size=4", "train.micro_batch_size=2",
          "train.val_interval=0", "metrics.log_interval=5", "metrics.progress=false", "checkpoint.enabled=false"]


# the collector's first threshold while the tests train: a collection starts once tracked objects outnumber the
# freed by this many. Python's 700 was reached inside some step of this tiny model's until its step made fewer
# objects; so low a threshold is reached inside every step that is left to it, and says nothing of any model
THRESHOLD = 50


def collections_by_place(env, overrides: list[str], run_dir: str) -> dict:
    """Train, recording every collection Python's collector starts while the loop runs: (generation, the
    step it was in or None between steps, the step count reached)."""
    import gc

    from shoal.training.loop import Trainer
    from shoal.training.step import Stepper

    where = {"in": None, "reached": 0, "loop": False}
    seen = []

    def on_gc(phase, info):
        if phase == "start" and where["loop"]:
            seen.append((info["generation"], where["in"], where["reached"]))

    call = Stepper.__call__

    def stepping(stepper, micro_batches, step, *args, **kwargs):
        where["in"] = step + 1
        try:
            return call(stepper, micro_batches, step, *args, **kwargs)
        finally:
            where["in"], where["reached"] = None, step + 1

    run = Trainer.run

    def looping(trainer, feed):
        where["loop"] = True
        try:
            return run(trainer, feed)
        finally:
            where["loop"] = False

    Stepper.__call__, Trainer.run = stepping, looping
    gc.callbacks.append(on_gc)
    thresholds = gc.get_threshold()
    gc.set_threshold(THRESHOLD, *thresholds[1:])
    try:
        summary, _ = train(env, overrides, run_dir)
    finally:
        gc.set_threshold(*thresholds)
        gc.callbacks.remove(on_gc)
        Stepper.__call__, Trainer.run = call, run
    return {"seen": seen, "enabled_after": gc.isenabled(), "frozen_after": gc.get_freeze_count(),
            "summary": {k: v for k, v in summary.items() if k.startswith("gc_")}}


def test_no_collection_inside_a_step_and_full_ones_between_steps_on_every_rank(tmp_path, ranks):
    got = ranks(2).run(collections_by_place, [*CONFIG, "train.gc_interval=10"], str(tmp_path / "run"), timeout=300)
    for rank, r in enumerate(got):
        inside = [s for s in r["seen"] if s[1] is not None]
        assert not inside, (rank, inside)
        # the freeze's collection after the first step, then every 10 steps; all full (generation 2), nothing else
        assert [(gen, reached) for gen, _, reached in r["seen"]] == [(2, 1), (2, 10), (2, 20), (2, 30)], (rank, r)
        assert r["enabled_after"] and r["frozen_after"] == 0, r  # the collector as it was, nothing left frozen
        assert set(r["summary"]) == {"gc_interval", "gc_pause_before_freeze_s", "gc_pause_s"}, r["summary"]
        assert r["summary"]["gc_pause_s"] >= 0
    assert got[0]["seen"] and [s[2] for s in got[0]["seen"]] == [s[2] for s in got[1]["seen"]]  # the same steps


@pytest.mark.slow  # the contrast: what the test above would see without the management
def test_python_left_to_itself_collects_inside_steps(tmp_path, ranks):
    [r] = ranks(1).run(collections_by_place, [*CONFIG, "train.gc_interval=0"], str(tmp_path / "run"), timeout=300)
    assert any(s[1] is not None for s in r["seen"]), r["seen"]
    assert r["summary"] == {}
