"""ZeRO 2/3 workers give freed buffers back to the system (shoal/allocator.py): glibc's default keeps
a large block in its heap once one of that size was freed, so RSS stays at its high-water mark."""

import subprocess
import sys

import pytest

CHURN = """
import sys, torch
from shoal.allocator import release_freed_memory
if sys.argv[1] == "release":
    assert release_freed_memory()
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
def step():  # like a layer's all-gather buffer: 28 MB, filled, freed
    t = torch.empty(7_000_000).fill_(1.0)
    del t
step()  # first: one-time start-up (torch's thread pool, lazy init) is not what is measured
before = rss()
for _ in range(3):
    step()
print(rss() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
@pytest.mark.slow  # allocates and frees hundreds of MB in a new process
def test_freed_buffers_go_back_to_the_system_once_released():
    kept = {mode: int(subprocess.run([sys.executable, "-c", CHURN, mode], capture_output=True, text=True,
                                     check=True).stdout) for mode in ("default", "release")}
    assert kept["default"] > 20e6, kept  # glibc kept the 28 MB block in its heap
    assert kept["release"] < 4e6, kept
