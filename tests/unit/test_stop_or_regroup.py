"""The decision at each step's end, from the flags every rank reads alike: stop, regroup, or go on."""

from shoal.training.flags import LEAVE_GRACE_S, Flags, stop_or_regroup


def flags(stops: int = 0, age: float = 0.0, regroup: bool = False) -> Flags:
    return Flags(loss_sum=1.0, stops=stops, bad_norm=False, save=False, regroup=regroup, stop_age=age)


def test_a_fixed_size_run_stops_when_any_rank_was_asked():
    assert stop_or_regroup(flags(stops=1), world=3, regroups=False) == (True, False)
    assert stop_or_regroup(flags(), world=3, regroups=False) == (False, False)


def test_a_live_run_stops_only_when_every_rank_was_asked_at_once():
    assert stop_or_regroup(flags(stops=3, age=0.01), world=3, regroups=True) == (True, False)
    assert stop_or_regroup(flags(stops=3, age=0.01, regroup=True), world=3, regroups=True) == (True, False)


def test_ranks_asked_alone_leave_once_their_request_is_old_enough():
    # one rank signalled 0.5 s ago: the others may be signalled in a moment (a job's cancel), so go on
    assert stop_or_regroup(flags(stops=1, age=0.5), world=3, regroups=True) == (False, False)
    # two ranks whose requests are 2.5 s and 1.7 s old: on average past the grace, they leave
    assert stop_or_regroup(flags(stops=2, age=2.5 + 1.7), world=3, regroups=True) == (False, True)
    assert stop_or_regroup(flags(stops=1, age=LEAVE_GRACE_S), world=3, regroups=True) == (False, True)


def test_a_waiting_joiner_regroups_at_once():
    assert stop_or_regroup(flags(regroup=True), world=2, regroups=True) == (False, True)
    assert stop_or_regroup(flags(stops=1, age=0.1, regroup=True), world=3, regroups=True) == (False, True)
