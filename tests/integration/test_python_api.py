"""`shoal.train(...)` from Python: the command's path (validation, preflight, the elastic launch of
separate worker processes), the summary returned, the same one-line errors raised."""

import os

import pytest

import shoal
from conftest import FIXTURES


def test_train_from_python_with_a_builder_passed_as_a_callable(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))  # faulty.py: here, and (below) in the workers
    monkeypatch.setenv("PYTHONPATH", f"{FIXTURES}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    from faulty import build

    # no nproc: the scheduler's environment says it, as for the command (a PyTorchJob's variables here)
    monkeypatch.setenv("PET_NNODES", "1")
    monkeypatch.setenv("PET_NPROC_PER_NODE", "2")
    env = dict(os.environ)
    summary = shoal.train(overrides={"model.name": build, "model.seq_len": 32, "model.mode": "none",
                                     "model.rank": 0, "model.at_call": 0, "data.max_bytes": 100_000,
                                     "train.steps": 4, "train.global_batch_size": 8, "train.micro_batch_size": 2,
                                     "train.val_interval": 0, "train.val_batches": 1, "metrics.progress": False,
                                     "metrics.tensorboard": False},
                          run_dir=tmp_path / "run")
    assert summary["steps"] == 4 and summary["world_size"] == 2
    assert (tmp_path / "run" / "model.safetensors").exists()
    assert "faulty:build" in (tmp_path / "run" / "config.toml").read_text()
    assert dict(os.environ) == env  # the launch's variables were for the workers
    from shoal.training import loop  # the loop's package has a name of its own: shoal.train stays the function

    assert callable(shoal.train) and shoal.train is shoal.api.train and shoal.training.loop is loop


def test_train_from_python_raises_the_commands_one_line_errors(tmp_path):
    with pytest.raises(shoal.UserError, match=r"train.lr = 0: must be greater than 0"):
        shoal.train(overrides={"train.lr": 0}, run_dir=tmp_path / "run")

    def local_builder(cfg, spec):
        return None

    with pytest.raises(shoal.UserError, match="cannot be imported by the workers"):
        shoal.train(overrides={"model.name": local_builder}, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()
