"""Node 0's launcher hosts a live run's store: when the run is over it keeps the store until every launcher
has written that its workers ended (they end a moment apart), and it does not wait forever for a
launcher that never will (its node is gone)."""

import threading
import time

import torch.distributed as dist

from shoal.live import membership
from shoal.live.node import _serve_until_done


def serving(store) -> threading.Thread:
    t = threading.Thread(target=_serve_until_done, args=(store,), daemon=True)
    t.start()
    return t


def test_node_0_keeps_the_store_until_every_launcher_wrote_its_workers_end():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    node0, node1 = (membership.connect(f"127.0.0.1:{server.port}") for _ in range(2))
    mine, theirs = membership.draw_id(node0, "node 0", 0), membership.draw_id(node1, "node 1", 0)
    membership.mark_gone(node0, mine, failed=False)
    membership.finish(node0)  # the run is over; node 1's worker has not ended yet
    t = serving(node0)
    time.sleep(0.5)
    assert t.is_alive(), "node 0 closed the store before node 1's launcher wrote its worker's end"
    membership.mark_gone(node1, theirs, why="it was asked to stop")
    t.join(timeout=5)
    assert not t.is_alive()


def test_node_0_stops_waiting_for_a_launcher_whose_members_beat_no_more(monkeypatch):
    monkeypatch.setattr(membership, "STALE_S", 0.2)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store = membership.connect(f"127.0.0.1:{server.port}")
    membership.draw_id(store, "node 1", 0)  # never marked gone: its node died with its launcher
    membership.finish(store)
    t = serving(store)
    t.join(timeout=5)
    assert not t.is_alive()


def test_a_joiner_whose_request_a_generation_counted_without_it_asks_again():
    """A replacement asks to join; the survivors, regrouping after the loss it replaces, close the next
    generation before it reaches the roster, counting its request as admitted. It must ask again, or no member
    ever wants it and the run ends without it (seen once across hosts under load: "the run finished before
    this worker could join")."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    endpoint = f"127.0.0.1:{server.port}"

    def member(i):
        return membership.Member(membership.connect(endpoint), endpoint, i, 1, 3, evict_s=60.0)

    survivor, joiner = member(0), member(2)
    first = survivor.regroup(None)  # generation 0: the survivor alone (min_world 1)
    assert first.members == (0,) and first.admitted == 0
    joiner.request_join()
    second = survivor.regroup(first)  # closes generation 1 at once: the joiner has not appended yet
    assert second.members == (0,) and second.admitted == 1
    done = {}
    t = threading.Thread(target=lambda: done.setdefault("gen", joiner.regroup(None)), daemon=True)
    t.start()
    deadline = time.monotonic() + 5
    while int(survivor.store.add(membership.PREFIX + "join_requests", 0)) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert int(survivor.store.add(membership.PREFIX + "join_requests", 0)) == 2  # it asked again
    roster = membership.PREFIX + "g2/roster"
    while not (survivor.store.check([roster]) and b"2;" in survivor.store.get(roster)) and time.monotonic() < deadline:
        time.sleep(0.01)  # the joiner is on generation 2's roster before the survivor regroups
    survivor._join_requests = 2  # what the heartbeat would read
    assert survivor.join_wanted(second)
    third = survivor.regroup(second)
    t.join(timeout=5)
    assert third.members == (0, 2) and done["gen"].members == (0, 2)
