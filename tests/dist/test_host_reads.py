"""A step that is not logged never makes the host wait for the device: on every layout, the host reads
no tensor value during such a step but the one late read of the step before's report (benchmarks/read_counter.py
counts them, as a GPU would feel them), and a run whose steps are read late trains exactly the run whose
steps are all read at once."""

from pathlib import Path

import pytest
import torch

from conftest import read_weights

STEPS = 6
BASE = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.seq_len=32", "data.max_bytes=200000",
        "train.val_batches=2", "metrics.tensorboard=false", "metrics.progress=false", f"train.steps={STEPS}",
        "train.warmup_steps=2", "train.global_batch_size=8", "train.micro_batch_size=2", "train.val_interval=0",
        "checkpoint.enabled=false"]

# name -> (processes, overrides)
LAYOUTS = {"dp1": (1, []), "dp1-bf16": (1, ['precision.dtype="bf16"']), "dp1-sgd": (1, ['train.optimizer="sgd"']),
           "dp2": (2, []), "dp2-zero1": (2, ["parallel.zero=1"]), "dp2-zero2": (2, ["parallel.zero=2"]),
           "dp2-zero3": (2, ["parallel.zero=3"]), "tp2": (2, ["parallel.tp=2"]),
           "tp2-sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
           "pp2-1f1b": (2, ["parallel.pp=2", 'parallel.pp_schedule="1f1b"', "checkpoint.final_weights=false"]),
           "dp2-tp2-zero3": (4, ["parallel.tp=2", "parallel.zero=3"]),
           "dp2-bf16-compressed": (2, ['comm.compression="bf16"'])}


def counted_run(env, overrides: list[str], run_dir: str) -> dict[int, list[str]]:
    """`shoal train` on this rank (as the harness runs it), counting its host reads step by step: what read,
    per step."""
    import contextlib
    import io

    from benchmarks.read_counter import HostReads, as_on_a_gpu

    from shoal.comm.collectives import Comm
    from shoal.comm.phase import Phase
    from shoal.config import load_config
    from shoal.preflight import check_job
    from shoal.worker import run_rank

    cfg = load_config(None, overrides)
    job = check_job(cfg, [env.world_size], cuda=False, quiet=True)
    phase = Phase()
    with HostReads(phase) as reads, as_on_a_gpu(reads), contextlib.redirect_stdout(io.StringIO()):
        run_rank(cfg, job, Path(run_dir), env, Comm(env.store, env.rank, env.world_size), "never", phase=phase)
    return dict(reads.where)


# the fast tier keeps one of a kind: one process, a sharded layout, a split one, a pipeline
FAST = ("dp1", "dp2-zero3", "tp2-sp", "pp2-1f1b")


def tiered(names):
    return [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in names]


@pytest.mark.parametrize("layout", tiered(LAYOUTS))
def test_a_step_that_is_not_logged_reads_nothing_from_the_device(ranks, tmp_path, layout):
    nproc, extra = LAYOUTS[layout]
    per_rank = ranks(nproc).run(counted_run, [*BASE, *extra, "metrics.log_interval=100"], str(tmp_path / "run"))
    # torch's pipeline schedules infer their stages' shapes on their first step, exchanging them between the
    # stages (read on the host): once, as compile's first step is once
    first = 2 if layout.startswith("pp") else 1
    for rank, where in enumerate(per_rank):
        quiet = {step: what for step, what in where.items() if first <= step < STEPS}  # the last step is logged
        assert not quiet, f"rank {rank} read the device on steps it does not log: {quiet}"
        assert where.get(STEPS), "the logged step reads its values (else the counter counts nothing)"


@pytest.mark.parametrize("layout", ["dp1", *[pytest.param(n, marks=pytest.mark.slow) for n in ("dp2-zero3", "tp2-sp")]])
def test_steps_read_late_train_the_run_whose_steps_are_read_at_once(ranks, tmp_path, layout):
    from harness import train

    nproc, extra = LAYOUTS[layout]
    late, at_once = tmp_path / "late", tmp_path / "at_once"
    ranks(nproc).run(train, [*BASE, *extra, "metrics.log_interval=100"], str(late))
    ranks(nproc).run(train, [*BASE, *extra, "metrics.log_interval=1"], str(at_once))
    # the same kernels in the same order on one machine: equal
    for name, w in read_weights(at_once).items():
        torch.testing.assert_close(read_weights(late)[name], w, rtol=0, atol=0, msg=name)
