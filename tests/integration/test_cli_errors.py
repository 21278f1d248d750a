"""Bad input: one line on stderr naming the key and the fix, exit code 2, no traceback, no worker started."""

import pytest
import torch

from conftest import run_cli
from shoal.cli import main

CASES = {
    "unknown key": (["--set", "train.stepz=3"], "unknown key train.stepz; did you mean train.steps?"),
    "wrong type": (["--set", 'train.steps="many"'], "train.steps = 'many': must be a valid integer"),
    "out of range": (["--set", "train.warmup_steps=-1"], "train.warmup_steps = -1: must be greater than or equal to 0"),
    "dp x tp x pp != world": (["--nproc", "2", "--set", "parallel.dp=3"],
                              "parallel.dp (3) x parallel.tp (1) x parallel.pp (1) = 3, but 2 processes were started"),
    "batch not divisible": (["--nproc", "2", "--set", "train.global_batch_size=24", "--set", "train.micro_batch_size=8"],
                            "train.global_batch_size (24) must be divisible by train.micro_batch_size (8) x dp (2) = 16"),
    "missing data path": (["--set", "data.source=text", "--set", "data.path=/no/such/corpus"],
                          "data.path = '/no/such/corpus' does not exist"),
    "unknown model name": (["--set", "model.name=gtp"], 'unknown model.name = "gtp"'),
    "fp16 on CPU": (["--set", "precision.dtype=fp16"], '"fp16" trains on GPUs only'),
    "fp8 on CPU": (["--set", "precision.dtype=fp8"], 'precision.dtype = "fp8" trains on NVIDIA GPUs of compute '
                   'capability 8.9 or newer (L4, L40S, H100, H200), not on the CPU; use "bf16"'),
    "CUDA graphs on the CPU": (["--set", "train.compile=reduce-overhead", "--set", "parallel.device=cpu"],
                               'train.compile = "reduce-overhead" captures CUDA graphs, but the workers train on '
                               "the CPU"),
    "CUDA graphs with a pipeline": (["--set", "train.compile=reduce-overhead", "--set", "parallel.pp=2"],
                                    'train.compile = "reduce-overhead" captures CUDA graphs, but parallel.pp = 2'),
    "chunked loss with tensor parallelism": (
        ["--nproc", "2", "--set", "parallel.tp=2", "--set", "model.loss_chunks=4"],
        "model.loss_chunks = 4 with parallel.tp = 2: tensor parallelism splits the logits over the vocabulary"),
    "bad --nproc": (["--nproc", "0"], "--nproc (0) must be >= 1"),
    "bad --nnodes": (["--nnodes", "two"], "--nnodes 'two': expected a number of nodes"),
    "elastic range MIN > MAX": (["--nnodes", "3:2"], "--nnodes 3:2: MIN (3) is above MAX (2); give MIN:MAX"),
    "elastic range below tp x pp": (["--nnodes", "1:4", "--rdzv-endpoint", "127.0.0.1:29400", "--set", "parallel.tp=2"],
                                    "--nnodes 1:4: MIN x --nproc = 1 workers, below the parallel.tp x parallel.pp = 2"),
    "elastic range that cannot heal live": (
        ["--nnodes", "1:2", "--nproc", "2", "--rdzv-endpoint", "127.0.0.1:29400", "--set", "parallel.zero=1"],
        "--nnodes 1:2: parallel.zero = 1 shards each replica's state over the workers, which cannot heal live yet "
        "(a live run needs every worker to hold a whole replica: data parallel, parallel.zero = 0, each worker its "
        "own replica); give a fixed --nnodes instead: a failure then restarts every worker from the newest "
        "checkpoint (--max-restarts)"),
    "streaming in a live run": (
        ["--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:29400", "--set", 'sync.mode="diloco"', "--set",
         "sync.every=4", "--set", "sync.fragments=2"],
        "--nnodes 1:2: sync.fragments = 2 and sync.fragment_delay = 0 keep the replicas apart at every step but the "
        "last, which cannot heal live yet"),
    "fragments that do not divide the blocks": (
        ["--set", 'sync.mode="diloco"', "--set", "sync.every=4", "--set", "sync.fragments=3"],
        "sync.fragments = 3 must divide the model's blocks (model.n_layer = 4); set sync.fragments to a divisor of 4"),
    "multi-node without endpoint": (["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint"),
    "bad --rdzv-timeout": (["--rdzv-timeout", "0"], "--rdzv-timeout (0) must be > 0 seconds"),
    "bad --rdzv-endpoint": (["--nnodes", "2", "--rdzv-endpoint", "node0"], "--rdzv-endpoint node0: expected HOST:PORT"),
    "fewer pipeline micro-batches than stages": (
        ["--nproc", "4", "--set", "parallel.dp=2", "--set", "parallel.pp=2"],
        'parallel.pp_schedule = "1f1b" needs at least parallel.pp (2) micro-batches per step, but '
        "train.micro_batch_size (16) gives each rank 1 (per-rank batch 16 = train.global_batch_size 32 / dp 2); "
        "set train.micro_batch_size = 8 or parallel.pp_microbatches = 2"),
    "packing for a model that takes no positions": (
        ["--set", "model.name=moe", "--set", "model.experts=4", "--set", "data.pack_documents=true"],
        'data.pack_documents restarts the positions at each document, which model.name = "moe" does not take'),
    "packing into pipeline stages": (
        ["--nproc", "2", "--set", "parallel.pp=2", "--set", "train.micro_batch_size=8", "--set",
         "data.pack_documents=true"], "data.pack_documents with parallel.pp = 2 is not built yet"),
    "packing a token file without its end of document": (
        ["--set", "data.source=tokens", "--set", "data.path=/no/such.bin", "--set", "data.pack_documents=true"],
        'data.pack_documents with data.source = "tokens" needs data.eos_id'),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_exit_2(case, capsys, tmp_path):
    if case in ("fp16 on CPU", "fp8 on CPU") and torch.cuda.is_available():
        pytest.skip("fp16 and fp8 are allowed where CUDA is")
    args, expected = CASES[case]
    code = main(["train", "configs/gpt-tiny.toml", "--run-dir", str(tmp_path / "run"), *args])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("shoal: error: ") and err.count("\n") == 1, err
    assert expected in err
    assert not (tmp_path / "run").exists(), "nothing may start before the config is valid"


def test_the_real_command_prints_no_traceback(tmp_path):
    r = run_cli(["train", "configs/gpt-tiny.toml", "--set", "train.lr=0"], timeout=60)
    assert r.returncode == 2
    assert r.stderr.splitlines() == ["shoal: error: --set: train.lr = 0: must be greater than 0"]
    assert "Traceback" not in r.output


def test_a_range_of_workers_per_node_is_refused_naming_the_node_range(capsys):
    """--nproc takes one number (argparse's usage line, then the reason): a live run's range is --nnodes."""
    with pytest.raises(SystemExit) as e:
        main(["train", "--nproc", "1:2", "--nnodes", "1:2"])
    assert e.value.code == 2
    assert "argument --nproc: '1:2': --nproc takes one number" in capsys.readouterr().err
