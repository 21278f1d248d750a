"""A free TCP port for a store or a rendezvous that another process binds a moment later."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def free_port(address: str = "127.0.0.1") -> int:
    """A port free on `address` now. Chosen at random below the kernel's ephemeral range, never from it:
    the kernel hands ephemeral ports to every outgoing connection and every bind to port 0 (gloo's
    listeners), so a port freed from that range was once taken between the pick and the store's bind
    (EADDRINUSE, with a test suite's runs beside it). Below the range only another explicit pick can
    take it."""
    picker, low = random.SystemRandom(), _ephemeral_low()
    for _ in range(64 if low > 2048 else 0):
        port = picker.randrange(max(1024, low - 20000), low)
        with socket.socket() as s:
            try:
                s.bind((address, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # 64 taken ports in a row: let the kernel choose
        s.bind((address, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's setting; IANA's 49152 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152
