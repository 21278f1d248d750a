"""The step profile of a real two-rank run: rank 1 slowed per sample is named the straggler, the
waits are seen on the fast rank, the parts add up to each step, and trace_steps writes a trace."""

import json
from pathlib import Path

import pytest

from harness import train

pytestmark = pytest.mark.serial  # the straggler is named by measured compute, and waits are measured

CONFIG = ['model.name="faulty:build"', "model.seq_len=32", "model.rank=0", 'model.mode="none"', "model.at_call=0",
          "model.slow_rank=1", "model.sample_delay_s=0.02", "data.max_bytes=100000", "train.steps=6",
          "train.global_batch_size=8", "train.micro_batch_size=4", "train.val_interval=0", "train.val_batches=1",
          "metrics.log_interval=3", "metrics.tensorboard=false", "metrics.trace_steps=[2, 2]",
          "checkpoint.enabled=false", "checkpoint.final_weights=false", "parallel.threads_per_worker=1",
          'metrics.peak="a100"']


def test_slowed_rank_is_named_and_the_parts_add_up(ranks, tmp_path):
    (summary, printed), _ = ranks(2).run(train, CONFIG, str(tmp_path))
    assert "rank 1: compute" in printed and "x the median of the other ranks" in printed
    assert summary["profile"]["stragglers"][0]["rank"] == 1
    assert summary["profile"]["stragglers"][0]["worst_ratio"] > 2  # 80 ms of sleep per step against ~2-20 ms
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for m in rows:
        parts = sum(v for k, v in m.items() if k.startswith("time_"))
        assert parts == pytest.approx(m["step_time_s"], rel=0.02)
        assert m["straggler_rank"] == 1 and 0 < m["mfu"] < 1
    # rank 0 computes fast and then waits for rank 1 in dp: its wait shows, its compute stays small
    assert rows[-1]["time_exposed_dp_s"] > rows[-1]["time_compute_s"]
    assert list(Path(tmp_path, "traces").glob("rank*.pt.trace.json")) and len(list((tmp_path / "traces").iterdir())) == 2


GPT = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.seq_len=16", "data.max_bytes=50000",
       "train.steps=3", "train.global_batch_size=8", "train.micro_batch_size=2", "train.val_interval=0",
       "train.val_batches=1", "metrics.log_interval=1", "metrics.tensorboard=false", "checkpoint.enabled=false",
       "checkpoint.final_weights=false", "parallel.threads_per_worker=1", 'metrics.peak="a100"']


@pytest.mark.parametrize("layout, axis", [(["parallel.tp=2"], "tp"), (["parallel.zero=3"], "dp"),
                                          (["parallel.pp=2", "parallel.pp_microbatches=4"], "pp"),
                                          pytest.param(['model.name="moe"', "model.experts=4", "parallel.ep=2"], "ep",
                                                       marks=pytest.mark.slow),
                                          pytest.param(["parallel.cp=2"], "cp", marks=pytest.mark.slow)])
# make test-fast keeps 3 of 5
def test_waits_inside_the_model_are_exposed_on_their_axis(ranks, tmp_path, layout, axis):
    """DTensor's all-reduces (tp), FSDP2's all-gathers (ZeRO 3: dp) and a pipeline's receives (pp) are
    torch's collectives, not shoal's: their waits are timed all the same, and still add up to the step. Expert
    parallelism's all-to-alls (ep) and context parallelism's gathers of keys and values (cp) are shoal's, on axes
    of their own."""
    (summary, _), _ = ranks(2).run(train, [*GPT, *layout], str(tmp_path))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for m in rows:
        parts = sum(v for k, v in m.items() if k.startswith("time_"))
        assert parts == pytest.approx(m["step_time_s"], rel=0.02)
    assert summary["profile"][f"median_time_exposed_{axis}_s"] > 0
    if axis == "tp":  # 2 blocks x 6 split matrices x 4 micro-batches of all-reduces: no small share of a step
        assert summary["profile"]["median_time_exposed_tp_s"] > 0.05 * summary["median_step_time_s"]
    if axis == "pp":  # a stage's idling is first the schedule's bubble
        assert summary["profile"]["median_time_bubble_s"] > 0
