"""Checkpoints never lose work: a killed run resumes into exactly the run that would have happened.

fp32 on CPU, one thread per worker: the resumed run must end with parameters *bitwise* equal to the
uninterrupted run of the same config and world size (same data stream, RNG, optimizer and schedule).
Kills and elastic restarts are CLI runs (only a real launch can show them); one process crashing and
resuming runs in the harness.
"""

import json
import random
import shutil
import time
from pathlib import Path

import pytest
import torch

from conftest import read_metrics, read_weights, run_cli
from harness import train as train_on_ranks

STEPS = 12
FORWARDS_PER_STEP = 2  # global batch 8 = micro 2 x dp x accumulation: 2 forwards per rank at dp=2, 4 at dp=1


CONFIG = ['model.name="faulty:build"', "model.seq_len=32", "model.rank=0", "model.mode=none", "model.at_call=0",
          "data.max_bytes=100000", f"train.steps={STEPS}", "train.warmup_steps=3", "train.global_batch_size=8",
          "train.micro_batch_size=2", "train.val_interval=0", "train.val_batches=1", "metrics.log_interval=1",
          "metrics.tensorboard=false", "parallel.threads_per_worker=1", "checkpoint.interval=4"]


def args(run_dir, nproc, *extra):
    return ["train", "--nproc", nproc, "--run-dir", run_dir, *[a for o in CONFIG for a in ("--set", o)], *extra]


def fault(rank, at_call, once_file, mode="kill"):
    """Overrides that make rank `rank` misbehave at its `at_call`-th forward (once, when once_file is set)."""
    once = ["--set", f'model.once_file="{once_file}"'] if once_file else []
    return ["--set", f"model.rank={rank}", "--set", f'model.mode="{mode}"', "--set", f"model.at_call={at_call}", *once]


def train(*a, timeout=180, expect=0):
    r = run_cli(list(a), timeout=timeout)
    assert r.returncode == expect, r.output
    return r


@pytest.fixture(scope="module")
def reference(tmp_path_factory, ranks):
    """Uninterrupted runs, per world size (in the harness: the same code as a CLI run's workers), with
    their run dirs."""
    out = {}
    for nproc in (1, 2):
        run_dir = tmp_path_factory.mktemp(f"ref{nproc}") / "run"
        ranks(nproc).run(train_on_ranks, CONFIG, str(run_dir))
        out[nproc] = (read_metrics(run_dir), read_weights(run_dir), run_dir)
    return out


def assert_bitwise(weights, ref):
    assert weights.keys() == ref.keys()
    for k in ref:
        assert torch.equal(weights[k], ref[k]), f"{k} differs from the uninterrupted run"


def losses_by_step(metrics):
    return {m["step"]: m["loss"] for m in metrics}  # a redone step appears twice; the last one counts


@pytest.mark.slow  # runs the CLI
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_killed_and_resumed_equals_uninterrupted(tmp_path, reference, mode):
    run_dir = tmp_path / "run"
    async_flag = ["--set", f"checkpoint.async={'true' if mode == 'async' else 'false'}"]
    kill_at = 9 * FORWARDS_PER_STEP + 1  # the first forward of step 10
    train(*args(run_dir, 2, *async_flag, *fault(1, kill_at, tmp_path / "fired")), expect=1)
    sealed = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if not p.name.endswith(".tmp"))
    # sync: step 8 is on disk before step 9 starts. async: step 8's save may still have been writing
    # when the process died, but starting it waited for step 4's, so step 4 is always sealed
    assert sealed == ["step_00000004", "step_00000008"] if mode == "sync" else sealed[:1] == ["step_00000004"]
    r = train(*args(run_dir, 2, *async_flag))
    assert f"(step {int(sealed[-1].split('_')[1])})" in r.stdout
    assert_bitwise(read_weights(run_dir), reference[2][1])
    assert losses_by_step(read_metrics(run_dir)) == losses_by_step(reference[2][0])


def crash_then_resume(env, crashing: list[str], clean: list[str], run_dir: str):
    """Train until the model raises, then train again in the same run dir (one process)."""
    try:
        train_on_ranks(env, crashing, run_dir)
    except RuntimeError as e:
        assert "injected failure" in str(e), e
    else:
        raise AssertionError("the injected failure did not happen")
    sealed = sorted(p.name for p in (Path(run_dir) / "checkpoints").iterdir() if not p.name.endswith(".tmp"))
    return sealed, train_on_ranks(env, clean, run_dir)[1]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_one_process_crashed_and_resumed_equals_uninterrupted(tmp_path, ranks, reference, mode):
    run_dir = tmp_path / "run"
    flag = f"checkpoint.async={'true' if mode == 'async' else 'false'}"
    crash = ["model.rank=0", 'model.mode="crash"', f"model.at_call={9 * 2 * FORWARDS_PER_STEP + 1}"]  # step 10
    [(sealed, out)] = ranks(1).run(crash_then_resume, [*CONFIG, flag, *crash], [*CONFIG, flag], str(run_dir))
    assert sealed[:1] == ["step_00000004"] and (mode == "async" or sealed[-1] == "step_00000008"), sealed
    # async: the process lives on after the crash, so step 8's save may be sealed by the time it resumes
    assert "(step 8)" in out or (mode == "async" and "(step 4)" in out), out
    assert_bitwise(read_weights(run_dir), reference[1][1])
    assert losses_by_step(read_metrics(run_dir)) == losses_by_step(reference[1][0])


def crash_then_resume_sealing_slowly(env, crashing: list[str], clean: list[str], run_dir: str):
    """crash_then_resume, every async save sealed a second after it is written: the crashed run's save of
    step 8 is still sealing in this process when the resumed run saves step 8 again."""
    from shoal.checkpoint import manager
    from shoal.checkpoint import manifest as mf
    from shoal.checkpoint.manager import CheckpointManager

    seal = CheckpointManager._seal_when_written

    def slowly(self, *args):
        time.sleep(1)
        seal(self, *args)

    CheckpointManager._seal_when_written = slowly
    try:
        with pytest.raises(RuntimeError, match="injected failure"):
            train_on_ranks(env, crashing, run_dir)
        train_on_ranks(env, clean, run_dir)
    finally:
        CheckpointManager._seal_when_written = seal
    for earlier in list(manager._SEALING.values()):  # whatever is still sealing in this process has ended
        earlier.exception()
    return [(c.step, c.problem) for c in mf.list_checkpoints(Path(run_dir) / "checkpoints")]


def test_a_save_still_sealing_after_a_crash_is_not_raced_by_the_resume(tmp_path, ranks, reference):
    """Seen once in a full suite: the resumed run removed step 8's .tmp while the crashed run's save (its
    process lives on) was renaming it. The resume now lets that save end first."""
    run_dir = tmp_path / "run"
    crash = ["model.rank=0", 'model.mode="crash"', f"model.at_call={9 * 2 * FORWARDS_PER_STEP + 1}"]  # step 10
    flag = "checkpoint.async=true"
    try:
        [saved] = ranks(1).run(crash_then_resume_sealing_slowly, [*CONFIG, flag, *crash], [*CONFIG, flag],
                               str(run_dir))
    finally:  # the crashed run's save and its checkpoint group outlive the call: let nothing of them reach other tests
        ranks(1).close()
    assert saved[-2:] == [(8, None), (12, None)], saved  # the resumed run's checkpoints, whole and valid
    assert_bitwise(read_weights(run_dir), reference[1][1])


@pytest.mark.slow  # runs the CLI
def test_sigkill_with_restarts_recovers_exactly(tmp_path, reference):
    """--max-restarts: torch elastic restarts the group, which resumes from the newest checkpoint (killed
    at a forward drawn from a fixed seed: any point of a step must do)."""
    rng = random.Random(20261121)
    for attempt in range(1):
        kill_at = rng.randrange(1, STEPS * FORWARDS_PER_STEP)
        run_dir = tmp_path / f"run{attempt}"
        r = train(*args(run_dir, 2, *fault(1, kill_at, tmp_path / f"fired{attempt}")), "--max-restarts", "2")
        assert_bitwise(read_weights(run_dir), reference[2][1])
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["restarts"] == 1, (kill_at, r.output)
        (rec,) = summary["recoveries"]
        step_killed = (kill_at - 1) // FORWARDS_PER_STEP + 1
        assert rec["resumed_from_step"] == (step_killed - 1) // 4 * 4, (kill_at, rec)
        # progress.json is written with each logged line, and a logged step is read a step late (while the
        # next is queued, unless a save makes it read at once): the failed attempt's last line is the step
        # before the killed one or the one before that, and the recovery counts from it
        failed = rec["failed_after_step"] or 0  # None: killed before its first line
        assert step_killed - 2 <= failed <= step_killed - 1, (kill_at, rec)
        assert failed == 0 or failed in [m["step"] for m in read_metrics(run_dir) if "loss" in m], rec
        assert rec["steps_redone"] == failed - rec["resumed_from_step"], (kill_at, rec)
        assert 0 < rec["seconds_lost"] < 60, rec
        parts = rec["breakdown_s"]  # the parts are consecutive spans of the seconds lost
        assert set(parts) == {"respawn", "startup", "restore", "first_step"} and min(parts.values()) >= 0, rec
        assert sum(parts.values()) == pytest.approx(rec["seconds_lost"], abs=1e-3), rec
        assert_report_draws_the_recovery(run_dir, tmp_path / f"report{attempt}.html")


def assert_report_draws_the_recovery(run_dir, out):
    """`shoal report` on a run that really recovered: the timeline shades the seconds lost and names the
    restart, the page's table lists it, and the checkpoints sit on the progress line."""
    import matplotlib

    matplotlib.use("Agg")
    from shoal.report import figures
    from shoal.report.data import load_run
    from shoal.report.page import render

    run = load_run(run_dir)
    fig = figures.timeline([run])
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.texts]
    assert any(t.startswith("restart 1: ") and t.endswith(" s lost") for t in labels), labels
    assert ax.patches, "the recovery's span is not drawn"
    assert ax.get_legend_handles_labels()[1][-2:] == ["checkpoint", "recovery (seconds lost)"]
    written = render([run_dir], out)
    assert out.with_name(f"{out.stem}-timeline.png") in written and "restart" in out.read_text()


def train_saying(env, overrides: list[str], run_dir: str) -> tuple[str, str]:
    """train_on_ranks, and what the rank printed on stderr too."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        _, out = train_on_ranks(env, overrides, run_dir)
    return out, err.getvalue()


def test_truncated_newest_checkpoint_falls_back_to_the_previous(tmp_path, ranks, reference):
    run_dir = tmp_path / "run"
    shutil.copytree(reference[2][2], run_dir)  # a finished run
    newest = run_dir / "checkpoints" / "step_00000012"
    shard = newest / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])  # a disk that filled up mid-write
    (run_dir / "model.safetensors").unlink()
    [(out, err), _] = ranks(2).run(train_saying, CONFIG, str(run_dir))
    lines = [line for line in err.splitlines() if "unusable" in line]
    assert lines == [f"shoal: checkpoint {newest} is unusable (__0_0.distcp has 100 bytes, the manifest says "
                     f"{json.loads((newest / 'manifest.json').read_text())['files']['__0_0.distcp']['bytes']}); "
                     f"trying the one before it"]
    assert "(step 8)" in out
    assert_bitwise(read_weights(run_dir), reference[2][1])


@pytest.mark.slow  # runs the CLI
def test_diloco_with_compressed_pseudo_gradient_killed_and_resumed_equals_uninterrupted(tmp_path, ranks):
    """DiLoCo (a round of 3 steps, int8 pseudo-gradient with error feedback): rank 1 killed at step 10,
    mid-round; the same command resumes from step 8 (mid-round too: each replica's own parameters and
    optimizer state, the anchor, the outer momentum and the codec's residuals come back from the
    ranks' own files) and ends bitwise where the uninterrupted run does."""
    mode = ['sync.mode="diloco"', "sync.every=3", "sync.outer_momentum=0.9", 'comm.compression="int8"']
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ranks(2).run(train_on_ranks, [*CONFIG, *mode], str(ref_dir))
    sets = [a for o in mode for a in ("--set", o)]
    train(*args(run_dir, 2, *sets, *fault(1, 9 * FORWARDS_PER_STEP + 1, tmp_path / "fired")), expect=1)
    assert (run_dir / "checkpoints" / "step_00000008" / "state_rank00001.safetensors").exists()
    r = train(*args(run_dir, 2, *sets))
    assert "(step 8)" in r.stdout
    assert_bitwise(read_weights(run_dir), read_weights(ref_dir))
    assert losses_by_step(read_metrics(run_dir)) == losses_by_step(read_metrics(ref_dir))
