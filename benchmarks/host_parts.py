"""Where shoal's step spends the host time that the plain loop does not: the two sides of host_step.py (the tiny GPT
on the CPU, one thread, world size 1) run at the same moment, one per core, and py-spy samples each. Every sample
goes to one part of the step by the frames on its stack (the first rule in PARTS that matches), and each side's parts
are scaled so that its backward, the same model's same operations on both sides, has the size the loop's has: the
table gives each part in percent of the loop's step.

Timing the parts with wrappers around the step's functions changes what it times (each call a few microseconds more,
on a step of 3 ms); sampling changes nothing in the sampled process (py-spy reads its memory from outside,
`--nonblocking`), and the two sides, sampled over the same seconds, see the machine alike. What a part costs is
spread over the step's many small functions, so a part's figure moves by about a unit of the loop's step from one
repeat to the next (the backward holds ~1,700 samples of 12 s at 400 Hz): the median of the repeats is printed.

    python -m benchmarks.host_parts [--repeats 3] [--seconds 12] [--rate 400]

Needs py-spy (`pip install py-spy`) and leave to read another process's memory (root, or ptrace_scope 0).
Last line: RESULT shoal_step=<shoal's step, % of the loop's> <part>=<shoal's part minus the loop's, % of the loop's
step> ... repeats=N (medians over the repeats).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

from benchmarks.harness import HERE, ROOT, descendants, kill_tree, read_jsonl
from benchmarks.host_step import INTERVAL, MICRO, config

# (part, frames that put a sample in it): the first part whose frames one of the sample's frames names
PARTS = [
    ("backward", ["_engine_run_backward", "run_backward"]),
    ("backward call", ["Tensor.backward (", "Precision.backward (", "start_gradient (", "_make_grads ("]),
    ("forward and loss", ["GPT.forward (", "lm_loss (", "forward_loss (", "cross_entropy",
                          "CausalSelfAttention.forward"]),
    ("norm and clip", ["clip_grad", "Parallelized.grad_norm", "Parallelized.clip_grads"]),
    ("optimizer", ["Optimizer.step", "_fused_adam", "adam.py", "adamw.py", "profile_hook_step", "Precision.step (",
                   "Schedule.step (", "lr_scheduler"]),
    ("zero_grad", ["zero_grad ("]),
    ("batch", ["get_batch", "Steps.next (", "Prefetcher.next (", "Stepper.prepare (", "count_tokens ("]),
    ("logging", ["sinks.py", "Heartbeat", "rundir.py", "StateBytes", "peak_memory_bytes", "MemoryShare"]),
    ("verdict, flags, report", ["verdict (", "Stepper._report (", "StepFlags", "StepReport", "Trainer.advance (",
                                "Trainer.complete (", "agreed_flags ("]),
    ("garbage collection", ["Collector._collect ("]),
]
REST = "the rest (each side's own step code)"


def part_of(stack: str) -> str:
    return next((name for name, frames in PARTS if any(f in stack for f in frames)), REST)


def parts(raw: Path) -> Counter:
    """Samples per part of py-spy's raw output (a stack, a space, a count per line)."""
    counts: Counter = Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        counts[part_of(stack)] += int(n)
    return counts


def cpu_ticks(pid: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime
    except (OSError, IndexError, ValueError):
        return -1


def busiest(pids: list[int]) -> int:
    """The process of `pids` using the most CPU over a second: the training worker under shoal's launcher (the
    forkserver it was forked from used more in all, importing torch, and is idle now)."""
    before = {pid: cpu_ticks(pid) for pid in pids}
    time.sleep(1)
    return max(pids, key=lambda pid: cpu_ticks(pid) - before[pid])


def repeat(cfg: Path, out: Path, env: dict, seconds: int, rate: int, spy: str, index: int) -> dict[str, float]:
    """One repeat: both sides started, sampled over the same seconds, stopped; each part in % of the loop's step."""
    run_dir = out / f"run{index}"
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    loop_args = ["--micro", MICRO, "--warmup", 50, "--timed", 100_000, "--log-interval", INTERVAL, "--sync-steps", 0,
                 "--threads", 1]
    commands = {"shoal": [sys.executable, "-m", "shoal", "train", cfg, "--nproc", "1", "--run-dir", run_dir],
                "loop": [sys.executable, HERE / "gpu_step_loop.py", "train", cfg, *map(str, loop_args)]}
    shoal, loop = (subprocess.Popen(cmd, cwd=out, env=env, stdout=(logs / f"{index}-{side}.log").open("w"),
                                    stderr=subprocess.STDOUT) for side, cmd in commands.items())
    try:
        deadline = time.monotonic() + 180
        while not (run_dir / "metrics.jsonl").exists() or len(read_jsonl(run_dir / "metrics.jsonl")) < 10:
            if time.monotonic() > deadline or shoal.poll() is not None or loop.poll() is not None:
                raise SystemExit(f"host_parts.py: a side did not reach its steady state; see {logs}")
            time.sleep(0.5)
        time.sleep(2)  # past step 100 on both sides (the loop starts sooner)
        worker = busiest(descendants(shoal.pid))
        spies = [subprocess.Popen([spy, "record", "--pid", str(pid), "--rate", str(rate), "--duration", str(seconds),
                                   "--format", "raw", "--nonblocking", "--output", str(out / f"{index}-{side}.raw")],
                                  stdout=subprocess.DEVNULL, stderr=(logs / f"{index}-{side}-py-spy.log").open("w"))
                 for side, pid in (("shoal", worker), ("loop", loop.pid))]
        if any(s.wait(timeout=seconds + 60) for s in spies):
            raise SystemExit(f"host_parts.py: py-spy failed (may it read another process? see {logs})")
    finally:
        for p in (shoal, loop):
            kill_tree(p.pid)
    sides = {side: parts(out / f"{index}-{side}.raw") for side in ("shoal", "loop")}
    loop_total, scale = sum(sides["loop"].values()), sides["loop"]["backward"] / max(sides["shoal"]["backward"], 1)
    return {f"{side} {part}": 100 * n * (scale if side == "shoal" else 1) / loop_total
            for side, counts in sides.items() for part, n in counts.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="repeats, each a fresh pair of runs (default 3)")
    ap.add_argument("--seconds", type=int, default=12,
                    help="seconds sampled per repeat (default 12; py-spy takes whole seconds)")
    ap.add_argument("--rate", type=int, default=400, help="samples per second (default 400)")
    ap.add_argument("--out", help="folder for the config, runs, samples and logs (default: temporary)")
    args = ap.parse_args()
    beside = Path(sys.executable).with_name("py-spy")  # the virtualenv's, which PATH need not hold
    spy = str(beside) if beside.exists() else shutil.which("py-spy")
    if spy is None:
        print("host_parts.py: py-spy is not installed; run: .venv/bin/pip install py-spy", file=sys.stderr)
        return 2
    out = Path(args.out).resolve() if args.out else Path(tempfile.mkdtemp(prefix="shoal-host-parts-"))
    out.mkdir(parents=True, exist_ok=True)
    tokens = out / "tokens.bin"
    np.random.default_rng(20_240_611).integers(0, 500, 200_000, dtype=np.uint16).tofile(tokens)
    cfg = config(out, tokens, 1_000_000)
    path = os.pathsep.join(p for p in [str(ROOT / "src"), os.environ.get("PYTHONPATH")] if p)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    runs = [repeat(cfg, out, env, args.seconds, args.rate, spy, i) for i in range(args.repeats)]
    if not args.out:
        shutil.rmtree(out, ignore_errors=True)
    names = [name for name, _ in PARTS] + [REST]

    def median(key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in runs)
    shoal_step = statistics.median(sum(v for k, v in r.items() if k.startswith("shoal ")) for r in runs)
    print(f"{'part (% of the loop step)':38s} {'shoal':>7s} {'loop':>7s} {'shoal - loop':>13s}")
    for name in names:
        s, lp = median(f"shoal {name}"), median(f"loop {name}")
        print(f"{name:38s} {s:7.2f} {lp:7.2f} {s - lp:+13.2f}")
    print(f"{'the step':38s} {shoal_step:7.1f} {100.0:7.1f} {shoal_step - 100:+13.1f}")
    def key(name: str) -> str:
        return name.split(" (")[0].replace(",", "").replace(" ", "_")
    diffs = " ".join(f"{key(name)}={median(f'shoal {name}') - median(f'loop {name}'):+.2f}" for name in names)
    print(f"RESULT shoal_step={shoal_step:.1f} {diffs} repeats={args.repeats}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
