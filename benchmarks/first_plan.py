"""Does `shoal plan` with nothing but a config pick a fast layout, on a machine it has never measured?

What a newcomer runs: `shoal plan configs/gpt-tiny.toml --nproc 2`, with an empty profile cache (a
temporary $XDG_CACHE_HOME), so the plan measures the machine on the spot (plan/profiles.py: no
calibration). Its wall time is timed; its table (all rows, --top 1000) must give every valid layout a
step time; `--apply` writes its top layout into a config. Then the top layout and the layouts
benchmarks/planner_accuracy.py measures (dp 2 with ZeRO 0-3, dp 2 with activation checkpointing, tp
2, pp 2 with 1F1B and GPipe), each on the default job's own model and batch (micro-batch 16, or 8
under pp so that each rank has two micro-batches), are trained for --steps steps by `shoal train
--nproc 2`, in --repeats rounds (the layouts in turn in each round, so that the machine's drift
spreads over all of them); a layout's time is the median over the rounds of each run's median step.

    python -m benchmarks.first_plan [--steps 30] [--repeats 3] [--layouts dp2,tp2,...]

(--layouts: the layouts the plan's top is measured against, default all of them.)

Target (issue 28): the plan in ~20 s with a step time for every valid layout, and its top layout within
10% of the fastest layout measured. Last line:
    RESULT plan_s=<s> timed=<k>/<valid> top=<label> top_vs_fastest=<measured top / fastest> fastest=<name>
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import planner_accuracy

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs/gpt-tiny.toml"
TOP = "plan's top"
# planner_accuracy's layouts, on the default job's batch: 32 a step over 2 stages in micro-batches of 16 would
# give each stage one, so pp runs micro-batches of 8
LAYOUTS = {name: [*extra, "train.micro_batch_size=8"] if "parallel.pp=2" in extra else extra
           for name, extra in planner_accuracy.LAYOUTS.items()}


def first_plan(tmp: Path) -> tuple[float, int, int, str, str]:
    """(seconds, layouts with a step time, valid layouts, the top's label, its config file)."""
    best = tmp / "best.toml"
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp / "cache")}
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "shoal", "plan", str(CONFIG), "--nproc", "2", "--top", "1000",
                          "--apply", str(best)], check=True, cwd=tmp, env=env, capture_output=True, text=True).stdout
    seconds = time.perf_counter() - started
    print(out.splitlines()[0], flush=True)  # which profile
    valid = int(re.search(r"(\d+) valid layouts", out).group(1))
    rows = [ln for ln in out.splitlines() if re.match(r"\W+\d+\W+dp\d", ln)]
    # the step column: the third cell of a row (#, layout, step, ...)
    timed = sum(1 for ln in rows if re.fullmatch(r"\d+\.\d ms", re.split(r"[│|]", ln)[3].strip()))
    top = out.split("wrote ")[-1].split(": ", 1)[1].strip()
    return seconds, timed, valid, top, str(best)


def train(config: str, extra: list[str], steps: int, run_dir: Path) -> float:
    """Median step time of `shoal train --nproc 2` on `config`."""
    sets = [a for k in [f"train.steps={steps}", "metrics.log_interval=1", "checkpoint.enabled=false",
                        "checkpoint.final_weights=false", "metrics.tensorboard=false", "metrics.progress=false",
                        "train.val_interval=0", "train.val_batches=1", *extra] for a in ("--set", k)]
    subprocess.run([sys.executable, "-m", "shoal", "train", config, "--nproc", "2", "--run-dir", str(run_dir), *sets],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return json.loads((run_dir / "summary.json").read_text())["median_step_time_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layouts", default=",".join(LAYOUTS),
                    help="comma-separated (default: all): " + ", ".join(LAYOUTS))
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="shoal-first-plan-"))
    seconds, timed, valid, top, best = first_plan(tmp)
    print(f"plan: {seconds:.1f} s, {timed} of {valid} valid layouts with a step time, top {top}", flush=True)
    runs = {TOP: (best, []), **{name: (str(CONFIG), LAYOUTS[name]) for name in args.layouts.split(",")}}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(args.repeats):
        for name, (config, extra) in runs.items():
            times[name].append(train(config, extra, args.steps, tmp / f"{name.replace(' ', '-')}-{r}"))
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, t in medians.items():
        print(f"{name:12s} {t * 1e3:7.1f} ms  ({', '.join(f'{x * 1e3:.1f}' for x in times[name])})", flush=True)
    fastest = min(medians, key=medians.get)
    print(f"RESULT plan_s={seconds:.1f} timed={timed}/{valid} top={top.replace(' ', '-')} "
          f"top_vs_fastest={medians[TOP] / medians[fastest]:.3f} "
          f"fastest={fastest.replace(' ', '-')}")


if __name__ == "__main__":
    main()
