"""A crashed or hung rank ends the run with an error that names the rank, never a hang."""

import re
import time

import pytest

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


STALL = ["--set", 'model.name="stall:build"', "--set", "model.seq_len=32", "--set", "model.rank=1",
         "--set", "model.at_call=3", "--set", "data.max_bytes=100000", "--set", "train.steps=10",
         "--set", "train.global_batch_size=4", "--set", "train.micro_batch_size=2", "--set", "train.val_interval=0",
         "--set", "metrics.tensorboard=false", "--set", "parallel.threads_per_worker=1", "--set", "parallel.timeout_s=3"]
LAYOUTS = {"dp2": [], "dp2-zero3": ["--set", "parallel.zero=3"], "tp2": ["--set", "parallel.tp=2"],
           "pp2": ["--set", "parallel.pp=2"], "dp2-ep2": ["--set", "model.experts=4", "--set", "parallel.ep=2"],
           "cp2": ["--set", "parallel.cp=2"]}


@pytest.mark.serial  # a 3 s collective timeout, and the run must end within 13 s of the stall
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_stalled_rank_is_named_under_every_layout(tmp_path, layout):
    """Rank 1 stalls inside a transformer block's forward. The others wait in whatever collective comes
    next: DDP's gradient all-reduce, FSDP2's all-gather, DTensor's all-reduce, a pipeline recv, expert
    parallelism's all-to-all, context parallelism's gather of keys and values. The report must name rank 1, and the run must end within parallel.timeout_s (3 s) + 10 s of the stall."""
    mark = tmp_path / "stalled_at"
    r = run_cli(["train", "--nproc", "2", "--run-dir", tmp_path / "run", *STALL, "--set", f'model.mark_file="{mark}"',
                 *LAYOUTS[layout]], timeout=120)
    ended = time.time()
    assert r.returncode == 1, r.output
    report = r.stderr[r.stderr.index("shoal: collective "):].splitlines()[:3]
    assert re.match(r"shoal: collective .+ during .+ failed on rank 0 after .+: Timed out waiting 3000ms", report[0]), report
    assert report[1].startswith("  rank 0: waiting in "), report
    assert report[2].startswith("  rank 1: DID NOT ARRIVE"), report
    assert "was at stall.py:" in report[2] and "in stalling_forward" in report[2], report
    assert "during forward of blocks.1, step " in report[2], report
    assert "shoal: rank 0" in r.stderr and "failed with exit code 1: RuntimeError: collective " in r.stderr
    assert ended - float(mark.read_text()) < 3 + 10, "the run must end within timeout + 10 s of the stall"
