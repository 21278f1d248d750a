"""What does the step profile cost? The same dp=2 run of the default GPT with metrics.profile on and
off, alternated in rounds so machine noise hits both alike; per run the wall time per step (median
over intervals of 10 logged steps after a warm-up, everything between steps included), per setting
the median over rounds.

    python -m benchmarks.profile_overhead [--rounds 3] [--steps 60]

Target: the profile costs < 2% of step time. Last line:
    RESULT profile_overhead=<(on - off) / off>
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WARMUP, INTERVAL = 10, 10


def run(profile: bool, steps: int, tmp: Path) -> float:
    run_dir = tmp / f"run-{len(list(tmp.iterdir()))}"
    sets = [f"metrics.profile={str(profile).lower()}", f"train.steps={steps}", f"metrics.log_interval={INTERVAL}",
            "train.val_interval=0", "train.val_batches=1", "metrics.tensorboard=false",
            "checkpoint.final_weights=false",
            "checkpoint.enabled=false", "parallel.threads_per_worker=1", "train.micro_batch_size=8",
            "train.global_batch_size=16"]
    cmd = [sys.executable, "-m", "shoal", "train", "--nproc", "2", "--run-dir", str(run_dir),
           *[a for s in sets for a in ("--set", s)]]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    m = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    stamps = [x["time"] for x in m if "step_time_s" in x and x["step"] >= WARMUP and x["step"] % INTERVAL == 0]
    return statistics.median((b - a) / INTERVAL for a, b in itertools.pairwise(stamps))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    a = ap.parse_args()
    on, off = [], []
    with tempfile.TemporaryDirectory() as d:
        for r in range(a.rounds):
            off.append(run(False, a.steps, Path(d)))
            on.append(run(True, a.steps, Path(d)))
            print(f"round {r + 1}: off {off[-1] * 1e3:.1f} ms/step, on {on[-1] * 1e3:.1f} ms/step", flush=True)
    overhead = (statistics.median(on) - statistics.median(off)) / statistics.median(off)
    print(f"RESULT profile_overhead={overhead:.4f}")


if __name__ == "__main__":
    main()
