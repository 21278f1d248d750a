"""comm/report.py's verdict per rank, from statuses as the watchdogs publish them."""

from shoal.comm.report import collective_report


def status(enqueued: int, completed: int, blocked: str | None, where: str) -> dict:
    return {"blocked": blocked, "blocked_since": None, "where": where, "phase": "the script", "time": 0.0,
            "last": None, "in_flight": None,
            "groups": {"0": {"name": "0", "desc": "default_pg", "ranks": [0, 1], "last_op": "all_reduce ([161])",
                             "enqueued": enqueued, "completed": completed}}}


def test_a_rank_behind_on_the_recorder_count_is_named_even_when_the_waiting_ranks_count_lags():
    """Rank 0 waits in its 10th collective; its completed count says 6 (gloo's can lag: #7-#9 completed on
    both ranks). Rank 1 entered 9 and sleeps in its own code: it did not arrive at #10."""
    mine = status(10, 6, "torch _tensor.py in backward", "train.py:32 in main")
    theirs = status(9, 9, None, "train.py:21 in stall")
    report = collective_report(mine, 0, {0: mine, 1: theirs}, RuntimeError("Timed out waiting 3000ms"), "3 s")
    lines = report.splitlines()
    assert "[all_reduce ([161]) on group default_pg, #10 there]" in lines[0], lines[0]
    assert lines[1].startswith("  rank 0: waiting in torch _tensor.py in backward"), lines[1]
    assert lines[2].startswith("  rank 1: DID NOT ARRIVE at #10 on group default_pg (entered up to #9 there): "
                               "outside any collective"), lines[2]


def test_a_peer_waiting_in_the_same_collective_is_not_called_behind():
    mine = status(10, 9, "torch _tensor.py in backward", "train.py:32 in main")
    theirs = status(10, 9, "torch _tensor.py in backward", "train.py:32 in main")
    report = collective_report(mine, 0, {0: mine, 1: theirs}, RuntimeError("Connection closed by peer"), "3 s")
    assert report.splitlines()[2].startswith("  rank 1: waiting in torch _tensor.py in backward"), report
