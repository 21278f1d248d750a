"""Shared test helpers: run the real CLI in a subprocess with a hard timeout.

A run that does not finish in time is not left hanging: every worker is asked for its Python stack
(SIGUSR1, see worker.py), then the whole process tree is killed, and the test fails showing each
rank's output, so a hang points at the line it hangs on.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from shoal.launch.supervisor import descendants

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"
# the GPU tier (tests/gpu/) is collected by `make test-gpu` alone: everywhere else (make test, CI) every one of
# its tests would only be skipped for want of a GPU
collect_ignore = [] if os.environ.get("SHOAL_GPU_TIER") else ["gpu"]


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


@pytest.hookimpl(tryfirst=True)  # before `-m` and `-k` deselect anything
def pytest_collection_modifyitems(session, config, items):
    """The tiers: `make test-fast` (`-m "not slow"`) is the unit tests and the in-process harness; a test
    that runs the real CLI (integration/, and dist/ tests that do not use the harness) is slow, as is one
    marked so by hand (a harness test that also runs the CLI, or one that takes many seconds). And the
    folders every test was collected from, for the guard below: it checks collection, not selection
    (`make test`'s markers and a developer's `-k WORD` select from what was collected)."""
    for item in items:
        folder = Path(str(item.fspath)).parent.name
        if folder == "integration" or (folder == "dist" and "ranks" not in item.fixturenames):
            item.add_marker(pytest.mark.slow)
    session.collected_folders = {Path(str(item.fspath)).parent.name for item in items}


def pytest_collection_finish(session):
    """A whole-suite run must collect every test folder: a folder skipped by a collection rule (pytest
    ignores folders named "dist" unless told otherwise) would otherwise pass silently, under `make test`'s
    markers too."""
    roots = [Path(a.split("::")[0]).resolve() for a in session.config.args]
    here = Path(__file__).parent.resolve()
    if here in roots or ROOT in roots:
        missing = {"unit", "dist", "integration"} - getattr(session, "collected_folders", set())
        if missing:
            raise pytest.UsageError(f"no tests were collected from tests/{', tests/'.join(sorted(missing))}")


# Horovod's example scripts (tests/fixtures/horovod) at their smallest: one image per step, no warm-up
HOROVOD_SMALL = ["--model", "resnet18", "--batch-size", "1", "--num-warmup-batches", "0",
                 "--num-batches-per-iter", "1", "--no-cuda"]


def horovod_env() -> dict:
    """PYTHONPATH for workers running Horovod's examples: the fixtures, and torchvision's stand-in
    (tests/fixtures/horovod/stand_in) where the real one is not importable."""
    path = [str(FIXTURES)]
    if importlib.util.find_spec("torchvision") is None:
        path.insert(0, str(FIXTURES / "horovod" / "stand_in"))
    return {"PYTHONPATH": os.pathsep.join([*path, os.environ.get("PYTHONPATH", "")])}


def run_cli(args: list[str], timeout: float, cwd: Path | None = None, env: dict | None = None,
            launcher: list[str] | None = None) -> Result:
    """Run `python -m shoal ARGS` (or `launcher ARGS`); fail the test on timeout with every rank's stacks."""
    cmd = (launcher or [sys.executable, "-m", "shoal"]) + [str(a) for a in args]
    full_env = {**os.environ, "PYTHONPATH": f"{FIXTURES}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(cmd, cwd=cwd or ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        tree = descendants(proc.pid)
        for pid in tree:  # ask each process for its Python stack before it dies
            _signal(pid, signal.SIGUSR1)
        time.sleep(2)
        for pid in [proc.pid, *tree]:
            _signal(pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"`{' '.join(cmd)}` did not finish within {timeout} s; killed. Output:\n{out}\n{err}")
    return Result(proc.returncode, out, err)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def read_weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "model.safetensors"))


# a GPT small enough that a 2-process run of 20 steps takes seconds on 2 cores
TINY_GPT = ["--set", "model.n_layer=2", "--set", "model.d_model=32", "--set", "model.n_head=2",
            "--set", "model.seq_len=32", "--set", "data.max_bytes=200000", "--set", "train.val_batches=2",
            "--set", "parallel.threads_per_worker=1", "--set", "metrics.tensorboard=false"]


def train_in_process(overrides: list[str], run_dir: Path) -> dict:
    """One-process training inside the test process (a world of 1 on a local store); returns the summary."""
    from shoal import dist
    from shoal.comm.collectives import Comm
    from shoal.config import load_config
    from shoal.preflight import check_job
    from shoal.training.train import run_training

    cfg = load_config(None, overrides)
    job = check_job(cfg, [1], cuda=False)
    env = dist.init(job.layout.backend, timeout_s=60)
    try:
        return run_training(cfg, job.layout, job.source, run_dir, env, Comm(env.store))
    finally:
        dist.shutdown()


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory, worker_id) -> Path:
    """A folder every pytest worker of this session sees (xdist gives each worker a base folder of its
    own, in one folder of the session's), for what is computed once and read by all (live_runs.py)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if worker_id != "master" else base


@pytest.fixture(scope="module")
def one_rank():
    """A gloo process group of this process alone (a DeviceMesh, DTensor placements, a DDP hook, in-process)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def ranks():
    """ranks(n): n persistent worker processes with a gloo group per call (tests/harness.py)."""
    from harness import RankPools

    pools = RankPools()
    yield pools
    pools.close()


def pytest_configure(config):
    """A pytest-xdist worker computes with its share of the cores, as shoal's own workers do (dist.share_of_cores):
    torch's default, every core, in each of two workers on two cores made each wait on the other's threads
    (`make test-fast`: 185 s and 123 s of the workers' CPU, against 177 s and 112 s with one thread each)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 0))
    if workers > 1:
        import torch

        from shoal.dist import share_of_cores

        torch.set_num_threads(share_of_cores(workers))
