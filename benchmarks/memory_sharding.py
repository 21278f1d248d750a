"""How much memory does ZeRO sharding save, and how does shoal's compare with DeepSpeed's?

A ~100M-parameter GPT (14 layers, d_model 768; checkpoint_cost.py's "100m"), fp32, dp=2 (2 processes x 1
thread, gloo, CPU), global batch 2 = micro 1 x dp 2, trained for --steps steps by:
  - shoal with parallel.zero = 0, 1, 2, 3 (summary.json's memory_per_rank, metrics.jsonl's step times);
  - DeepSpeed ZeRO 1, 2, 3 on the same model, AdamW hyper-parameters and gradient clipping, launched
    by torchrun (deepspeed_worker.py), random byte tokens.
Per rank: the bytes of parameters, gradients and optimizer state it holds (its shards only, every
byte once; DeepSpeed's fp32 master partitions count as optimizer state), its peak RSS; max over
ranks. Step time: median over the steps after the first. Runs alternate; medians over --repeats.

    python -m benchmarks.memory_sharding [--repeats 1] [--steps 5] [--n-layer 14]

(--n-layer: fewer layers than the 14 for a try of the script; the targets are for the ~100M model.)

DeepSpeed: `.venv/bin/pip install deepspeed torch==2.13.0` (runs with DS_ACCELERATOR=cpu, gloo;
this script sets it). Without it the DeepSpeed rows say why and the ratios against it are nan.
Targets: shoal zero3 <= 0.55x zero0 model-state bytes per rank, and <= 0.6x its peak RSS (ZeRO 2/3
workers on CPU run on tcmalloc, which reuses and gives back freed buffers, else glibc with a 64 KiB mmap
threshold: shoal/allocator.py); shoal <= DeepSpeed bytes at each stage; step time shoal / DeepSpeed
<= 0.75 at each stage. Last line:
    RESULT zero3_vs_zero0=<x> max_shoal_vs_deepspeed_bytes=<y> max_shoal_vs_deepspeed_time=<z>
           zero3_vs_zero0_peak_rss=<peak RSS of shoal zero3 / zero0>
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
def model(n_layer: int = 14) -> list[str]:
    return [f"model.n_layer={n_layer}", "model.d_model=768", "model.n_head=12", "model.seq_len=128"]

KINDS = ("params", "grads", "optimizer")
COLUMNS = (*KINDS, "total", "peak", "time")


def summarize(per_rank: list[dict], step_times: list[float]) -> dict[str, float]:
    """Max over ranks of each kind, of their total and of the peak; median step time after the first."""
    row = {k: max(r[k] for r in per_rank) for k in (*KINDS, "peak")}
    row["total"] = max(sum(r[k] for k in KINDS) for r in per_rank)
    row["time"] = statistics.median(step_times[1:] or step_times)
    return row


def sets(*keys: str) -> list[str]:
    return [a for k in keys for a in ("--set", k)]


def shoal_run(zero: int, steps: int, tmp: Path, n_layer: int) -> dict[str, float]:
    run_dir = tmp / f"shoal-zero{zero}-{len(list(tmp.iterdir()))}"
    cmd = [sys.executable, "-m", "shoal", "train", str(ROOT / "configs/gpt-tiny.toml"), "--nproc", "2",
           "--run-dir", str(run_dir), *sets(*model(n_layer), "train.global_batch_size=2", "train.micro_batch_size=1",
           f"train.steps={steps}", "metrics.log_interval=1", "checkpoint.enabled=false",
           "checkpoint.final_weights=false", "metrics.tensorboard=false", "train.val_interval=0",
           "train.val_batches=1", "parallel.threads_per_worker=1", f"parallel.zero={zero}")]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    summary = json.loads((run_dir / "summary.json").read_text())
    times = [json.loads(x)["step_time_s"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summarize(summary["memory_per_rank"], times)


class Unavailable(Exception):
    """DeepSpeed cannot run here; the message says why."""


def deepspeed_run(stage: int, steps: int, n_layer: int) -> dict[str, float]:
    if importlib.util.find_spec("deepspeed") is None:
        raise Unavailable("deepspeed is not installed (pip install deepspeed torch==2.13.0)")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "benchmarks/deepspeed_worker.py"), "--stage", str(stage), "--steps", str(steps),
           *sets(*model(n_layer))]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    lines = p.stdout.strip().splitlines()
    if p.returncode != 0 or not lines or not lines[-1].startswith("{"):
        errors = [x for x in p.stderr.splitlines() if "Error" in x or "error:" in x] or p.stderr.splitlines()[-1:]
        raise Unavailable(f"deepspeed_worker.py exited {p.returncode}: {errors[-1] if errors else 'no output'}")
    out = json.loads(lines[-1])
    row = summarize(out["memory_per_rank"], out["step_times"])
    row["buckets"] = max(r["buckets"] for r in out["memory_per_rank"])
    return row


def mib(x: float) -> str:
    return f"{x / 2**20:,.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--n-layer", type=int, default=14, help="the GPT's layers (default 14: ~100M parameters)")
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps must be at least 2 (the optimizer state exists from the first step on)")
    names = [f"shoal zero{z}" for z in range(4)] + [f"deepspeed zero{s}" for s in range(1, 4)]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    unavailable = ""

    def record(name: str, row: dict[str, float]) -> None:
        runs[name].append(row)
        print(f"repeat {len(runs[name])}: {name}: {mib(row['total'])} MiB model state, peak RSS {mib(row['peak'])} "
              f"MiB, {row['time'] * 1e3:,.0f} ms/step", flush=True)

    with tempfile.TemporaryDirectory() as d:
        for _ in range(args.repeats):
            for stage in range(4):  # alternate, so machine noise hits both alike
                record(f"shoal zero{stage}", shoal_run(stage, args.steps, Path(d), args.n_layer))
                if stage and not unavailable:
                    try:
                        record(f"deepspeed zero{stage}", deepspeed_run(stage, args.steps, args.n_layer))
                    except Unavailable as e:
                        unavailable = str(e)
                        print(f"deepspeed unavailable: {e}", flush=True)
    med = {n: {k: statistics.median(x[k] for x in v) for k in v[0]} for n, v in runs.items() if v}

    print(f"\nper rank (max over the 2 ranks), MiB; step time median after step 1; median of {args.repeats} run(s)")
    print(f"{'':18}{'params':>9}{'grads':>9}{'optimizer':>11}{'total':>9}{'peak RSS':>10}{'ms/step':>9}")
    for n in names:
        if n not in med:
            print(f"{n:18}unavailable: {unavailable}")
            continue
        x = med[n]
        print(f"{n:18}" + "".join(f"{mib(x[k]):>{w}}" for k, w in zip(COLUMNS[:5], (9, 9, 11, 9, 10), strict=True))
              + f"{x['time'] * 1e3:>9,.0f}")
    buckets = {n: med[n]["buckets"] for n in med if "buckets" in med[n] and med[n]["buckets"]}
    if buckets:
        print("deepspeed reduce buckets allocated (not counted above; only the touched part is in peak RSS): "
              + ", ".join(f"{n.split()[1]} {mib(b)} MiB" for n, b in buckets.items()))

    zero0 = med["shoal zero0"]["total"]
    print()
    for z in range(1, 4):
        print(f"shoal zero{z} / zero0 model state: {med[f'shoal zero{z}']['total'] / zero0:.3f}"
              + (" (target <= 0.55)" if z == 3 else ""))
    byte_ratios, time_ratios = [], []
    for s in range(1, 4):
        ds = med.get(f"deepspeed zero{s}")
        b = med[f"shoal zero{s}"]["total"] / ds["total"] if ds else math.nan
        t = med[f"shoal zero{s}"]["time"] / ds["time"] if ds else math.nan
        byte_ratios.append(b), time_ratios.append(t)
        print(f"stage {s}: shoal / deepspeed model state {b:.6f} (target <= 1), peak RSS "
              f"{med[f'shoal zero{s}']['peak'] / ds['peak'] if ds else math.nan:.3f}, step time {t:.3f} "
              f"(target <= 0.75)")
    x = med["shoal zero3"]["total"] / zero0
    rss = med["shoal zero3"]["peak"] / med["shoal zero0"]["peak"]
    print(f"shoal zero3 / zero0 peak RSS: {rss:.3f} (target <= 0.6)")
    print(f"RESULT zero3_vs_zero0={x:.4f} max_shoal_vs_deepspeed_bytes={max(byte_ratios):.6f} "
          f"max_shoal_vs_deepspeed_time={max(time_ratios):.4f} zero3_vs_zero0_peak_rss={rss:.4f}")


if __name__ == "__main__":
    main()
