"""`shoal run`: a user's own script launched as torchrun launches it, with shoal's launcher around it.

The real clients, unchanged: PyTorch's DDP tutorial script (tests/fixtures/pytorch_examples: written for
CUDA and NCCL, run here with --cpu) and accelerate's own multi-process test script (tests/fixtures/accelerate)."""

import json
import os
import re
import time

import pytest

from conftest import FIXTURES, ROOT, run_cli

pytestmark = pytest.mark.slow  # runs the CLI

TUTORIAL = FIXTURES / "pytorch_examples" / "multigpu_torchrun.py"


def as_the_docs_show(args: list) -> list:
    """`args`, after checking that docs/your-script.md shows this very command (its block is run here, not
    again by the docs' test)."""
    shown = " ".join(str(a).replace(f"{ROOT}/", "") for a in [".venv/bin/shoal", *args])
    assert f"\n{shown}\n" in (ROOT / "docs" / "your-script.md").read_text(), shown
    return args


def test_the_ddp_tutorial_runs_unchanged_on_cpu_workers_and_resumes_from_its_snapshot(tmp_path):
    r = run_cli(as_the_docs_show(["run", "--cpu", "--nproc", "2", TUTORIAL, "2", "1", "--batch_size", "32"]),
                timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.output
    for gpu in (0, 1):  # 2048 samples over 2 ranks in batches of 32: 32 steps per epoch on each
        for epoch in (0, 1):
            assert f"[GPU{gpu}] Epoch {epoch} | Batchsize: 32 | Steps: 32" in r.stdout, r.output
    assert "Epoch 1 | Training snapshot saved at snapshot.pt" in r.stdout and (tmp_path / "snapshot.pt").is_file()

    r = run_cli(["run", "--cpu", "--nproc", "2", TUTORIAL, "3", "1", "--batch_size", "32"], timeout=120,
                cwd=tmp_path)
    assert r.returncode == 0, r.output
    assert r.stdout.count("Resuming training from snapshot at Epoch 1") == 2, r.output
    assert "[GPU1] Epoch 2 | Batchsize: 32" in r.stdout and "[GPU0] Epoch 0 " not in r.stdout, r.output


def test_accelerates_own_multi_process_test_script_passes_unchanged(tmp_path):
    """accelerate's own test script (tests/fixtures/accelerate): data split between processes, RNG kept in
    step, the prepared DataLoader, and training on 2 processes checked against one CPU."""
    r = run_cli(as_the_docs_show(["run", "--cpu", "--nproc", "2", FIXTURES / "accelerate" / "test_script.py"]),
                timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.output
    assert r.stdout.count("Distributed environment: DistributedType.MULTI_CPU  Backend: gloo") == 2, r.output
    assert "Num processes: 2" in r.stdout, r.output
    for split in ("no batch split", "batch split"):
        assert f"Training yielded the same results on one CPU or distributed setup with {split}." in r.stdout


def test_workers_get_torchruns_environment_and_the_worst_exit_code_is_returned(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    r = run_cli(["run", "--nproc", "2", FIXTURES / "envdump.py", out], timeout=60, cwd=tmp_path,
                env={"EXIT_RANK1": "3"})
    assert r.returncode == 3, r.output
    assert re.search(r"^shoal: rank 1 \(pid \d+\) failed with exit code 3$", r.stderr, re.M), r.stderr
    # torchrun itself would exit 1 (measured), naming no code; rank 0, if still running, was stopped
    assert not re.search(r"^shoal: rank 0 \(pid \d+\) failed", r.stderr, re.M), r.stderr
    ranks = [json.loads((out / f"rank{i}.json").read_text()) for i in (0, 1)]
    for i, got in enumerate(ranks):
        env = got["env"]
        assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (str(i), "2", str(i), "2")
        assert env["MASTER_ADDR"] and env["MASTER_PORT"] and env["TORCHELASTIC_RUN_ID"]
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0" and env["TORCHELASTIC_MAX_RESTARTS"] == "0"
        assert got["argv"] == [str(FIXTURES / "envdump.py"), str(out)]  # as `python script.py ARGS` sets them
        assert got["path0"] == str(FIXTURES)


def test_a_module_runs_as_python_m_runs_it_and_a_failed_attempt_is_restarted(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    r = run_cli(["run", "--nproc", "1", "--max-restarts", "1", "-m", "envdump", out], timeout=60, cwd=tmp_path,
                env={"EXIT_RANK0": "5", "EXIT_ATTEMPT": "0"})  # fails in the first attempt only
    assert r.returncode == 0, r.output
    got = json.loads((out / "rank0.json").read_text())
    assert got["argv"][1:] == [str(out)] and got["argv"][0].endswith("envdump.py")
    assert got["path0"] == os.fspath(tmp_path)  # the working directory, as python -m
    assert got["env"]["TORCHELASTIC_RESTART_COUNT"] == "1" and got["env"]["TORCHELASTIC_MAX_RESTARTS"] == "1"


def test_a_script_that_does_not_exist_is_one_line(tmp_path):
    r = run_cli(["run", "--nproc", "2", "nope.py"], timeout=60, cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip() == "shoal: error: script 'nope.py' does not exist (a module to run as python -m takes -m: " \
                               "shoal run -m nope.py)"


@pytest.mark.serial  # a 3 s collective timeout, and the run must end within 13 s of the stall
@pytest.mark.parametrize("before", ["backward", "all_reduce"])
def test_a_rank_stalled_in_a_plain_ddp_script_is_named(tmp_path, before):
    """Rank 1 of a plain DDP script (its own init_process_group, DDP, an all_reduce of its loss) stalls at
    step 3: before backward (rank 0 waits in DDP's gradient all-reduce, inside autograd's C++ engine) or
    before the loss's all_reduce. The report names rank 1, where it is and the collective, within the
    group's timeout (3 s) + 10 s of the stall."""
    mark = tmp_path / "stalled_at"
    r = run_cli(["run", "--nproc", "2", FIXTURES / "stall_ddp.py"], timeout=120, cwd=tmp_path,
                env={"STALL_BEFORE": before, "STALL_RANK": "1", "TIMEOUT_S": "3", "STALL_SECONDS": "60",
                     "STALL_MARK": str(mark)})
    ended = time.time()
    assert r.returncode == 1, r.output
    report = r.stderr[r.stderr.index("shoal: collective "):].splitlines()[:3]
    waits_in = {"backward": "torch _tensor.py in backward", "all_reduce": "torch.distributed distributed_c10d.py in "
                "all_reduce"}[before]
    assert re.match(rf"shoal: collective {waits_in} \[all_reduce \(.*\) on group default_pg, #\d+ there\] during the "
                    r"script failed on rank 0 after 3\.\d s: Timed out waiting 3000ms", report[0]), report
    assert report[1].startswith(f"  rank 0: waiting in {waits_in}; was at stall_ddp.py:"), report
    line = {"backward": 32, "all_reduce": 36}[before]  # the call of stall() in the script
    assert re.match(r"  rank 1: DID NOT ARRIVE at #\d+ on group default_pg \(entered up to #\d+ there\): outside any "
                    rf"collective; was at stall_ddp.py:\d+ in stall <- stall_ddp.py:{line} in main", report[2]), report
    assert "rank 1 (pid " in r.stderr and "was stopped (SIGTERM) when another rank failed" in r.stderr
    assert ended - float(mark.read_text()) < 3 + 10, "the run must end within timeout + 10 s of the stall"
