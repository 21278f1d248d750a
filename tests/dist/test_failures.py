"""A crashed or hung rank ends the run with an error that names the rank, never a hang."""

import re
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


def test_hung_rank_is_named_in_a_collective_report(tmp_path):
    """Rank 1 stalls in its 3rd forward, so it never enters that step's gradient all-reduce."""
    t0 = time.monotonic()
    r = run_cli(["train", "--nproc", "2", "--run-dir", tmp_path / "run", *FAULTY, "--set", 'model.mode="hang"',
                 "--set", "parallel.timeout_s=5"], timeout=120)
    elapsed = time.monotonic() - t0
    assert r.returncode == 1, r.output
    report = r.stderr[r.stderr.index("shoal: collective #"):].splitlines()[:3]
    assert re.match(r"shoal: collective #(\d+) all_reduce\(dp, gradient bucket 0: \[\d+\] float32\) failed on rank 0 "
                    r"after 5\.\d s: Timed out waiting 5000ms for recv operation to complete", report[0]), report
    seq = re.match(r"shoal: collective #(\d+)", report[0]).group(1)
    assert report[1].startswith(f"  rank 0: waiting in #{seq} all_reduce"), report
    assert report[2].startswith(f"  rank 1: DID NOT ARRIVE at #{seq} all_reduce; last entered #{int(seq) - 1} "), report
    assert "was at faulty.py:" in report[2] and "in faulty_forward" in report[2], report
    assert "shoal: rank 0" in r.stderr and "failed with exit code 1: RuntimeError: collective #" in r.stderr
    # process start (a few s) + the 5 s timeout + the report: well within timeout + 10 s of the hang
    assert elapsed < 5 + 10 + 15, f"took {elapsed:.0f} s"
