"""What a config and `shoal train` leave to the machine: on a node of GPUs, one worker per GPU and bf16
where the GPUs have bf16 tensor cores; on the CPU, one worker and fp32, as before (every CPU test keeps its
meaning). The GPUs are faked here the way the launcher sees them: CUDA available, NVML's answers."""

from __future__ import annotations

import argparse

import pytest
import torch

from shoal import hardware
from shoal.cli.train import node_flags
from shoal.config import load_config, resolve_auto

H100S = [(9, 0)] * 8


@pytest.fixture
def gpus(monkeypatch):
    """A node whose GPUs have the compute capabilities given (list) or cannot be read (None)."""
    def node(capabilities):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(capabilities or [0] * 8))
        monkeypatch.setattr(hardware, "gpu_capabilities", lambda: capabilities)
    return node


def test_on_the_cpu_auto_is_fp32():
    assert load_config(None, []).precision.dtype == "fp32"
    cfg, chosen = resolve_auto(load_config(None, [], resolve=False))
    assert cfg.precision.dtype == "fp32" and chosen == 'precision.dtype "auto": fp32 (training on the CPU)'


@pytest.mark.parametrize("capabilities, sets, dtype", [
    (H100S, [], "bf16"),
    ([(8, 0), (9, 0)], [], "bf16"),                        # an A100 beside an H100: the lowest decides
    ([(7, 0)] * 2, [], "fp32"),                            # V100s: no bf16 tensor cores
    (None, [], "fp32"),                                    # NVML could not say
    (H100S, ['parallel.device="cpu"'], "fp32"),            # GPUs there, the run on the CPU
    (H100S, ['precision.dtype="fp16"'], "fp16"),           # a dtype named is kept
    ([(7, 0)], ['precision.dtype="bf16"'], "bf16"),
])
def test_auto_is_bf16_on_gpus_with_bf16_tensor_cores(gpus, capabilities, sets, dtype):
    gpus(capabilities)
    cfg = load_config(None, sets)
    assert cfg.precision.dtype == dtype
    assert f'dtype = "{dtype}"' in cfg.to_toml()  # the run dir's config.toml stores the value chosen


def test_the_choice_is_said_in_one_line(gpus):
    gpus(H100S)
    _, chosen = resolve_auto(load_config(None, [], resolve=False))
    assert chosen == 'precision.dtype "auto": bf16 (GPUs of compute capability 9.0: bf16 tensor cores)'
    assert resolve_auto(load_config(None, ['precision.dtype="fp32"'], resolve=False))[1] is None


def launch_args(**given) -> argparse.Namespace:
    flags = {"nnodes": None, "node_rank": None, "rdzv_endpoint": None, "nproc": None, "max_restarts": 0,
             "rdzv_timeout": None}
    return argparse.Namespace(**{**flags, **given})


def test_train_without_nproc_takes_every_gpu_of_the_node(gpus, monkeypatch, capsys):
    for var in ("SLURM_JOB_ID", "PET_NNODES", "SM_HOSTS", "CLUSTER_SPEC", "AZUREML_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    gpus(H100S)
    args = launch_args()
    assert node_flags(args, every_gpu=True) == (1, 1) and args.nproc == 8
    assert capsys.readouterr().err == "shoal: 8 workers, one per GPU of this node (--nproc N for fewer)\n"
    args = launch_args(nproc=2)  # the flag wins, silently
    node_flags(args, every_gpu=True)
    assert args.nproc == 2 and capsys.readouterr().err == ""
    args = launch_args()  # a run on the CPU of a GPU node (parallel.device = "cpu"), and `shoal run`: torchrun's 1
    node_flags(args, every_gpu=False)
    assert args.nproc == 1 and capsys.readouterr().err == ""


def test_a_schedulers_workers_per_node_win(gpus, monkeypatch, capsys):
    """One Slurm node whose step gave this node 4 GPUs: 4 workers, as Slurm says (launch/environment.py)."""
    from shoal.launch import environment

    gpus(H100S)
    monkeypatch.setattr(environment.shutil, "which", lambda name: None)  # no scontrol: the node list expanded here
    for name, value in {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_JOB_NUM_NODES": "1",
                        "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "1", "SLURM_NODEID": "0",
                        "SLURM_JOB_NODELIST": "gpu01", "SLURM_STEP_NODELIST": "gpu01",
                        "SLURM_GPUS_ON_NODE": "4"}.items():
        monkeypatch.setenv(name, value)
    args = launch_args()
    node_flags(args, every_gpu=True)
    assert args.nproc == 4, capsys.readouterr().err
    assert "one per GPU of this node" not in capsys.readouterr().err
