"""The early fork server of `shoal train` (launch/forkserver.py): used where the launcher's environment is
still the one it started in, stopped where it changed, never left running."""

import multiprocessing.forkserver
import subprocess
import sys

from shoal.launch import forkserver

# a process of its own: the test process's fork server (the harness's) must not be touched
LIFECYCLE = """
import multiprocessing.forkserver, os, sys
from shoal.launch import forkserver

server = multiprocessing.forkserver._forkserver
forkserver.start_early(preload=())
first = server._forkserver_pid
assert first is not None
forkserver.use_or_stop()  # nothing changed (OMP_NUM_THREADS is handed to each worker anyway)
os.environ["OMP_NUM_THREADS"] = "1"
forkserver.use_or_stop()
assert server._forkserver_pid == first, "kept while the environment is the one it started in"
os.environ["LD_PRELOAD"] = "/nowhere/libtcmalloc_minimal.so.4"  # what ZeRO 2/3 on CPU adds
forkserver.use_or_stop()
assert server._forkserver_pid is None, "stopped once the environment changed"
try:
    os.kill(first, 0)
    sys.exit("the stopped server still runs")
except ProcessLookupError:
    pass
del os.environ["LD_PRELOAD"]
forkserver.start_early(preload=())
second = server._forkserver_pid
forkserver.stop()
assert server._forkserver_pid is None
forkserver.stop()  # twice: nothing
multiprocessing.forkserver.ensure_running()  # a later launch starts one of its own
assert server._forkserver_pid not in (None, first, second)
print("ok")
"""


def test_the_early_server_is_kept_stopped_and_started_again_as_the_environment_says():
    out = subprocess.run([sys.executable, "-c", LIFECYCLE], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_a_server_this_process_runs_already_is_left_alone(monkeypatch):
    server = multiprocessing.forkserver._forkserver
    other = subprocess.Popen(["sleep", "30"])  # stands for a server this process runs already (the harness's)
    try:
        monkeypatch.setattr(server, "_forkserver_pid", other.pid)
        monkeypatch.setattr(multiprocessing.forkserver, "ensure_running",
                            lambda: (_ for _ in ()).throw(AssertionError("a second server was started")))
        forkserver.start_early(preload=())
        forkserver.stop()  # it started none: nothing to stop
        assert other.poll() is None, "the other server was killed"
    finally:
        other.kill()
        other.wait()
