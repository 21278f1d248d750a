"""A crashed or hung rank ends the run with an error that names the rank, never a hang."""

import time

from conftest import run_cli

FAULTY = ["--set", 'model.name="faulty:build"', "--set", "model.seq_len=32", "--set", "model.rank=1",
          "--set", "model.at_call=3", "--set", "data.max_bytes=100000", "--set", "train.steps=10",
          "--set", "train.global_batch_size=4", "--set", "train.micro_batch_size=2",
          "--set", "metrics.tensorboard=false", "--set", "parallel.threads_per_worker=1"]


def test_crashed_rank_fails_the_run_with_its_traceback(tmp_path):
    r = run_cli(["train", "--nproc", "2", "--run-dir", tmp_path / "run", *FAULTY, "--set", "model.mode=crash"],
                timeout=120)
    assert r.returncode == 1
    assert "RuntimeError: injected failure on rank 1" in r.stderr  # the rank's own traceback
    assert "faulty.py" in r.stderr
    assert "shoal: rank 1" in r.stderr and "injected failure on rank 1" in r.stderr.splitlines()[-1]


def test_hung_rank_times_out_the_collective(tmp_path):
    t0 = time.monotonic()
    r = run_cli(["train", "--nproc", "2", "--run-dir", tmp_path / "run", *FAULTY, "--set", "model.mode=hang",
                 "--set", "parallel.timeout_s=5"], timeout=120)
    elapsed = time.monotonic() - t0
    assert r.returncode == 1, r.output
    assert "shoal: rank 0" in r.stderr and "[rank 0]" in r.stderr
    assert "timed out" in r.stderr.lower(), r.stderr
    assert "in faulty_forward" in r.stderr, "the hung rank's stack should be printed when it is stopped"
    assert elapsed < 60, f"the 5 s collective timeout should end the run well within a minute, took {elapsed:.0f} s"
