"""Is a slowed rank named? Runs of dp=2 on a small GPT (tests/fixtures/faulty.py) in which one rank's
training forwards sleep model.sample_delay_s per sample (the slowed rank alternates between runs);
a run counts as correct when every logged step names that rank and no other, and the summary names it.

    python -m benchmarks.straggler [--runs 10] [--delay 0.002]

Last line:
    RESULT straggler_named=<correct>/<runs>
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(slow: int, delay: float, run_dir: Path) -> bool:
    sets = ['model.name="faulty:build"', "model.seq_len=32", "model.rank=0", 'model.mode="none"', "model.at_call=0",
            f"model.slow_rank={slow}", f"model.sample_delay_s={delay}", "data.max_bytes=100000", "train.steps=30",
            "train.global_batch_size=8", "train.micro_batch_size=4", "train.val_interval=0", "train.val_batches=1",
            "metrics.log_interval=10", "metrics.tensorboard=false", "checkpoint.enabled=false",
            "checkpoint.final_weights=false", "parallel.threads_per_worker=1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests/fixtures")}
    subprocess.run([sys.executable, "-m", "shoal", "train", "--nproc", "2", "--run-dir", str(run_dir),
                    *[a for s in sets for a in ("--set", s)]], check=True, cwd=ROOT, stdout=subprocess.DEVNULL, env=env)
    logged = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    named = [m.get("straggler_rank") for m in logged if "compute_s_per_rank" in m]
    summary = json.loads((run_dir / "summary.json").read_text())["profile"]["stragglers"]
    return bool(named) and all(r == slow for r in named) and [s["rank"] for s in summary] == [slow]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--delay", type=float, default=0.002)
    a = ap.parse_args()
    correct = 0
    with tempfile.TemporaryDirectory() as d:
        for i in range(a.runs):
            ok = run(i % 2, a.delay, Path(d) / f"run{i}")
            correct += ok
            print(f"run {i + 1}: slowed rank {i % 2}, {'named' if ok else 'NOT named'}", flush=True)
    print(f"RESULT straggler_named={correct}/{a.runs}")


if __name__ == "__main__":
    main()
