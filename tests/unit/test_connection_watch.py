"""dist.ConnectionWatch: a live run's survivors learn within milliseconds that a peer's connection
closed (its process killed, or cut), and the step's layers stop there (comm/phase.py's hooks)."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from shoal import dist
from shoal.comm.phase import Phase


def connected_to_a_child():
    """A TCP connection on loopback whose far end is a child process; and a listening socket."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    child = subprocess.Popen([sys.executable, "-c", f"import socket, time\ns = socket.create_connection(('127.0.0.1', "
                              f"{port}))\nprint('up', flush=True)\ntime.sleep(60)"], stdout=subprocess.PIPE, text=True)
    conn, _ = listener.accept()
    assert child.stdout.readline().strip() == "up"
    return listener, conn, child


def soon(predicate, within: float = 2.0) -> None:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < within, "not within the time"
        time.sleep(0.001)


def test_a_killed_peer_is_noticed_at_once_and_the_next_layer_raises():
    opened = dist.open_sockets()
    listener, conn, child = connected_to_a_child()
    watch = dist.ConnectionWatch(dist.open_sockets() - opened)  # the connection and the listener
    try:
        time.sleep(0.3)
        assert not watch.lost()  # an idle connection, a listener: nothing
        watch.check()
        os.kill(child.pid, signal.SIGKILL)
        soon(watch.lost)  # with no collective on the connection (gloo would learn of it only at its next)
        phase, model = Phase(), torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        phase.track(model, (torch.nn.Linear,))
        phase.check = watch.check
        with pytest.raises(dist.PeerLost):
            model(torch.randn(2, 4))
        assert phase.direction == "forward" and phase.layer == "0"  # the first layer's forward
    finally:
        watch.close()
        child.kill()
        child.wait()
        conn.close()
        listener.close()


def test_a_cut_of_our_own_is_noticed_and_a_backward_stops_at_its_next_layer():
    opened = dist.open_sockets()
    listener, conn, child = connected_to_a_child()
    watch = dist.ConnectionWatch(dist.open_sockets() - opened)
    phase, model = Phase(), torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    phase.track(model, (torch.nn.Linear,))
    phase.check = watch.check
    try:
        loss = model(torch.randn(2, 4)).sum()
        assert dist.cut_connections(dist.open_sockets() - opened) == 1  # the connection, not the listener
        soon(watch.lost)
        with pytest.raises(dist.PeerLost):
            loss.backward()
        assert phase.direction == "backward" and phase.layer == "1"  # the last layer's backward comes first
        assert model[0].weight.grad is None  # the step stopped before the first layer's gradients
    finally:
        watch.close()
        child.kill()
        child.wait()
        conn.close()
        listener.close()


def test_closing_the_watch_ends_its_thread():
    watch = dist.ConnectionWatch(set())
    watch.close()
    soon(lambda: not any(t.name == "shoal-connection-watch" for t in threading.enumerate()),
         within=2 * dist.ConnectionWatch.POLL_S + 1)
