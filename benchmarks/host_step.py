"""What shoal's step costs the host beyond the loop a user writes: a step small enough that the host's work is the
step, timed on the CPU.

A GPU step that is launch-bound pays every microsecond of host work between kernels in full; here it can be
measured without a GPU. The same tiny GPT (2 layers of width 32, 2 heads, 32 tokens, vocabulary 512), fp32, one
thread, micro-batch 4 with no accumulation, world size 1, the same token file and seed on both sides:
  plain loop    benchmarks/gpu_step_loop.py train (nanoGPT's loop: fused AdamW, clipping, the loss read at logged
                steps only) around the model shoal's own builder makes from the same config
  shoal train   `python -m shoal train CONFIG --nproc 1`, its defaults but for no checkpoints, no TensorBoard, no
                progress bar and validation only at the end
Both log every 10 steps, and each side's step time is taken over spans of 10 steps (from the end of one logged
step to the end of the next, over 10; shoal's ends: metrics.jsonl's stamps), each span holding one logged step: the
run's figure is the lower quartile of its spans. On a shared virtual machine the spans of one run of the loop ranged
from 2.6 to 5.2 ms, and whole runs' means by 30%, while their lower quartiles stayed within 10%: the machine's other
tenants only ever add time. What the quartile can leave out is a cost paid less often than every 10 steps: shoal's
full garbage collection every 50 steps (its pause is printed) and nothing else. The window's mean is reported
beside it (`mean_ratio`). The two run alternately, pair after pair, the order swapped in every other pair so
that a drift of the machine's speed hits both alike; the ratio is taken within each pair, and the median and range
of those ratios are reported.

    python -m benchmarks.host_step [--pairs 7] [--warmup 50] [--timed 400] [--set key=value ...]

Target (issue 58): shoal / loop <= 1.05. Run it on a quiet machine (nothing else on the cores). Last line:
    RESULT host_ratio=<median> ratio_min=... ratio_max=... mean_ratio=<median of the means' ratios>
           shoal_ms=<median> loop_ms=<median> pairs=N
           gc_before_freeze_ms=... gc_after_ms=... (shoal's full garbage collections, medians over its runs)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import HERE, ROOT, gpt_on_tokens, read_jsonl, run

GC: list[tuple] = []  # each shoal run's full garbage collection before the heap's freeze and after (summary.json)
SHAPE = {"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 32, "vocab_size": 512}
MICRO, INTERVAL = 4, 10


def config(out: Path, tokens: Path, steps: int) -> Path:
    # warm-up of the learning rate as shoal's default (100 steps), on both sides alike
    return gpt_on_tokens(out / "host_step.toml", SHAPE, tokens, steps=steps, warmup=100, interval=INTERVAL,
                         dtype="fp32", train={"micro_batch_size": MICRO, "global_batch_size": MICRO},
                         sections={"parallel": {"threads_per_worker": 1}})


def loop_run(cfg: Path, out: Path, env: dict, warmup: int, timed: int, log: Path, sets: list[str]) -> tuple:
    r = run([sys.executable, HERE / "gpu_step_loop.py", "train", cfg, "--micro", MICRO, "--warmup", warmup,
             "--timed", timed, "--log-interval", INTERVAL, "--sync-steps", 0, "--threads", 1],
            cwd=out, env=env, timeout=600, log=log)
    stamps = json.loads(r.stdout.strip().splitlines()[-1])["stamps"]
    return per_step({int(k): v for k, v in stamps.items()}, warmup, timed)


def shoal_run(cfg: Path, out: Path, env: dict, warmup: int, timed: int, log: Path, sets: list[str]) -> tuple:
    run_dir = out / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    run([sys.executable, "-m", "shoal", "train", cfg, "--nproc", "1", "--run-dir", run_dir,
         *[a for s in sets for a in ("--set", s)]], cwd=out, env=env, timeout=600, log=log)
    stamps = {m["step"]: m["time"] for m in read_jsonl(run_dir / "metrics.jsonl") if "loss" in m}
    summary = json.loads((run_dir / "summary.json").read_text())
    GC.append((summary.get("gc_pause_before_freeze_s"), summary.get("gc_pause_s")))
    return per_step(stamps, warmup, timed)


def per_step(stamps: dict[int, float], warmup: int, timed: int) -> tuple[float, float]:
    """The lower quartile of the window's 10-step spans, per step, and the window's mean."""
    spans = [(stamps[a + INTERVAL] - stamps[a]) / INTERVAL for a in range(warmup, warmup + timed, INTERVAL)]
    return statistics.quantiles(spans, n=4)[0], (stamps[warmup + timed] - stamps[warmup]) / timed


def median_ms(seconds: list) -> str:
    got = [s for s in seconds if s is not None]
    return f"{statistics.median(got) * 1e3:.2f}" if got else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=7, help="alternated pairs of runs (default 7, at least 3)")
    ap.add_argument("--warmup", type=int, default=50, help="steps before the timed ones (a multiple of 10)")
    ap.add_argument("--timed", type=int, default=400, help="timed steps (a multiple of 10)")
    ap.add_argument("--set", action="append", default=[], help="a config override for shoal's runs (what it costs)")
    ap.add_argument("--out", help="folder for the config, token file, runs and logs (default: temporary)")
    args = ap.parse_args()
    if args.pairs < 3 or args.warmup % INTERVAL or args.timed % INTERVAL or args.timed < 10 * INTERVAL:
        ap.error("--pairs >= 3; --warmup and --timed multiples of 10, --timed at least 100 (the spans' ends are "
                 "logged steps)")
    started = time.monotonic()
    out = Path(args.out).resolve() if args.out else Path(tempfile.mkdtemp(prefix="shoal-host-step-"))
    out.mkdir(parents=True, exist_ok=True)
    tokens = out / "tokens.bin"
    np.random.default_rng(20_240_611).integers(0, 500, 200_000, dtype=np.uint16).tofile(tokens)
    # one log interval past the window, so that its end is a step in mid-run on both sides
    cfg = config(out, tokens, args.warmup + args.timed + INTERVAL)
    path = os.pathsep.join(p for p in [str(ROOT / "src"), os.environ.get("PYTHONPATH")] if p)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    sides = {"loop": loop_run, "shoal": shoal_run}
    times: dict[str, list[tuple[float, float]]] = {"loop": [], "shoal": []}  # (lower quartile, mean) per run
    for i in range(args.pairs):
        for side in (("loop", "shoal") if i % 2 == 0 else ("shoal", "loop")):
            times[side].append(sides[side](cfg, out, env, args.warmup, args.timed, out / "logs" / f"{i}-{side}.log",
                                           args.set))
        (lq, lm), (sq, sm) = times["loop"][-1], times["shoal"][-1]
        print(f"pair {i + 1}: loop {lq * 1e3:.2f} ms (mean {lm * 1e3:.2f})  shoal {sq * 1e3:.2f} ms "
              f"(mean {sm * 1e3:.2f})  ratio {sq / lq:.3f} (of means {sm / lm:.3f})", flush=True)
    ratios = [s[0] / p[0] for s, p in zip(times["shoal"], times["loop"], strict=True)]
    means = [s[1] / p[1] for s, p in zip(times["shoal"], times["loop"], strict=True)]
    if not args.out:
        shutil.rmtree(out, ignore_errors=True)
    print(f"RESULT host_ratio={statistics.median(ratios):.3f} ratio_min={min(ratios):.3f} "
          f"ratio_max={max(ratios):.3f} mean_ratio={statistics.median(means):.3f} "
          f"shoal_ms={statistics.median(t[0] for t in times['shoal']) * 1e3:.2f} "
          f"loop_ms={statistics.median(t[0] for t in times['loop']) * 1e3:.2f} pairs={args.pairs} "
          f"gc_before_freeze_ms={median_ms([g[0] for g in GC])} gc_after_ms={median_ms([g[1] for g in GC])} "
          f"seconds={time.monotonic() - started:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
