"""Error feedback across a change of the world size: every rank of the new world takes the mean of the old
ranks' residuals, the same bits whether they come from a checkpoint's files (a resume on another world
size) or over a live group (live/snapshot.py's pooled()); a member that gives none (a joiner) or is lost
counts as zero. In the harness, on 2-3 ranks."""

import pytest
import torch
from safetensors.torch import load_file

from harness import train as train_on_ranks

# the tests' tiny GPT with int8 compression and a constant learning rate
INT8 = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.seq_len=32", "data.max_bytes=200000",
        "train.val_batches=2", "metrics.tensorboard=false", "metrics.progress=false", "train.warmup_steps=0",
        "train.min_lr_ratio=1.0", "train.global_batch_size=12", "train.micro_batch_size=2", "train.val_interval=0",
        "train.steps=4", "checkpoint.interval=4", 'comm.compression="int8"', "parallel.threads_per_worker=1"]


def restored_rank_tensors(env, overrides, run_dir):
    """Resume `run_dir` (finished: nothing more is trained) and return the rank tensors its step
    synchronisation was given back."""
    from shoal.parallel.sync import EveryStep

    got = {}
    load = EveryStep.load_rank_state

    def spy(self, tensors):
        got.update(tensors or {})
        load(self, tensors)

    EveryStep.load_rank_state = spy
    try:
        train_on_ranks(env, overrides, run_dir)
    finally:
        EveryStep.load_rank_state = load
    return got


def test_a_resume_on_another_world_size_gives_every_rank_the_mean_residual(tmp_path, ranks):
    run_dir = tmp_path / "run"
    ranks(3).run(train_on_ranks, INT8, str(run_dir))
    saved = [load_file(run_dir / "checkpoints" / "step_00000004" / f"state_rank{r:05d}.safetensors") for r in range(3)]
    keys = [k for k in saved[0] if k.startswith("sync/residual/")]
    assert keys and all(saved[0][k].abs().sum() > 0 for k in keys)
    for got in ranks(2).run(restored_rank_tensors, INT8, str(run_dir)):
        assert sorted(got) == sorted(k.removeprefix("sync/") for k in keys)
        for k in keys:
            mean = (saved[0][k] + saved[1][k] + saved[2][k]) / 3
            torch.testing.assert_close(got[k.removeprefix("sync/")], mean, rtol=0, atol=1e-7)


def pool_on_ranks(env, giving):
    """pooled() over the live group: rank r holds a residual of (r + 1) x [1, -2, 4] taken in a world of 3
    and gives it when `giving[r]`; returns what each rank goes on with, and the merge of the same tensors
    as a resume from their files would make it."""
    from shoal.checkpoint.train_state import TrainState
    from shoal.comm.codecs import Int8
    from shoal.comm.collectives import Comm
    from shoal.parallel.sync import EveryStep
    from shoal.live.snapshot import Snapshot, pooled

    state = TrainState(None, None, {"sync": EveryStep(Int8(comm=None))})
    mine = {"sync/residual/w": torch.tensor([1.0, -2.0, 4.0]) * (env.rank + 1) / 7}
    snap = Snapshot(5, {"model/w": torch.zeros(3), **{f"rank/{k}": v for k, v in mine.items()}},
                    {"world": 3, "rank": env.rank})
    got = pooled(Comm(env.store, env.rank, env.world_size), state, snap, gives=giving[env.rank], device=env.device)
    givers = [r for r in range(3) if giving[r]]
    from_files = state.merge_rank_tensors(
        [{"sync/residual/w": torch.tensor([1.0, -2.0, 4.0]) * (r + 1) / 7} for r in givers], 3)
    return got.tensors, got.meta, from_files


@pytest.mark.parametrize("giving", [(True, True, True), (True, False, True)], ids=["every-rank", "one-gives-none"])
def test_live_merge_equals_the_files_merge(ranks, giving):
    for tensors, meta, from_files in ranks(3).run(pool_on_ranks, list(giving)):
        assert torch.equal(tensors["rank/sync/residual/w"], from_files["sync/residual/w"])  # bitwise
        expected = torch.tensor([1.0, -2.0, 4.0]) * sum(r + 1 for r in range(3) if giving[r]) / 7 / 3
        torch.testing.assert_close(tensors["rank/sync/residual/w"], expected)
        assert meta["pooled"] and torch.equal(tensors["model/w"], torch.zeros(3))
