"""The asynchronous parameter servers' end: server 0, whose process hosts the store the roles meet in, leaves
after the others (ps/links.py leave_in_turn), on a real TCPStore."""

import datetime
import threading
import time

from torch.distributed import TCPStore

from shoal.launch.ports import free_port
from shoal.ps.links import leave_in_turn


def store():
    return TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=10))


def test_server_0_leaves_only_after_the_others_are_done():
    s, left = store(), []
    late = [threading.Timer(0.4 + 0.2 * i, lambda i=i: (left.append(i), leave_in_turn(s, i, 3, 10.0)))
            for i in (1, 2)]
    for t in late:
        t.start()
    t0 = time.monotonic()
    leave_in_turn(s, 0, 3, 10.0)
    assert sorted(left) == [1, 2] and 0.5 < time.monotonic() - t0 < 5


def test_server_0_stops_waiting_at_the_timeout_or_when_stopped():
    s = store()
    t0 = time.monotonic()
    leave_in_turn(s, 0, 2, 0.3)  # server 1 never comes
    assert 0.3 <= time.monotonic() - t0 < 2
    t0 = time.monotonic()
    leave_in_turn(s, 0, 2, 60.0, stopped=lambda: time.monotonic() - t0 > 0.2)
    assert time.monotonic() - t0 < 2


def test_a_single_server_and_the_others_do_not_wait():
    s = store()
    t0 = time.monotonic()
    leave_in_turn(s, 0, 1, 60.0)
    leave_in_turn(s, 1, 2, 60.0)
    assert time.monotonic() - t0 < 1
