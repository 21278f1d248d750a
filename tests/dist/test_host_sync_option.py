"""metrics.host_syncs counts the training thread's reads of device values step by step, where they were made,
and nothing else: a model that reads one value per training forward adds exactly its micro-batches' count to
each step, at its own line."""

import json
from pathlib import Path

STEPS = 4
RUN = ['model.name="faulty:build"', "model.seq_len=32", "model.rank=0", "model.mode=none", "model.at_call=0",
       "data.max_bytes=200000", "train.val_batches=1", "metrics.tensorboard=false", "metrics.progress=false",
       f"train.steps={STEPS}", "train.global_batch_size=8", "train.micro_batch_size=4", "train.val_interval=0",
       "checkpoint.enabled=false", "metrics.log_interval=1", "metrics.host_syncs=true"]


def counted(ranks, run_dir: Path, reads: int) -> tuple[dict, list[dict]]:
    from harness import train

    summary, _ = ranks(1).run(train, [*RUN, f"model.reads={reads}"], str(run_dir))[0]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summary, [m for m in lines if "host_syncs" in m]


def test_a_read_in_the_model_is_counted_once_per_micro_batch_at_its_line(ranks, tmp_path):
    base, base_lines = counted(ranks, tmp_path / "base", reads=0)
    more, more_lines = counted(ranks, tmp_path / "more", reads=1)
    assert [m["step"] for m in more_lines] == list(range(1, STEPS + 1))
    micro_batches = 2  # 8 samples in micro-batches of 4 on one rank
    assert [m["host_syncs"] - b["host_syncs"] for m, b in zip(more_lines, base_lines, strict=True)] == \
        [micro_batches] * STEPS
    assert more["host_syncs_per_step"] == base["host_syncs_per_step"] + micro_batches
    read_at = [site for site in more["host_sync_sites"] if "faulty.py" in site]
    assert len(read_at) == 1 and more["host_sync_sites"][read_at[0]] == micro_batches * STEPS
    assert not any("faulty.py" in site for site in base["host_sync_sites"])


def test_a_run_without_the_option_counts_nothing(ranks, tmp_path):
    from harness import train

    summary, _ = ranks(1).run(train, [*RUN[:-1], "model.reads=1"], str(tmp_path / "run"))[0]
    assert "host_syncs_per_step" not in summary and "host_sync_sites" not in summary
    assert not any("host_syncs" in line for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
