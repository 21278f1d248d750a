"""The harness's own failure report: when one rank fails, every rank's outcome is shown. The first reply is
often a peer's "connection closed by peer" (it only saw the rank that failed leave); the cause is the other
rank's traceback or exit code."""

import os

import pytest
import torch
import torch.distributed as dist

from harness import Ranks


def raise_on_rank_1(env):
    if env.rank == 1:
        raise ValueError("the cause, on rank 1")
    dist.all_reduce(torch.ones(1))  # rank 0 fails here once rank 1 has left
    return env.rank


def exit_on_rank_1(env):
    if env.rank == 1:
        os._exit(7)
    dist.all_reduce(torch.ones(1))
    return env.rank


@pytest.mark.parametrize("fn,cause", [(raise_on_rank_1, "ValueError: the cause, on rank 1"),
                                      (exit_on_rank_1, "rank 1: its process died (exit code 7)")])
def test_a_failure_shows_every_rank_s_outcome(fn, cause):
    ranks = Ranks(2)
    try:
        with pytest.raises(pytest.fail.Exception) as failed:
            ranks.run(fn, timeout=60, pg_timeout=20)
    finally:
        ranks.close(kill=True)
    report = str(failed.value)
    assert "--- rank 0:" in report and "--- rank 1:" in report
    assert cause in report, report
