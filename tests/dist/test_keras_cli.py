"""`shoal train` with a Keras model, as a user runs it: nothing set in the environment (shoal sets
KERAS_BACKEND=torch where it imports the user's module, in the launcher and in each worker), two ZeRO 2
workers; and a KERAS_BACKEND naming another backend refused in one line, exit 2."""

import importlib.util

import pytest

from conftest import read_weights, run_cli

if importlib.util.find_spec("keras") is None:
    pytest.skip("the keras extra is not installed", allow_module_level=True)

ARGS = ["--set", 'model.name="keras_user.models:cnn"', "--set", 'data.source="synthetic-images"',
        "--set", "data.num_samples=256", "--set", "train.steps=3", "--set", "train.global_batch_size=8",
        "--set", "train.micro_batch_size=4", "--set", "train.val_batches=1", "--set", "metrics.tensorboard=false",
        "--set", "parallel.threads_per_worker=1"]


def test_shoal_train_runs_a_keras_model_on_two_zero2_workers(tmp_path):
    r = run_cli(["train", "--nproc", 2, "--run-dir", tmp_path / "run", *ARGS, "--set", "parallel.zero=2"],
                timeout=240, env={"KERAS_BACKEND": ""})  # empty: unset, as Keras reads it
    assert r.returncode == 0, r.output
    assert "done: 3 steps" in r.output, r.output
    assert "sequential/dense/kernel" in read_weights(tmp_path / "run")


def test_another_keras_backend_is_refused_in_one_line(tmp_path):
    r = run_cli(["train", "--nproc", 2, "--run-dir", tmp_path / "run", *ARGS], timeout=120,
                env={"KERAS_BACKEND": "tensorflow"})
    assert r.returncode == 2, r.output
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "KERAS_BACKEND=tensorflow, but shoal trains Keras models on torch; set " \
                                "KERAS_BACKEND=torch" in lines[0], r.stderr
    assert not (tmp_path / "run").exists()
