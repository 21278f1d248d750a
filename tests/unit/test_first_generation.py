"""When a live run's first generation forms (membership.Member._complete): with --nnodes MIN:MAX alone, once
MAX workers came or none arrived for LAST_CALL_S; where the scheduler started a known number of nodes (a
Slurm step over a node range), once those came or none arrived for START_CALL_S: a slow host's worker
(3 s later, on half a core) is then in it from the start. A worker whose launcher is up is waited for as long."""

from shoal.live.membership import LAST_CALL_S, START_CALL_S, Member


def member(start_world=None) -> Member:
    return Member(store=None, endpoint="", id=0, min_world=1, max_world=4, evict_s=60.0, start_world=start_world)


def formed(m: Member, roster: list[int], quiet_s: float, starting: int = 0):
    now = 1000.0
    return m._complete(None, roster, {}, now, now - 2 * quiet_s, now - quiet_s, starting)[0]


def test_without_a_scheduler_count_the_first_generation_forms_after_the_last_call():
    assert formed(member(), [0], LAST_CALL_S / 2) is None
    assert formed(member(), [0], LAST_CALL_S) == [0]
    assert formed(member(), [3, 0, 1, 2], 0.0) == [0, 1, 2, 3]


def test_with_the_nodes_slurm_started_it_waits_for_them():
    assert formed(member(start_world=2), [0], 3.0) is None  # a late host's worker is still coming
    assert formed(member(start_world=2), [1, 0], 0.0) == [0, 1]  # all it started: no last call
    assert formed(member(start_world=2), [0], START_CALL_S) == [0]  # one never came: go on within the range


def test_a_worker_whose_launcher_is_up_is_waited_for_past_the_last_call():
    assert formed(member(), [0, 1], LAST_CALL_S, starting=1) is None  # its launcher drew its id: it is coming
    assert formed(member(), [0, 1], START_CALL_S, starting=1) == [0, 1]  # never came: go on within the range
    assert formed(member(), [0, 1, 2, 3], 0.0, starting=1) == [0, 1, 2, 3]  # the range is full
