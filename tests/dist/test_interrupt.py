"""SIGTERM (preemption) or Ctrl-C: the ranks agree on a step, save a checkpoint, exit 128 + signal;
running the same command again (as a scheduler's requeue does) continues the run in the same
directory and gives exactly the uninterrupted run."""

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import FIXTURES, read_weights, run_cli
from harness import train as train_on_ranks
from live_runs import stop_reached

STEPS = 30
HOLD = 20  # the workers hold themselves after this many steps (tests/fixtures/gate.py) while SIGTERM comes

# the tests' tiny GPT, one forward per step on each of 2 ranks
CONFIG = ['model.name="gate:build"', "model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.seq_len=32",
          "data.max_bytes=100000", f"train.steps={STEPS}", "train.global_batch_size=4", "train.micro_batch_size=2",
          "train.val_interval=0", "train.val_batches=1", "metrics.tensorboard=false", "parallel.threads_per_worker=1"]


def args(run_dir=None):
    return ["train", "--nproc", 2, *(["--run-dir", run_dir] if run_dir else []), *[a for o in CONFIG for a in ("--set", o)]]


@pytest.mark.slow  # runs the CLI
def test_sigterm_saves_and_the_same_command_resumes_exactly(tmp_path, ranks):
    ref = tmp_path / "ref"
    ranks(2).run(train_on_ranks, [*CONFIG, "metrics.progress=false"], str(ref))  # uninterrupted, in the harness
    work = tmp_path / "work"  # no --run-dir: the run goes to work/runs/run-<digest of the config>
    work.mkdir()
    gate = tmp_path / "gate"
    env = {**os.environ, "PYTHONPATH": str(FIXTURES), "SHOAL_TEST_GATE": str(gate), "SHOAL_TEST_HOLD_AT": str(HOLD + 1)}
    proc = subprocess.Popen([sys.executable, "-m", "shoal", *map(str, args())], cwd=work, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while not gate.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # to the launcher, as a scheduler or torchrun's parent would
    stop_reached(gate, 2)  # it reaches the held workers: they stop at the end of the step they are in
    gate.with_name(gate.name + ".released").touch()
    gate.unlink()
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode == 128 + signal.SIGTERM, err
    run_dir = next((work / "runs").iterdir())
    line = next(x for x in err.splitlines() if "stopped by SIGTERM after step" in x)
    step = int(line.split("after step ")[1].split(";")[0])
    # the signal reaches step HOLD + 1's flags; that step is not logged, so they are read once the next one
    # is queued, and the run stops at the end of that one: within one step
    assert step == HOLD + 2, line
    assert f"checkpoint {Path('runs') / run_dir.name / 'checkpoints' / f'step_{step:08d}'}" in line
    command = line.split("to resume, run: ")[1]
    assert command == "shoal " + " ".join(shlex.quote(str(a)) for a in args()), line
    assert "Traceback" not in err
    r = run_cli(args(), timeout=180, cwd=work)  # the same command, in the same place
    assert r.returncode == 0 and f"(step {step})" in r.stdout, r.output
    assert [p.name for p in (work / "runs").iterdir()] == [run_dir.name]  # the same run dir, no other
    ours, theirs = read_weights(run_dir), read_weights(ref)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
