"""Uneven workers: how close does balance.mode = "throughput" come to the ideal step time?

dp = 2, one rank at half the speed of the other:
  --slow cpu (default)  two hosts of a cluster on this machine (`shoal cluster up --hosts 2 --cpu 1,0.5`:
                        host 1's worker gets half a core through a cgroup cpu quota), one worker with one
                        thread per host, training a GPT of 2 layers, d_model 128, 64-token context; needs
                        root. Falls back to --slow inject when the cluster cannot be made.
  --slow inject         two local workers of one thread; rank 1's forward sleeps a fixed time per sample
                        (tests/fixtures/uneven.py), calibrated to rank 0's own compute per sample, so it
                        runs at about half the speed.
Each split trains the same steps on the same data: uniform (global batch / 2 each) and throughput
(re-measured and re-split every 5 steps). The step time is the median over the second half of the run
(the balanced split has settled by then; the first step warms up).

The ideal is total work / total speed: B / (r0 + r1) seconds of compute, r_i being rank i's measured
samples per second of compute (the balanced run's last agreed throughputs, which the run records as
rank_samples_per_s; printed, so that r1 / r0 shows how close to half rank 1 ran), plus the step's work
that does not split (the optimizer step and data wait, the balanced run's median). Exposed
communication is overhead the ideal does not pay: the gradient all-reduce with a half-speed rank in it
(~4 ms for this model's 1.8 MB on the cluster, `shoal probe --cluster`) and the wait for rank 1 when
its quota runs out mid-step (the cgroup gives it 2.5 ms of every 5).

    python -m benchmarks.load_balance [--slow cpu|inject] [--steps 60]

Last line:
    RESULT balanced_vs_ideal=<balanced step time / ideal> uniform_vs_ideal=<uniform step time / ideal>
Target: balanced_vs_ideal <= 1.10.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BATCH = 64
COMMON = [f"train.global_batch_size={BATCH}", "train.micro_batch_size=8", "train.val_interval=0", "train.val_batches=1",
          "parallel.threads_per_worker=1", "checkpoint.enabled=false", "metrics.log_interval=1",
          "metrics.tensorboard=false", "metrics.progress=false", "data.max_bytes=400000"]
GPT = ["model.n_layer=2", "model.d_model=128", "model.n_head=4", "model.seq_len=64"]
UNEVEN = ['model.name="uneven:build"', "model.n_layer=2", "model.d_model=128", "model.n_head=4", "model.seq_len=64",
          "model.rank=1"]  # the same GPT
SPLITS = {"uniform": [], "throughput": ['balance.mode="throughput"', "balance.interval=5"]}


def shoal(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "fixtures"),
                                                         os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "shoal", *args], cwd=ROOT, text=True, capture_output=True, env=env)


def train(name: str, sets: list[str], tmp: Path, cluster: bool) -> list[dict]:
    run_dir = tmp / name
    where = ["--cluster", "--nproc", "1"] if cluster else ["--nproc", "2"]
    r = shoal("train", *where, "--run-dir", str(run_dir), *[a for kv in [*COMMON, *sets] for a in ("--set", kv)])
    if r.returncode:
        sys.exit(f"{name}: shoal train failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def settled(metrics: list[dict], key: str) -> float:
    """The median of `key` over the second half of the steps."""
    steps = [m for m in metrics if key in m]
    return statistics.median(m[key] for m in steps[len(steps) // 2:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slow", choices=("cpu", "inject"), default="cpu", help="how rank 1 is slowed (default cpu)")
    ap.add_argument("--steps", type=int, default=60, help="steps per split (default 60)")
    args = ap.parse_args()
    cluster = args.slow == "cpu"
    if cluster:
        up = shoal("cluster", "up", "--hosts", "2", "--cpu", "1,0.5")
        if up.returncode:
            print(f"no cluster ({up.stderr.strip()}); slowing rank 1 by an injected per-sample cost instead",
                  file=sys.stderr)
            cluster = False
    runs, how = {}, "host 1 at half a core (cgroup cpu quota), 1 thread per worker"
    try:
        with tempfile.TemporaryDirectory(prefix="shoal-load-balance-") as tmp:
            model = GPT
            if not cluster:  # rank 1 sleeps per sample as long as rank 0 computes one: half the speed
                calib = train("calibrate", [*UNEVEN, "model.delay_s=0", "train.steps=12"], Path(tmp), False)
                delay = settled(calib, "forward_backward_s") / (BATCH // 2)
                model = [*UNEVEN, f"model.delay_s={delay:.6f}"]
                how = f"rank 1 sleeps {delay * 1000:.2f} ms per sample in forward (rank 0's compute per sample)"
            for name, sets in SPLITS.items():
                runs[name] = train(name, [*model, *sets, f"train.steps={args.steps}"], Path(tmp), cluster)
                print(f"{name}: {settled(runs[name], 'step_time_s') * 1000:.0f} ms per step", file=sys.stderr)
    finally:
        if cluster:
            shoal("cluster", "down")
    return report(runs, how, args.steps)


def report(runs: dict, how: str, steps: int) -> int:
    bal = runs["throughput"]
    rates = [m["rank_samples_per_s"] for m in bal if "rank_samples_per_s" in m][-1]
    fixed = settled(bal, "optimizer_s") + settled(bal, "data_wait_s")
    ideal = BATCH / sum(rates) + fixed  # total work / total speed
    share = [m["batch_share"] for m in bal][-1]
    print(f"dp 2, global batch {BATCH}, {steps} steps per split; {how}")
    print(f"measured compute throughput: rank 0 {rates[0]:.0f}, rank 1 {rates[1]:.0f} samples/s "
          f"(r1 / r0 = {rates[1] / rates[0]:.2f}); "
          f"final balanced split {share[0]} / {share[1]}")
    compute, fb = settled(bal, "compute_s"), settled(bal, "forward_backward_s")
    print(f"balanced, rank 0: {compute * 1000:.1f} ms of compute per step, {(fb - compute) * 1000:.1f} ms more in "
          f"forward/backward waiting for the gradient all-reduce (rank 1 and the network)")
    print("| split | step ms | vs ideal |")
    print("|---|---|---|")
    out = {}
    for name, m in runs.items():
        t = settled(m, "step_time_s")
        out[name] = t / ideal
        print(f"| {name} | {t * 1000:.1f} | {out[name]:.3f} |")
    print(f"| ideal (B / (r0 + r1) + {fixed * 1000:.1f} ms optimizer and data wait) | {ideal * 1000:.1f} | 1.000 |")
    print(f"RESULT balanced_vs_ideal={out['throughput']:.3f} uniform_vs_ideal={out['uniform']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
