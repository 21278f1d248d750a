"""The preflight refuses, before any worker starts, every layout the model, the data or torch cannot
take: one line on stderr naming the key and a fix, exit code 2, no run dir created. (In process: the
CLI's own entry point, no launcher needed to show a refusal.)"""

import pytest

from conftest import TINY_GPT
from shoal.cli import main


@pytest.mark.parametrize("overrides,nproc,message", [
    (["parallel.zero=2"], 1, "parallel.zero = 2 shards state across the dp ranks, but dp = 1"),
    (["parallel.zero=3", "parallel.offload=true"], 2, "parallel.offload = true moves sharded state from GPU"),
    (["parallel.zero=1", "parallel.offload=true"], 2, "parallel.offload = true needs parallel.zero = 2 or 3"),
    (["parallel.zero=4"], 2, "parallel.zero"),
    (["parallel.tp=2", "parallel.zero=1"], 4, "parallel.zero = 1 with parallel.tp = 2 is not supported"),
    (["parallel.tp=4"], 4, "parallel.tp (4) must divide model.n_head (2); choose a tp that divides it"),
    (["parallel.tp=2", "model.vocab_size=257"], 2,
     "parallel.tp (2) must divide the vocabulary (257); set model.vocab_multiple = 2 to pad it to 258"),
    (["parallel.tp=2", "model.dropout=0.1"], 2, "model.dropout > 0 with parallel.tp > 1 is not supported"),
    (["parallel.tp=2", 'model.name="resnet"', 'data.source="synthetic-images"'], 2,
     'parallel.tp = 2, but model "resnet" cannot be split by tensor parallelism'),
    (["parallel.sequence_parallel=true"], 2, "parallel.sequence_parallel = true splits the sequence over the tp"),
    (["parallel.tp=2", "parallel.sequence_parallel=true", "model.seq_len=33"], 2,
     "parallel.tp (2) must divide model.seq_len (33)"),
    (["parallel.pp=2", "model.n_layer=1", 'parallel.pp_schedule="interleaved-1f1b"'], 2,
     "parallel.pp (2) x parallel.pp_stages_per_rank (2) = 4 stages, but the model has only 3 layers"),
    (["parallel.pp=2", "parallel.zero=1"], 4, "parallel.zero = 1 with parallel.pp = 2 is not supported"),
    (["parallel.pp=2", "parallel.pp_split=[3, 2]"], 2, "parallel.pp_split = [3, 2] must give 2 stages"),
    (["parallel.pp=2", "parallel.pp_microbatches=3"], 2, "parallel.pp_microbatches (3) must divide the per-rank"),
    (["parallel.pp=2", 'model.name="resnet"', 'data.source="synthetic-images"'], 2,
     'parallel.pp = 2, but model "resnet" cannot be split into pipeline stages'),
    (["parallel.tp=3"], 2, "parallel.tp (3) x parallel.pp (1) = 3 does not divide the 2 processes"),
    # torch's schedules would raise in every worker: fewer micro-batches than stages
    (["parallel.dp=2", "parallel.pp=2", "train.global_batch_size=32", "train.micro_batch_size=16"], 4,
     'parallel.pp_schedule = "1f1b" needs at least parallel.pp (2) micro-batches per step, but '
     "train.micro_batch_size (16) gives each rank 1 (per-rank batch 16 = train.global_batch_size 32 / dp 2); "
     "set train.micro_batch_size = 8 or parallel.pp_microbatches = 2"),
    (["parallel.pp=2", "parallel.pp_microbatches=1"], 2,
     'parallel.pp_schedule = "1f1b" needs at least parallel.pp (2) micro-batches per step, but '
     "parallel.pp_microbatches = 1"),
    (["parallel.pp=2", "train.global_batch_size=2", "train.micro_batch_size=1", "parallel.dp=2"], 4,
     "set train.global_batch_size to at least 4"),
    (["parallel.pp=4", "train.global_batch_size=6", "train.micro_batch_size=2"], 4,
     "make the per-rank batch (6) a multiple of parallel.pp (4) through train.global_batch_size"),
])
def test_invalid_layouts_fail_before_start(tmp_path, capsys, overrides, nproc, message):
    base = [*TINY_GPT, "--set", "train.steps=2"]  # should a case be accepted after all, it ends at once
    if any(o.startswith("model.name=") for o in overrides):  # another model: without the GPT's keys
        pairs = zip(base[::2], base[1::2], strict=True)
        base = [a for flag, value in pairs if not value.startswith("model.") for a in (flag, value)]
    code = main(["train", "--nproc", str(nproc), "--run-dir", str(tmp_path / "run"), *base,
                 *[a for o in overrides for a in ("--set", o)]])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], err
    assert not (tmp_path / "run").exists()  # refused before any worker started
