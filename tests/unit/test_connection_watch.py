"""live/connections.py's ConnectionWatch: a live run's survivors learn within milliseconds that a peer's connection
closed (its process killed, or cut), and the step's layers stop there (comm/phase.py's hooks)."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import pytest
import torch

from shoal.comm.phase import Phase
from shoal.live import connections


@dataclass
class Watched:
    """A TCP connection on loopback whose far end is a child process, a listening socket, the sockets
    they opened (from connections.open_sockets), a ConnectionWatch over them, and a model whose two layers'
    hooks (comm/phase.py) ask it."""

    child: subprocess.Popen
    opened: set
    watch: connections.ConnectionWatch
    phase: Phase
    model: torch.nn.Module


@pytest.fixture
def watched():
    before = connections.open_sockets()
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    child = subprocess.Popen([sys.executable, "-c", f"import socket, time\ns = socket.create_connection(('127.0.0.1', "
                              f"{port}))\nprint('up', flush=True)\ntime.sleep(60)"], stdout=subprocess.PIPE, text=True)
    conn, _ = listener.accept()
    assert child.stdout.readline().strip() == "up"
    opened = connections.open_sockets() - before
    watch = connections.ConnectionWatch(opened)
    phase, model = Phase(), torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    phase.track(model, (torch.nn.Linear,))
    phase.check = watch.check
    try:
        yield Watched(child, opened, watch, phase, model)
    finally:
        watch.close()
        child.kill()
        child.wait()
        conn.close()
        listener.close()


def soon(predicate, within: float = 2.0) -> None:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < within, "not within the time"
        time.sleep(0.001)


def test_a_killed_peer_is_noticed_and_the_next_layer_raises(watched):
    time.sleep(0.3)
    assert not watched.watch.lost()  # an idle connection, a listener: nothing
    watched.model(torch.randn(2, 4))  # the layers run while nothing is lost
    os.kill(watched.child.pid, signal.SIGKILL)
    soon(watched.watch.lost)  # with no traffic on the connection (gloo would learn of it only at its next collective)
    with pytest.raises(connections.PeerLost):
        watched.model(torch.randn(2, 4))
    assert watched.phase.direction == "forward" and watched.phase.layer == "0"  # the first layer's forward


def test_a_cut_of_our_own_is_noticed_and_a_backward_stops_at_its_next_layer(watched):
    loss = watched.model(torch.randn(2, 4)).sum()
    assert connections.cut_connections(watched.opened) == 1  # the connection, not the listener
    soon(watched.watch.lost)
    with pytest.raises(connections.PeerLost):
        loss.backward()
    assert watched.phase.direction == "backward" and watched.phase.layer == "1"  # the last layer's comes first
    assert watched.model[0].weight.grad is None  # the step stopped before the first layer's gradients


def test_closing_the_watch_ends_its_thread():
    watch = connections.ConnectionWatch(set())
    watch.close()
    soon(lambda: not any(t.name == "shoal-connection-watch" for t in threading.enumerate()),
         within=2 * connections.ConnectionWatch.POLL_S + 1)
