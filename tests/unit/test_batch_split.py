"""The batch split of parallel.balance = "throughput": proportional to the ranks' throughputs, summing
to the global batch, at least one sample each, a pure function of its inputs; and the sampler's cut
of the global batch by those shares covers the same samples as the uniform split."""

import pytest
import torch

from shoal.data.sampler import GlobalBatchSampler
from shoal.parallel.balance import split_batch


@pytest.mark.parametrize("batch, rates, want", [
    (16, [1.0, 1.0], [8, 8]),
    (16, [2.0, 1.0], [11, 5]),  # 10.67 and 5.33: the larger remainder rounds up
    (12, [1.0, 1.0, 1.0, 3.0], [2, 2, 2, 6]),
    (4, [1000.0, 1.0, 1.0, 1.0], [1, 1, 1, 1]),  # every rank keeps a sample
    (10, [1.0, 1.0, 1.0], [4, 3, 3]),  # ties go to the lower rank
])
def test_split_is_proportional_and_whole(batch, rates, want):
    counts = split_batch(batch, rates)
    assert counts == want and sum(counts) == batch and min(counts) >= 1
    assert split_batch(batch, list(rates)) == counts  # deterministic


def test_split_follows_throughput_closely():
    counts = split_batch(1000, [3.0, 1.0, 0.5])
    assert sum(counts) == 1000
    for c, r in zip(counts, [3.0, 1.0, 0.5], strict=True):
        assert abs(c - 1000 * r / 4.5) <= 1.5


@pytest.mark.parametrize("batch, rates, match", [(2, [1.0, 1.0, 1.0], "cannot give each of 3 dp ranks"),
                                                 (8, [1.0, 0.0], "positive and finite"),
                                                 (8, [1.0, float("nan")], "positive and finite")])
def test_split_refuses_in_one_line(batch, rates, match):
    with pytest.raises(ValueError, match=match) as e:
        split_batch(batch, rates)
    assert "\n" not in str(e.value)


def test_uneven_shares_cover_the_global_batch():
    s = GlobalBatchSampler(50, 16, seed=3)
    uneven = [mb for r in range(2) for mb in s.local_micro_batches(4, r, 2, 4, shares=[11, 5])]
    assert [len(mb) for mb in uneven] == [4, 4, 3, 4, 1]  # rank 0: 4+4+3, rank 1: 4+1
    uniform = [mb for r in range(2) for mb in s.local_micro_batches(4, r, 2, 4)]
    assert torch.equal(torch.cat(uneven), torch.cat(uniform))
    with pytest.raises(ValueError, match="do not split"):
        s.local_micro_batches(4, 0, 2, 4, shares=[11, 6])
