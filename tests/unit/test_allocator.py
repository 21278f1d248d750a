"""ZeRO 2/3 workers on CPU run on tcmalloc, preloaded by the launcher, or fall back to glibc with a 64 KiB mmap
threshold, saying so (shoal/allocator.py); either way freed buffers leave the RSS."""

import os
import subprocess
import sys

import pytest

from shoal.allocator import TCMALLOC, tcmalloc_path, worker_env

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD, glibc's malloc")
installed = pytest.mark.skipif(tcmalloc_path() is None, reason=f"{TCMALLOC} is not installed (.ci/run installs it)")


def test_only_zero_2_and_3_and_cp_on_cpu_get_an_allocator(tmp_path):
    (tmp_path / TCMALLOC).touch()
    dirs = (str(tmp_path),)
    assert worker_env(3, False, {}, dirs) == ({"LD_PRELOAD": str(tmp_path / TCMALLOC)}, None)
    assert worker_env(0, False, {}, dirs, cp=2) == ({"LD_PRELOAD": str(tmp_path / TCMALLOC)}, None)
    assert worker_env(0, True, {}, dirs, cp=2) == ({}, None)
    assert worker_env(2, False, {"LD_PRELOAD": "/x/libfoo.so"}, dirs)[0] == {
        "LD_PRELOAD": f"{tmp_path / TCMALLOC} /x/libfoo.so"}
    for zero, cuda in ((0, False), (1, False), (2, True), (3, True)):
        assert worker_env(zero, cuda, {}, dirs) == ({}, None)


def test_the_users_own_allocator_wins(tmp_path):
    (tmp_path / TCMALLOC).touch()
    for env in ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, {"MALLOC_MMAP_THRESHOLD_": "131072"}):
        assert worker_env(3, False, env, (str(tmp_path),)) == ({}, None)


def test_a_missing_tcmalloc_falls_back_in_one_line(tmp_path):
    add, note = worker_env(3, False, {}, (str(tmp_path),))
    assert add == {}
    assert "\n" not in note and "64 KiB mmap threshold" in note and "apt-get install libtcmalloc-minimal4" in note


WORKER = """
import sys
from shoal.allocator import release_freed_memory
maps = open("/proc/self/maps").read()
print(release_freed_memory(), "libtcmalloc" in maps)
"""


@linux
@installed
def test_a_worker_started_with_the_launchers_environment_runs_on_tcmalloc():
    add, note = worker_env(3, False, {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"})
    assert note is None
    run = subprocess.run([sys.executable, "-c", WORKER], env={**os.environ, **add}, capture_output=True, text=True,
                         check=True, timeout=60)
    assert run.stdout.split() == ["tcmalloc", "True"]
    plain = subprocess.run([sys.executable, "-c", WORKER], env={k: v for k, v in os.environ.items()
                                                                if k not in ("LD_PRELOAD", "MALLOC_MMAP_THRESHOLD_")},
                           capture_output=True, text=True, check=True, timeout=60)
    assert plain.stdout.split() == ["mmap", "threshold", "False"]


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


@linux
@pytest.mark.slow  # allocates and frees hundreds of MB in new processes
def test_freed_buffers_do_not_pile_up_once_released():
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_MMAP_THRESHOLD_")}

    def kept(mode: str, **extra: str) -> int:
        return int(subprocess.run([sys.executable, "-c", CHURN, mode], capture_output=True, text=True, check=True,
                                  env={**env, **extra}, timeout=120).stdout)

    assert kept("default") > 20e6  # glibc kept the 28 MB block in its heap
    assert kept("release") < 4e6  # the fallback: mmapped, given back at once
    if tcmalloc_path():  # tcmalloc keeps one such block for the next one of its size: no more than that
        assert kept("release", **worker_env(3, False, env)[0]) < 4e6
