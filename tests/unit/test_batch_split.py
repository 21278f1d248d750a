"""The batch split of balance.mode = "throughput": proportional to the ranks' throughputs, summing
to the global batch, at least one sample each, a pure function of its inputs; and the sampler's cut
of the global batch by those shares covers the same samples as the uniform split."""

import json

import pytest
import torch

from shoal.data.sampler import GlobalBatchSampler
from shoal.parallel.balance import ThroughputBalance, split_batch


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


class FakeComm:
    """The all-gather of the ranks' throughputs, answered with fixed numbers."""

    def __init__(self, rates):
        self.rates, self.calls = rates, 0

    def all_gather_flat(self, t, group=None, label=""):
        self.calls += 1
        return torch.tensor(self.rates, dtype=torch.float64)


def test_agreed_split_starts_after_the_prefetched_steps_and_resumes_as_decided():
    comm = FakeComm([300.0, 100.0])
    b = ThroughputBalance(16, 2, 0, interval=2, lag=3, comm=comm, dp_group=None, clock=None)
    assert b.after_step(1) == {"batch_share": [8, 8]} and comm.calls == 0  # not an agreement step
    m = b.after_step(2)
    assert comm.calls == 1 and m["rank_samples_per_s"] == [300.0, 100.0]
    assert [b.split_for(s) for s in range(4, 7)] == [[8, 8], [12, 4], [12, 4]]  # from step 2 + lag on
    comm.rates = [100.0, 100.0]
    b.after_step(4)
    assert [b.split_for(s) for s in (4, 5, 6, 7)] == [[8, 8], [12, 4], [12, 4], [8, 8]]
    resumed = ThroughputBalance(16, 2, 1, interval=2, lag=3, comm=comm, dp_group=None, clock=None)
    resumed.load_state_dict(json.loads(json.dumps(b.state_dict())))  # train_state.json's round trip
    assert [resumed.split_for(s) for s in range(4, 12)] == [b.split_for(s) for s in range(4, 12)]
    assert resumed.mine == 100.0  # re-measuring starts from this rank's agreed throughput
    other = ThroughputBalance(16, 4, 1, interval=2, lag=3, comm=comm, dp_group=None, clock=None)
    other.load_state_dict(b.state_dict())  # another dp degree: measured afresh
    assert other.split_for(9) == [4, 4, 4, 4]


def test_no_agreement_until_every_rank_has_measured():
    b = ThroughputBalance(16, 2, 0, interval=1, lag=1, comm=FakeComm([float("nan"), 50.0]), dp_group=None,
                          clock=None)
    assert "rank_samples_per_s" not in b.after_step(1) and b.split_for(5) == [8, 8]
