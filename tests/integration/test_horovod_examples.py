"""`shoal run --horovod`: Horovod's own example scripts (tests/fixtures/horovod, unchanged: they say
`import horovod.torch as hvd`): the elastic one on 2 processes with horovodrun's -np, surviving a worker
that dies: the launcher restarts the job (--max-restarts) and the script resumes from its last commit
(the synthetic benchmark runs across the two-host cluster, placed by -H: tests/dist/test_cluster.py). torchvision, which the examples build their model with, is the stand-in of
tests/fixtures/horovod/stand_in where the real one is not importable (SOURCE.md there says why)."""

import pytest

from conftest import FIXTURES, HOROVOD_SMALL, horovod_env, run_cli

pytestmark = pytest.mark.slow  # runs the CLI

HOROVOD = FIXTURES / "horovod"


def test_horovods_elastic_benchmark_resumes_from_its_commit_after_a_worker_dies(tmp_path):
    # rank 1 dies in its 2nd step (iteration #1) in the first attempt. Whichever commit is the newest then
    # (after iteration #0, or #1 when rank 0 got that far), the resumed job ends with 4 timings (iteration
    # #0 or #1 timed twice); started over, it would end with 3 and warm up again
    state_dir = tmp_path / "commits"
    r = run_cli(["run", "--horovod", "-np", "2", "--max-restarts", "1", HOROVOD / "fail_once.py",
                 HOROVOD / "pytorch_synthetic_benchmark_elastic.py", *HOROVOD_SMALL, "--num-iters", "3", "--fp16-allreduce"],
                timeout=180, cwd=tmp_path, env={**horovod_env(), "SHOAL_HOROVOD_STATE_DIR": str(state_dir),
                                                "FAIL_AT_STEP": "2"})
    assert r.returncode == 0, r.output
    assert "fail_once: rank 1 ends itself" in r.stdout, r.output
    assert r.stdout.count("Model: resnet18") == 2, r.output  # the script ran twice
    assert r.stdout.count("Running warmup...") == 1, r.output  # the second time, warm came from the commit
    assert "Iter #2: " in r.stdout and "fail_once: state.img_secs holds 4" in r.stdout, r.output
    assert not any(state_dir.rglob("*.pt")), list(state_dir.rglob("*"))  # gone once the elastic function returned
