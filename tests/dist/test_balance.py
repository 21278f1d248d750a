"""balance.mode = "throughput" trains what one process trains: dp 2 with rank 1 slowed by an injected
per-sample cost (tests/fixtures/uneven.py) takes an uneven split of the global batch (recorded per step
as batch_share), yet its losses and final weights match the one-process run within 1e-5 (fp32); so
does dp 2 on equal ranks. Layouts it cannot split refuse in one line."""

import pytest
from test_layouts import STEPS, assert_same_training

from conftest import read_metrics
from harness import train as train_on_ranks

pytestmark = pytest.mark.serial  # the shares follow measured throughput

UNEVEN = ['model.name="uneven:build"', "model.seq_len=32", "model.rank=1", "data.max_bytes=200000",
          "train.val_batches=2", "metrics.tensorboard=false", "metrics.progress=false", f"train.steps={STEPS}",
          "train.warmup_steps=2", "train.global_batch_size=16", "train.micro_batch_size=4", "train.val_interval=0",
          "metrics.log_interval=1", "checkpoint.enabled=false", "metrics.profile=false"]
BALANCED = ['balance.mode="throughput"', "balance.interval=1"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, ranks):
    run_dir = tmp_path_factory.mktemp("dp1") / "run"
    ranks(1).run(train_on_ranks, [*UNEVEN, "model.delay_s=0"], str(run_dir))
    return run_dir


# prefetched batches (2 steps ahead) keep the split they were built with: a new one starts 3 steps later
@pytest.mark.parametrize("delay_s, prefetch", [(0.02, 2), (0.0, 0)])
def test_balanced_dp2_trains_what_one_process_trains(tmp_path, ranks, one_process, delay_s, prefetch):
    run_dir = tmp_path / "run"
    ranks(2).run(train_on_ranks, [*UNEVEN, *BALANCED, f"model.delay_s={delay_s}", f"data.prefetch={prefetch}"],
                 str(run_dir))
    assert_same_training(run_dir, one_process, rtol=1e-5, atol=1e-5)
    shares = [m["batch_share"] for m in read_metrics(run_dir)]
    assert all(sum(s) == 16 and min(s) >= 1 for s in shares)
    # uniform until the first agreement, after step 2 (step 1 is warm-up, not measured)
    assert shares[:2 + prefetch + 1] == [[8, 8]] * (2 + prefetch + 1)
    # rank 1 pays 20 ms per sample, ~25x rank 0's compute (~1 ms per sample here). The split rests on one
    # measured step (step 1), so rank 0 would have to lose ~100 ms to other processes in it to reach 7 samples;
    # at 4 ms per sample a 30 ms preemption (two serial tests share two cores) once gave [9, 7]
    if delay_s:
        assert shares[-1][1] <= 6, shares


@pytest.mark.parametrize("extra", [["parallel.zero=2"], ["parallel.tp=2"], ["parallel.pp=2"],
                                   ['sync.mode="local-sgd"']])
def test_layouts_it_cannot_split_are_refused(extra):
    from shoal.config import load_config
    from shoal.errors import UserError

    with pytest.raises(UserError, match='balance.mode = "throughput"') as e:
        load_config(None, [*BALANCED, *extra])
    assert "\n" not in str(e.value)

