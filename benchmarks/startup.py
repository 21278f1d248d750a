"""What does it cost to start a run? A one-step, 2-worker training from the command line to exit.

Runs, alternated in rounds so machine noise hits each alike:
  - `shoal train` as a user runs it: workers forked from one server that imported torch and shoal's
    training stack once ([Note: forked workers] in src/shoal/launch/restart.py), started as the command
    begins ([Note: early fork server] in src/shoal/launch/forkserver.py);
  - the same run through `shoal.train()` from Python, whose workers are fresh interpreters, each
    importing torch itself;
  - `shoal train` where no bytecode is cached and none may be written (PYTHONDONTWRITEBYTECODE with
    an empty PYTHONPYCACHEPREFIX): every process compiles every module it imports, torch's included;
  - the peer: torchrun starting benchmarks/plain_ddp.py for one step (the same model, batch and
    optimizer; no config, validation, metrics, checkpoint or final weights).
The default GPT, 1 thread per worker, no validation, TensorBoard or checkpoint. Per run, the wall time
and the CPU time of the whole machine while it ran (from /proc/stat: every process of the tree,
including those a forkserver reaps, which no rusage of the caller sees), so run it on a quiet machine.

    python -m benchmarks.startup [--rounds 5]

Last line:
    RESULT ratio=<shoal/torchrun wall> cpu_ratio=<shoal/torchrun CPU> fresh_ratio=<fresh/forked wall>
           fresh_cpu_ratio=<fresh/forked CPU> uncached_ratio=<uncached/forked wall>
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs/gpt-tiny.toml"
OVERRIDES = {"train.steps": 1, "train.val_interval": 0, "metrics.tensorboard": False, "checkpoint.enabled": False,
             "checkpoint.final_weights": False, "parallel.threads_per_worker": 1}


def busy_seconds() -> float:
    """CPU seconds the machine has spent busy since boot (all cores; idle and iowait left out)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, *_ = map(int, f.readline().split()[1:])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def timed(cmd: list[str], env: dict | None = None) -> tuple[float, float]:
    """Wall and machine CPU seconds of one command, which must succeed."""
    cpu0, t0 = busy_seconds(), time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0, busy_seconds() - cpu0


def commands(tmp: Path, n: int) -> dict[str, tuple[list[str], dict]]:
    run_dir = str(tmp / f"run{n}")
    cli = [sys.executable, "-m", "shoal", "train", str(CONFIG), "--nproc", "2", "--run-dir"]
    python = (f"import shoal; shoal.train({str(CONFIG)!r}, nproc=2, run_dir={run_dir + '-py'!r}, "
              f"overrides={OVERRIDES!r})")
    sets = [a for k, v in OVERRIDES.items() for a in ("--set", f"{k}={str(v).lower()}")]
    return {
        "shoal": ([*cli, run_dir, *sets], {}),
        "shoal.train()": ([sys.executable, "-c", python], {}),
        "uncached": ([*cli, run_dir + "-uncached", *sets],
                     {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": str(tmp / f"pycache{n}")}),
        "torchrun": ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                      str(ROOT / "benchmarks/plain_ddp.py"), "--steps", "1", "--threads", "1"], {}),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    walls: dict[str, list[float]] = {}
    cpus: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        timed(commands(tmp, 0)["shoal"][0])  # a first run writes the bytecode the cached kinds read
        for r in range(1, args.rounds + 1):
            row = []
            for name, (cmd, env) in commands(tmp, r).items():
                wall, cpu = timed(cmd, env)
                walls.setdefault(name, []).append(wall)
                cpus.setdefault(name, []).append(cpu)
                row.append(f"{name} {wall:.2f} s ({cpu:.2f} s CPU)")
            print(f"round {r}: " + ", ".join(row), flush=True)
    wall = {k: statistics.median(v) for k, v in walls.items()}
    cpu = {k: statistics.median(v) for k, v in cpus.items()}
    for name in wall:
        print(f"median {name:14s} {wall[name]:6.2f} s wall {cpu[name]:6.2f} s CPU")
    print(f"RESULT ratio={wall['shoal'] / wall['torchrun']:.3f} cpu_ratio={cpu['shoal'] / cpu['torchrun']:.3f} "
          f"fresh_ratio={wall['shoal.train()'] / wall['shoal']:.3f} "
          f"fresh_cpu_ratio={cpu['shoal.train()'] / cpu['shoal']:.3f} "
          f"uncached_ratio={wall['uncached'] / wall['shoal']:.3f}")


if __name__ == "__main__":
    main()
