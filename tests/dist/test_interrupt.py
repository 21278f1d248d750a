"""SIGTERM (preemption) or Ctrl-C: the ranks agree on a step, save a checkpoint, exit 128 + signal;
resuming then gives exactly the uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import time

import torch

from conftest import FIXTURES, ROOT, read_weights, run_cli

STEPS = 300


def args(run_dir):
    return ["train", "--nproc", 2, "--run-dir", run_dir, "--set", 'model.name="faulty:build"', "--set", "model.seq_len=32",
            "--set", "model.rank=0", "--set", 'model.mode="none"', "--set", "model.at_call=0",
            "--set", "data.max_bytes=100000", "--set", f"train.steps={STEPS}", "--set", "train.global_batch_size=4",
            "--set", "train.micro_batch_size=2", "--set", "train.val_interval=0", "--set", "train.val_batches=1",
            "--set", "metrics.tensorboard=false", "--set", "parallel.threads_per_worker=1"]


def test_sigterm_saves_and_resumes_exactly(tmp_path):
    ref = tmp_path / "ref"
    assert run_cli(args(ref), timeout=180).returncode == 0
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(FIXTURES)}
    proc = subprocess.Popen([sys.executable, "-m", "shoal", *map(str, args(run_dir))], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    progress = run_dir / "progress.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if json.loads(progress.read_text())["step"] >= 20:
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # to the launcher, as a scheduler or torchrun's parent would
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode == 128 + signal.SIGTERM, err
    line = next(x for x in err.splitlines() if "stopped by SIGTERM after step" in x)
    step = int(line.split("after step ")[1].split(";")[0])
    assert 20 <= step < STEPS, line
    assert f"checkpoint {run_dir / 'checkpoints' / f'step_{step:08d}'}" in line
    assert "Traceback" not in err
    r = run_cli(args(run_dir), timeout=180)
    assert r.returncode == 0 and f"(step {step})" in r.stdout, r.output
    ours, theirs = read_weights(run_dir), read_weights(ref)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
