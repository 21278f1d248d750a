import time

import numpy as np
import pytest
import torch

from shoal.data.loader import Prefetcher
from shoal.data.sampler import GlobalBatchSampler


def test_global_batch_is_a_pure_function_of_seed_and_step():
    a, b = GlobalBatchSampler(1000, 32, seed=7), GlobalBatchSampler(1000, 32, seed=7)
    for step in (5, 0, 40, 5):  # any order, any instance: the same answer
        assert torch.equal(a.global_indices(step), b.global_indices(step))
    assert not torch.equal(a.global_indices(0), GlobalBatchSampler(1000, 32, seed=8).global_indices(0))


def test_each_epoch_visits_every_sample_once():
    s = GlobalBatchSampler(100, 20, seed=0)  # 5 steps per epoch
    for epoch in range(3):
        seen = torch.cat([s.global_indices(epoch * 5 + k) for k in range(5)])
        assert sorted(seen.tolist()) == list(range(100))


def test_batch_spanning_two_epochs():
    s = GlobalBatchSampler(10, 4, seed=3)  # step 2 covers positions 8..11: two of epoch 0, two of epoch 1
    idx = s.global_indices(2).tolist()
    perm0 = np.random.default_rng([3, 0]).permutation(10)
    perm1 = np.random.default_rng([3, 1]).permutation(10)
    assert idx == [perm0[8], perm0[9], perm1[0], perm1[1]]


@pytest.mark.parametrize("dp,micro", [(1, 24), (1, 6), (2, 6), (4, 3), (3, 8)])
def test_ranks_and_micro_batches_tile_the_global_batch(dp, micro):
    s = GlobalBatchSampler(500, 24, seed=1)
    parts = [mb for r in range(dp) for mb in s.local_micro_batches(9, r, dp, micro)]
    assert all(len(p) == micro for p in parts)
    assert torch.equal(torch.cat(parts), s.global_indices(9))


def test_position_round_trips_and_converts_between_batch_sizes():
    s = GlobalBatchSampler(1000, 32, seed=1)
    s.step = 12
    t = GlobalBatchSampler(1000, 32, seed=1)
    t.load_state_dict(s.state_dict())
    assert t.step == 12 and torch.equal(t.global_indices(t.step), s.global_indices(12))
    u = GlobalBatchSampler(1000, 64, seed=1)  # same stream position, a larger global batch
    u.load_state_dict(s.state_dict())
    assert u.step == 6
    with pytest.raises(ValueError, match="same data and seed"):
        GlobalBatchSampler(1000, 32, seed=2).load_state_dict(s.state_dict())


@pytest.mark.parametrize("depth", [0, 2])
def test_prefetcher_yields_steps_in_order(depth):
    p = Prefetcher(lambda step: [{"x": torch.tensor([step])}], start=3, depth=depth)
    try:
        assert [int(p.next()[0]["x"]) for _ in range(5)] == [3, 4, 5, 6, 7]
        assert p.last_wait_s >= 0
    finally:
        p.close()


def test_prefetcher_raises_loader_errors_in_the_training_thread():
    def make(step):
        if step == 2:
            raise OSError("disk went away")
        return [{"x": torch.tensor([step])}]

    p = Prefetcher(make, start=0, depth=2)
    p.next(), p.next()
    with pytest.raises(OSError, match="disk went away"):
        p.next()
    p.close()


def test_the_prefetcher_builds_ahead_when_released():
    """A released batch is built while the step runs (its last backward); a consumer that never releases gets
    its batches all the same, each built when the one before is taken."""
    import threading

    built: list[int] = []
    ready = threading.Condition()

    def make(step):
        with ready:
            built.append(step)
            ready.notify_all()
        return [{"x": torch.tensor([step])}]

    def wait_built(n):
        with ready:
            assert ready.wait_for(lambda: len(built) >= n, timeout=10), built

    p = Prefetcher(make, start=0, depth=2)
    try:
        wait_built(2)  # `depth` steps ahead at once
        assert int(p.next()[0]["x"]) == 0
        time.sleep(0.05)
        assert built == [0, 1]  # nothing more until the step says so
        p.release()
        wait_built(3)
        p.release()  # once per batch taken: a second release adds nothing
        time.sleep(0.05)
        assert built == [0, 1, 2]
        assert [int(p.next()[0]["x"]) for _ in range(4)] == [1, 2, 3, 4]  # never released: built on taking
    finally:
        p.close()


def test_prefetch_auto_builds_light_batches_in_the_training_thread():
    from shoal.data.loader import AUTO_DEPTH, prefetch_depth

    class Tokens:
        light_batches = True

    assert prefetch_depth("auto", Tokens()) == 0
    assert prefetch_depth("auto", object()) == AUTO_DEPTH  # images, a user's source: a thread
    assert prefetch_depth(3, Tokens()) == 3
