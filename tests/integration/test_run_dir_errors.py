"""Problems with the run dir or the checkpoint to resume are found at start: one line, exit 2; a fresh
start over an earlier run keeps that run."""

import shutil
import sys
from collections import namedtuple

import pytest

from conftest import TINY_GPT, run_cli
from harness import train as train_on_ranks
from shoal.cli import main

SMALL = [*TINY_GPT, "--set", "train.steps=2", "--set", "train.global_batch_size=4", "--set", "train.micro_batch_size=2"]


def error_of(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("shoal: error: ") and err.count("\n") == 1, err
    return err


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, ranks):
    """A finished one-process run of SMALL (trained in the harness, as a worker trains it)."""
    run_dir = tmp_path_factory.mktemp("done") / "run"
    ranks(1).run(train_on_ranks, SMALL[1::2], str(run_dir))
    return run_dir


def test_resume_into_a_different_model_names_the_key(finished_run, capsys):
    err = error_of(["train", "--run-dir", str(finished_run), *SMALL, "--set", "model.d_model=64"], capsys)
    assert "model.d_model is 64 here but 32 in checkpoint step_00000002" in err and "--resume never" in err


def test_resume_with_another_seed_is_refused(finished_run, capsys):
    assert "train.seed is 7 here but 1337" in error_of(
        ["train", "--run-dir", str(finished_run), *SMALL, "--set", "train.seed=7"], capsys)


def test_resume_from_a_path_that_is_no_checkpoint(finished_run, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    err = error_of(["train", "--run-dir", str(tmp_path / "new"), *SMALL, "--resume", str(tmp_path / "empty")], capsys)
    assert "not a usable checkpoint: no manifest" in err


def test_unwritable_run_dir(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert "is not writable" in error_of(["train", "--run-dir", str(tmp_path / "file" / "run"), *SMALL], capsys)


def test_full_disk(tmp_path, capsys, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    err = error_of(["train", "--run-dir", str(tmp_path / "run"), *SMALL], capsys)
    assert "has 0 MiB free, but this run needs about" in err and "checkpoint.keep" in err


def test_resume_never_moves_the_earlier_run_aside(finished_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    r = run_cli(["train", "--run-dir", run_dir, *SMALL, "--resume", "never"], timeout=120)
    assert r.returncode == 0, r.output
    (moved,) = [p for p in tmp_path.iterdir() if p.name.startswith("run-replaced-")]
    assert f"the earlier run in {run_dir} was moved to {moved}" in r.stderr
    assert (moved / "checkpoints" / "step_00000002").is_dir() and (moved / "model.safetensors").is_file()
    assert "resumed from" not in r.stdout and (run_dir / "checkpoints" / "step_00000002").is_dir()


def test_the_same_command_on_a_finished_run_trains_nothing_and_says_so(finished_run, capsys):
    summary = (finished_run / "summary.json").read_text()
    assert main(["train", "--run-dir", str(finished_run), *SMALL]) == 0  # returns before any worker starts
    out = capsys.readouterr().out
    assert f"{finished_run} already holds this run, finished at step 2 of train.steps = 2: nothing to train" in out
    assert (finished_run / "summary.json").read_text() == summary  # its results are left as they were


def test_a_torchrun_launch_on_a_finished_run_trains_nothing_and_says_so(finished_run):
    """torchrun skips `shoal train`'s pre-launch check: the workers find the finished run themselves."""
    summary = (finished_run / "summary.json").read_text()
    metrics = (finished_run / "metrics.jsonl").read_text()
    r = run_cli(["--standalone", "--nproc-per-node", "1", "-m", "shoal", "train", "--run-dir", finished_run, *SMALL],
                timeout=120, launcher=[sys.executable, "-m", "torch.distributed.run"])
    assert r.returncode == 0, r.output
    assert f"{finished_run} already holds this run, finished at step 2 of train.steps = 2: nothing to train" in r.stdout
    assert (finished_run / "summary.json").read_text() == summary
    assert (finished_run / "metrics.jsonl").read_text() == metrics  # no step trained again
