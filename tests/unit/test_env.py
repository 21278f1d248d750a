"""`shoal env` (shoal/env/): what it reports about this machine, and each cause that stops training said
in one line with its fix, the causes simulated (no GPU visible, no NCCL, a small /dev/shm, an old
driver, an unsupported torch). The real check on this machine's CPU is tests/integration/test_env_check.py."""

import dataclasses
import sys

import pytest
import torch

from shoal import compat
from shoal.cli import main
from shoal.env import facts as machine
from shoal.errors import install_hint

H100 = machine.Gpu(0, "NVIDIA H100 80GB HBM3", 85 * 2**30, (9, 0))


def test_the_report_names_versions_device_backend_extras_and_profiles(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert f"torch       {torch.__version__}\n" in out
    assert "python      3." in out and "cuda        " in out and "driver      " in out
    if not torch.cuda.is_available():
        assert "gpus        none visible" in out
        assert ("auto        parallel.device = cpu, parallel.backend = gloo (the CPU); precision.dtype = fp32 "
                "(training on the CPU); shoal train --nproc 1\n") in out
    assert "extra       hf: installed (datasets " in out  # make test installs every extra
    assert "profile     none cached" in out
    assert "PROBLEM" not in out


def test_gpus_are_listed_with_memory_and_capability():
    facts = dataclasses.replace(machine.gather(), gpus=[H100, dataclasses.replace(H100, index=1)], nccl="2.27.5")
    lines = machine.render(facts)
    assert "gpu 0       NVIDIA H100 80GB HBM3, 85.0 GiB, compute capability 9.0" in lines
    assert ("auto        parallel.device = cuda, parallel.backend = nccl (2 GPU(s), one worker per GPU); "
            "precision.dtype = bf16 (GPUs of compute capability 9.0: bf16 tensor cores); shoal train --nproc 2 (one "
            "per GPU)") in lines
    v100 = dataclasses.replace(H100, name="Tesla V100-SXM2-32GB", capability=(7, 0))
    auto = next(line for line in machine.render(dataclasses.replace(facts, gpus=[v100])) if line.startswith("auto "))
    assert "precision.dtype = fp32 (compute capability 7.0 has no bf16 tensor cores)" in auto


def test_fp8_support_is_one_line():
    facts = dataclasses.replace(machine.gather(), gpus=[H100], nccl="2.27.5")
    fp8 = next(line for line in machine.render(facts) if line.startswith("fp8 "))
    assert fp8.endswith('supported (precision.dtype = "fp8")' if machine.float8.torchao_installed() else
                        f"install it with: {install_hint('fp8')}")
    a100 = dataclasses.replace(H100, name="NVIDIA A100-SXM4-80GB", capability=(8, 0))
    fp8 = next(line for line in machine.render(dataclasses.replace(facts, gpus=[a100])) if line.startswith("fp8 "))
    assert "but this GPU has compute capability 8.0" in fp8


@pytest.fixture
def gpu_machine(monkeypatch):
    """This machine seen as one with an H100 and PyPI's CUDA torch (NCCL, a large /dev/shm)."""
    monkeypatch.setattr(machine, "visible_gpus", lambda: (None, [H100]))
    monkeypatch.setattr(machine, "nccl_version", lambda: "2.27.5")
    monkeypatch.setattr(machine, "shm_bytes", lambda: 64 * 2**30)
    monkeypatch.setattr(machine.torch.version, "cuda", "13.0")


def one_failure(capsys, argv=("env", "--check")) -> str:
    assert main(list(argv)) == 1
    out = capsys.readouterr().out.splitlines()
    fails = [line for line in out if line.startswith("FAIL")]
    assert len(fails) == 1, out
    return fails[0]


def test_no_nccl_is_one_line_naming_the_install(gpu_machine, monkeypatch, capsys):
    monkeypatch.setattr(machine, "nccl_version", lambda: None)
    line = one_failure(capsys)
    assert "machine     no NCCL: torch" in line and "install PyPI's CUDA build of torch" in line


def test_a_small_dev_shm_is_one_line_naming_the_container_flag(gpu_machine, monkeypatch, capsys):
    monkeypatch.setattr(machine, "shm_bytes", lambda: 64 * 2**20)
    line = one_failure(capsys)
    assert "/dev/shm is 64.0 MiB: NCCL keeps its buffers" in line and "docker run --shm-size=1g" in line


def test_no_gpu_visible_says_which_of_its_causes(monkeypatch, capsys):
    """An NVIDIA device on the machine, none seen by torch: a CPU build, CUDA_VISIBLE_DEVICES, a driver
    older than torch's CUDA, or what torch said."""
    monkeypatch.setattr(machine, "nvidia_present", lambda: True)
    monkeypatch.setattr(machine, "visible_gpus", lambda: ("CUDA initialization: no CUDA-capable device", []))
    monkeypatch.setattr(machine.torch.version, "cuda", None)
    assert "torch " in one_failure(capsys) and "is a CPU build; install a CUDA build" in one_failure(capsys)
    monkeypatch.setattr(machine.torch.version, "cuda", "13.0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert "CUDA_VISIBLE_DEVICES='' hides every GPU; unset it" in one_failure(capsys)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(machine, "driver_cuda", lambda: (12, 4))
    monkeypatch.setattr(machine, "driver_version", lambda: "550.54.15")
    line = one_failure(capsys)
    assert ("the NVIDIA driver 550.54.15 runs CUDA up to 12.4, and torch" in line and "is built for CUDA 13.0; "
            "update the driver to 580.65.06 or newer" in line)
    monkeypatch.setattr(machine, "driver_cuda", lambda: (13, 0))
    assert "(torch says: CUDA initialization: no CUDA-capable device); check `nvidia-smi`" in one_failure(capsys)


def test_an_unsupported_torch_is_reported_not_crashed_on(monkeypatch, capsys):
    monkeypatch.setattr(compat, "VERSION", "2.9.1")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "torch       2.9.1 (UNSUPPORTED: shoal needs torch >= 2.11" in out
    assert "PROBLEM     shoal needs torch >= 2.11, and this environment has torch 2.9.1" in out
    assert "shoal needs torch >= 2.11" in one_failure(capsys)


def test_bad_worker_counts_are_one_line(gpu_machine, capsys):
    assert main(["env", "--check", "--nproc", "9"]) == 2
    err = capsys.readouterr().err
    assert err == ("shoal: error: --nproc 9: this machine has 1 GPU(s), and the check runs one worker per GPU "
                   "(NCCL refuses two on one); use --nproc 1 or fewer\n")
    assert main(["env", "--nproc", "2"]) == 2
    assert "add --check" in capsys.readouterr().err
    assert main(["env", "--check", "--nproc", "0"]) == 2


def test_a_slow_matmul_fails_naming_what_to_look_at():
    from shoal.env.check import matmul_line

    ok, _, text = matmul_line({"rank": 0, "device_name": "NVIDIA H100 80GB HBM3", "dtype": "bf16", "n": 8192,
                               "matmul_flops": 200e12, "peak": 989.4e12})
    assert not ok and "rank 0 on NVIDIA H100 80GB HBM3: bf16 8192^3 at 200 TFLOP/s, 20% of the data sheet's " \
                      "989 TFLOP/s: throttled clocks or a shared GPU?" in text
    ok, _, text = matmul_line({"rank": 1, "device_name": "the CPU", "dtype": "fp32", "n": 512, "matmul_flops": 5e10,
                               "peak": None})
    assert ok and text == "rank 1 on the CPU: fp32 512^3 at 50.0 GFLOP/s (no data sheet for this device)"


def test_a_workers_error_is_one_line_with_what_fixes_it(monkeypatch):
    """The workers' own failure (here NCCL's answer to two ranks on one GPU) comes back as the check's one line."""
    import json
    from pathlib import Path

    from shoal.env import check
    from shoal.launch import restart

    def failing(argv, nproc, **kw):
        out = argv[argv.index("--out") + 1]
        Path(f"{out}.rank0.json").write_text(json.dumps({"rank": 0, "error": "DistBackendError: NCCL error in: "
                                                         "ProcessGroupNCCL.cpp:3690, invalid usage"}))
        return 1

    monkeypatch.setattr(restart, "launch", failing)
    [(ok, name, text)] = check.workers(machine.gather(), 2)
    assert not ok and name == "collective"
    assert text == ("rank 0: DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:3690, invalid usage; NCCL "
                    "refuses two ranks on one GPU: one worker per GPU (--nproc at most the GPUs)")


def test_an_install_hint_names_a_command_that_works_from_where_shoal_came_from(monkeypatch, tmp_path):
    """pip's direct_url.json of this install: a clone installed -e (as `make run` installs it), a local wheel,
    or nothing (from an index: the package by name)."""
    from importlib import metadata

    class Dist:
        def __init__(self, text):
            self.text = text

        def read_text(self, name):
            return self.text

    wheel = tmp_path / "shoal-0.1.0-py3-none-any.whl"
    wheel.write_bytes(b"")
    for text, hint in [
        (f'{{"url": "file://{tmp_path}", "dir_info": {{"editable": true}}}}',
         f"{sys.executable} -m pip install -e '{tmp_path}[ray]'"),
        (f'{{"url": "file://{wheel}", "archive_info": {{}}}}', f"{sys.executable} -m pip install '{wheel}[ray]'"),
        (None, "pip install 'shoal[ray]'"),
        ('{"url": "file:///gone/away", "dir_info": {}}', "pip install 'shoal[ray]'"),  # the clone was removed
    ]:
        monkeypatch.setattr(metadata, "distribution", lambda name, text=text: Dist(text))
        assert install_hint("ray") == hint
