"""What does shoal cost over plain torch DDP, and how well does data parallelism scale here?

Runs, alternated in rounds so machine noise hits both alike:
  - shoal dp=2 (2 workers x 1 thread) on the default GPT;
  - a minimal hand-written DDP loop (plain_ddp.py, torchrun, 2 x 1 thread), same model and batch;
  - shoal dp=1 (1 worker x 1 thread), same micro-batch, for the scaling efficiency.
Per run, the wall time per step: over each interval of 10 steps after a warmup (everything the loop
does between steps included: shoal's metrics, memory accounting and hooks at their default interval,
as in the plain loop), the median interval; across rounds, the median of those.

    python -m benchmarks.dp_overhead [--rounds 3] [--steps 60]

Prints the median step-time ratio shoal/DDP (target <= 1.03) and the scaling efficiency
throughput(2 x 1 thread) / (2 x throughput(1 x 1 thread)) of shoal (target >= 0.9) and of plain DDP
(from its step time, against the same one-process baseline). Last line:
    RESULT ratio=<shoal/DDP> efficiency=<shoal's scaling efficiency> ddp_efficiency=<plain DDP's>
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
WARMUP = 10  # steps dropped from each run: allocator warm-up, first-touch, thread pools
INTERVAL = 10  # metrics.log_interval's default: shoal writes metrics every 10 steps
SEQ_LEN = 128  # set on configs/gpt-tiny.toml below (measured so), as plain_ddp.py's default


def per_step(stamps: list[float]) -> float:
    """Median over intervals of INTERVAL steps of the wall time per step: everything the loop does
    between two steps counts (metrics, memory accounting, hooks), as in the plain loop."""
    return statistics.median((b - a) / INTERVAL for a, b in itertools.pairwise(stamps))


def shoal_run(nproc: int, steps: int, micro: int, tmp: Path) -> float:
    """Wall time per step of one shoal run (its logging at the default interval)."""
    run_dir = tmp / f"shoal-{nproc}-{len(list(tmp.iterdir()))}"
    cmd = [sys.executable, "-m", "shoal", "train", str(ROOT / "configs/gpt-tiny.toml"), "--nproc", str(nproc),
           "--run-dir", str(run_dir), "--set", f"train.steps={steps}", "--set", f"train.micro_batch_size={micro}",
           "--set", f"train.global_batch_size={2 * micro}", "--set", "parallel.threads_per_worker=1",
           "--set", f"model.seq_len={SEQ_LEN}",
           "--set", f"metrics.log_interval={INTERVAL}", "--set", "train.val_interval=0", "--set", "train.val_batches=1",
           "--set", "metrics.tensorboard=false", "--set", "checkpoint.final_weights=false"]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    m = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # the time each logged step ended, from the end of the warmup on
    return per_step([x["time"] for x in m if "step_time_s" in x and x["step"] >= WARMUP and x["step"] % INTERVAL == 0])


def ddp_run(steps: int, micro: int) -> float:
    """Wall time per step of the plain DDP loop, over the same intervals."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "benchmarks/plain_ddp.py"), "--steps", str(steps), "--micro", str(micro), "--threads", "1"]
    out = subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True).stdout
    times = json.loads(out.strip().splitlines()[-1])["step_times"]
    ends = list(itertools.accumulate(times))  # ends[k - 1]: when step k ended
    return per_step([ends[k - 1] for k in range(WARMUP, steps + 1, INTERVAL)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--micro", type=int, default=16)
    args = ap.parse_args()
    tokens = 2 * args.micro * SEQ_LEN  # per step, at either dp degree
    shoal_t, ddp_t, tps2, tps1 = [], [], [], []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for r in range(args.rounds):
            t2 = shoal_run(2, args.steps, args.micro, tmp)
            td = ddp_run(args.steps, args.micro)
            s2, s1 = tokens / t2, tokens / shoal_run(1, args.steps, args.micro, tmp)
            shoal_t.append(t2), ddp_t.append(td), tps2.append(s2), tps1.append(s1)
            print(f"round {r + 1}: shoal dp2 {t2 * 1e3:.1f} ms/step ({s2:,.0f} tok/s), plain DDP {td * 1e3:.1f} "
                  f"ms/step, shoal dp1 {s1:,.0f} tok/s", flush=True)
    ratio = statistics.median(shoal_t) / statistics.median(ddp_t)
    efficiency = statistics.median(tps2) / (2 * statistics.median(tps1))
    # plain DDP's throughput from its step time, against the same one-process baseline
    ddp_efficiency = tokens / statistics.median(ddp_t) / (2 * statistics.median(tps1))
    print(f"median step time: shoal {statistics.median(shoal_t) * 1e3:.1f} ms, plain DDP "
          f"{statistics.median(ddp_t) * 1e3:.1f} ms -> ratio {ratio:.3f} (target <= 1.03)")
    print(f"scaling efficiency 2 x 1 thread vs 1 x 1 thread: shoal {efficiency:.3f} (target >= 0.9), "
          f"plain DDP {ddp_efficiency:.3f}")
    print(f"RESULT ratio={ratio:.4f} efficiency={efficiency:.4f} ddp_efficiency={ddp_efficiency:.4f}")


if __name__ == "__main__":
    main()
