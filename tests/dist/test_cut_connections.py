"""A rank that leaves a gloo group DDP has wrapped must not leave its peers waiting: destroying the group
does not close its connections (DDP keeps it referenced), so live/connections.py's cut_connections shuts them down
([Note: cutting a group's connections] in live/connections.py). Rank 1 waits in an all_reduce on rank 0, which has
left but stays alive: with the cut, rank 1's collective fails while rank 0 lives; without it (the
control), it is still waiting when rank 0 gives up after 5 s."""

import subprocess
import sys

import pytest

from conftest import FIXTURES, ROOT
from shoal.launch.ports import free_port

pytestmark = pytest.mark.timeout(120)


def run_pair(how: str) -> str:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(FIXTURES / "cut_peer.py"), str(r), str(port), how], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=100)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(outs)
    return "\n".join(outs)


def test_a_cut_fails_the_waiting_peer_while_the_leaver_lives():
    out = run_pair("cut")
    assert "rank 1: all_reduce failed while rank 0 was alive" in out, out
    assert "rank 0: cut 1 connections, alive while rank 1's wait ended" in out, out  # its listener left alone


@pytest.mark.serial
def test_without_the_cut_the_peer_waits_on_the_leaver():
    out = run_pair("keep")
    assert "rank 0: cut 0 connections, rank 1 still waiting after 5 s" in out, out
