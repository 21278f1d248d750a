"""When checkpoints are written: at the end, every `checkpoint.interval` steps, and, by default, every
10 minutes (`checkpoint.interval_minutes`), so a crash costs at most that much work. Clocks differ
between ranks: one rank's wish to save rides on the step's flags, and every rank saves that step."""

import json

import pytest

from harness import train
from shoal.checkpoint import manager
from shoal.comm.collectives import Comm
from shoal.config import CheckpointConfig, load_config

SMALL = ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.seq_len=16", "data.max_bytes=50000",
         "train.steps=8", "train.global_batch_size=4", "train.micro_batch_size=2", "train.val_interval=0",
         "train.val_batches=1", "metrics.tensorboard=false", "metrics.progress=false"]


def test_the_default_cadence_is_ten_minutes(tmp_path, monkeypatch):
    cfg = load_config(None, []).checkpoint
    assert (cfg.enabled, cfg.interval, cfg.interval_minutes) == (True, 0, 10.0)
    now = [1000.0]
    monkeypatch.setattr(manager.time, "monotonic", lambda: now[0])
    ckpt = manager.CheckpointManager(tmp_path, cfg, Comm())
    now[0] += 9 * 60
    assert not ckpt.wants_save() and not ckpt.due(5, last=False)
    now[0] += 60
    assert ckpt.wants_save() and ckpt.due(5, last=False, by_time=True)
    assert ckpt.due(7, last=True)  # the end always saves
    assert not manager.CheckpointManager(tmp_path, CheckpointConfig(interval_minutes=0), Comm()).wants_save()
    steps_only = manager.CheckpointManager(tmp_path, CheckpointConfig(interval=4, interval_minutes=0), Comm())
    assert [s for s in range(1, 13) if steps_only.due(s, last=False)] == [4, 8, 12]


def train_where_one_clock_says_save(env, overrides, run_dir, rank, at_call):
    """Only `rank` wants a checkpoint, at its `at_call`-th step; the others' clocks say nothing."""
    calls = [0]

    def wants_save(self):
        calls[0] += 1
        return env.rank == rank and calls[0] == at_call

    original = manager.CheckpointManager.wants_save
    manager.CheckpointManager.wants_save = wants_save
    try:
        return train(env, overrides, run_dir)
    finally:
        manager.CheckpointManager.wants_save = original


@pytest.mark.parametrize("rank", [0, 1])
def test_one_rank_s_clock_makes_every_rank_save_the_same_step(tmp_path, ranks, rank):
    results = ranks(2).run(train_where_one_clock_says_save, SMALL, str(tmp_path / "run"), rank, 3)
    for summary, _ in results:
        # step 3's flags carry the wish; a step that is not logged is read once the next one is queued, so
        # the ranks save at the end of step 4 (by time), and step 8 is the end
        assert [c["step"] for c in summary["checkpoints"]] == [4, 8]
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert saved == ["step_00000004", "step_00000008"]
    manifest = json.loads((tmp_path / "run" / "checkpoints" / "step_00000004" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and "rng_rank00001.json" in manifest["files"]  # both ranks wrote it
