"""`shoal train`'s workers, forked from the server the command starts as it begins ([Note: early fork server]
in launch/forkserver.py), see the environment the launcher gives them: with ZeRO 3 on CPU, LD_PRELOAD of tcmalloc,
which the server must start with (the command reads the config's zero before it starts the server: cli/train.py's
early_worker_env); on a node of several, the interface gloo binds is learnt after it started, and is handed to each
worker instead."""

import json
import os
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import TINY_GPT, run_cli
from shoal.allocator import TCMALLOC, tcmalloc_path

RUN = [*TINY_GPT, "--set", 'model.name="malloc_probe:build"', "--set", "train.steps=1", "--set", "train.val_interval=0",
       "--set", "checkpoint.enabled=false", "--set", "checkpoint.final_weights=false", "--nproc", "2"]


def probed(tmp_path, zero: int) -> list[dict]:
    out = tmp_path / f"probe{zero}"
    out.mkdir()
    r = run_cli(["train", *RUN, "--set", f"parallel.zero={zero}", "--run-dir", tmp_path / f"run{zero}"], timeout=120,
                env={"SHOAL_TEST_PROBE_DIR": str(out)})
    assert r.returncode == 0, r.stdout + r.stderr
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.slow  # two 2-worker runs
@pytest.mark.skipif(tcmalloc_path() is None, reason=f"{TCMALLOC} is not installed (.ci/run installs it)")
@pytest.mark.skipif(any(k in os.environ for k in ("LD_PRELOAD", "MALLOC_MMAP_THRESHOLD_")),
                    reason="this environment chose the workers' malloc itself (allocator.worker_env leaves it)")
def test_forked_workers_get_what_the_launcher_adds_after_their_server_started(tmp_path):
    sharded = probed(tmp_path, 3)
    assert all(w["tcmalloc"] and TCMALLOC in w["ld_preload"] for w in sharded), sharded
    plain = probed(tmp_path, 0)
    assert not any(w["tcmalloc"] for w in plain), plain
    if "OMP_NUM_THREADS" not in os.environ:  # else every server has it
        # both forked from the server started as the command began, ZeRO 3's too (not from a second one, started
        # once the launch had set the workers' threads in its environment: 5.2 s for ZeRO 3's run against 3.3)
        assert not any(w["server_has_threads"] for w in sharded + plain), sharded + plain
    # the command that continues the run, set before the server started, reaches the workers either way
    assert all(w["resume_command"].startswith("shoal train ") for w in sharded + plain), sharded + plain


@pytest.mark.slow  # two launchers
def test_a_node_of_several_forks_from_its_early_server_and_hands_its_workers_the_interface(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "probe"
    out.mkdir()

    def node(rank: int):
        args = [a for a in RUN if a not in ("--nproc", "2")]
        return run_cli(["train", *args, "--nproc", "1", "--nnodes", "2", "--node-rank", rank, "--rdzv-endpoint",
                        f"127.0.0.1:{port}", "--run-dir", tmp_path / f"node{rank}"], timeout=180,
                       env={"SHOAL_TEST_PROBE_DIR": str(out)})

    with ThreadPoolExecutor(2) as pool:
        for r in pool.map(node, [0, 1]):
            assert r.returncode == 0, r.stdout + r.stderr
    workers = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    # the loopback route's interface reached each worker, though the server it was forked from started without it
    assert all(w["gloo_socket_ifname"] == "lo" and not w["server_has_ifname"] for w in workers), workers
