"""Two nodes started from Slurm's variables alone: each `shoal train` (no --nnodes, --node-rank or
--rdzv-endpoint) is one srun task, told its node by SLURM_NODEID and node 0 by the first host of the
compressed node list, and they train as one world of 2 (launch/environment.py). On two hosts of the
one-machine cluster (network namespaces, test_cluster.py runs it there with its hosts up), or here on
two loopback addresses where namespaces cannot be made."""

import json
import random
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import TINY_GPT, run_cli
from shoal.launch.environment import SLURM_PORTS, slurm_port
from test_cluster import WHY_NOT


def free_slurm_job_id() -> str:
    """A job id whose derived rendezvous port is free here."""
    first, count = SLURM_PORTS
    for _ in range(100):
        job = str(random.randrange(100_000, 1_000_000))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", slurm_port(job)))
                return job
            except OSError:
                continue
    pytest.fail(f"no free port in {first}-{first + count - 1}")


if WHY_NOT is not None:  # collected only where namespaces cannot be made; else test_cluster.py runs it on two hosts
    @pytest.mark.timeout(150)
    def test_two_srun_tasks_form_one_job_from_slurm_variables_alone(tmp_path):
        two_slurm_nodes(tmp_path, "127.0.0", launchers=[None, None])


def two_slurm_nodes(tmp_path, subnet: str, launchers: list) -> None:
    """Node i runs `shoal train` through launchers[i] (None: here) with Slurm's variables for a job on
    the hosts subnet.1 and subnet.2."""
    job = free_slurm_job_id()
    nodes = f"{subnet}.[1-2]"
    slurm = {"SLURM_JOB_ID": job, "SLURM_STEP_ID": "0", "SLURM_JOB_NUM_NODES": "2", "SLURM_STEP_NUM_NODES": "2",
             "SLURM_STEP_NUM_TASKS": "2", "SLURM_JOB_NODELIST": nodes, "SLURM_STEP_NODELIST": nodes}

    def node(rank):
        return run_cli(["train", "--nproc", 1, "--run-dir", tmp_path / f"node{rank}", *TINY_GPT, "--set", "train.steps=3",
                        "--set", "checkpoint.enabled=false", "--set", "metrics.progress=false"],
                       timeout=120, env={**slurm, "SLURM_NODEID": str(rank)}, launcher=launchers[rank])

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(node, [0, 1]))
    for rank, r in enumerate(results):
        assert r.returncode == 0, r.output
        assert (f"shoal: from Slurm (job {job}): 2 nodes, node rank {rank}, rendezvous {subnet}.1:{slurm_port(job)}"
                in r.stderr), r.stderr
    # global rank 0 writes the results; the c10d rendezvous decides which node holds it
    summaries = [d / "summary.json" for d in (tmp_path / "node0", tmp_path / "node1") if (d / "summary.json").exists()]
    assert len(summaries) == 1
    summary = json.loads(summaries[0].read_text())
    assert summary["world_size"] == 2 and summary["dp"] == 2 and summary["steps"] == 3
