"""Node 0's launcher hosts a live run's store: when the run is over it keeps the store until every launcher
has written that its workers ended (they end a moment apart), and it does not wait forever for a
launcher that never will (its node is gone)."""

import threading
import time

import torch.distributed as dist

from shoal import membership
from shoal.launch.live import _serve_until_done


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
