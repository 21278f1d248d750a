"""Why DiLoCo with the paper's outer optimizer misses the slow-link benchmark's target, and which
settings a small job should use: the loss side of benchmarks/slow_links.py, without the link.

The same model, data, batch and budget as slow_links.py (its MODEL and TRAIN), on 2 local processes
(loopback: a mode's loss curve does not depend on the link, only its step time does). For each variant:
the first validation step at or below the target (the uncompressed every-step run's validation loss at
80% of the budget) and the final validation loss. Variants: local SGD and DiLoCo at H = 8 over outer
learning rate, Nesterov momentum and a warm-up of every-step synchronisation.

    python -m benchmarks.diloco_outer [--steps 200] [--variants name,...]

Last line:
    RESULT paper_reaches=<step or never> best_variant=<name> best_steps=<step> best_final=<loss>
           local_sgd_steps=<step>
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.slow_links import MODEL, TRAIN, VAL_EVERY  # the benchmark's own model and batch

ROOT = Path(__file__).resolve().parents[1]

D8 = ['sync.mode="diloco"', "sync.every=8"]
VARIANTS = {
    "every-step": [],
    "local-sgd-8": ['sync.mode="local-sgd"', "sync.every=8"],
    "paper-lr0.7-nesterov0.9": [*D8, "sync.outer_lr=0.7", "sync.outer_momentum=0.9"],
    "lr0.7-no-momentum": [*D8, "sync.outer_lr=0.7", "sync.outer_momentum=0"],
    "lr1.0-nesterov0.5": [*D8, "sync.outer_lr=1.0", "sync.outer_momentum=0.5"],
    "lr0.7-nesterov0.5": [*D8, "sync.outer_lr=0.7", "sync.outer_momentum=0.5"],
    "lr0.5-nesterov0.8": [*D8, "sync.outer_lr=0.5", "sync.outer_momentum=0.8"],
    "lr0.3-nesterov0.9": [*D8, "sync.outer_lr=0.3", "sync.outer_momentum=0.9"],
    "lr0.5-no-momentum": [*D8, "sync.outer_lr=0.5", "sync.outer_momentum=0"],
    "lr0.9-no-momentum": [*D8, "sync.outer_lr=0.9", "sync.outer_momentum=0"],
    "lr0.7-nesterov0.2": [*D8, "sync.outer_lr=0.7", "sync.outer_momentum=0.2"],
    "lr0.7-no-momentum-H32": ['sync.mode="diloco"', "sync.every=32", "sync.outer_lr=0.7", "sync.outer_momentum=0"],
    "paper-warmup-20": [*D8, "sync.outer_lr=0.7", "sync.outer_momentum=0.9", "sync.warmup_steps=20"],
    "lr0.7-nesterov0.5-warmup-20": [*D8, "sync.outer_lr=0.7", "sync.outer_momentum=0.5", "sync.warmup_steps=20"],
}


def train(name: str, sets: list[str], steps: int, tmp: Path) -> dict:
    run_dir = tmp / f"run{len(list(tmp.iterdir()))}"
    args = [a for kv in [*MODEL, *TRAIN, f"train.steps={steps}", *sets] for a in ("--set", kv)]
    r = subprocess.run([sys.executable, "-m", "shoal", "train", "--nproc", "2", "--run-dir", str(run_dir), *args],
                       cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"{name}: shoal train failed ({r.returncode}):\n{r.stderr[-3000:]}")
    m = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"val": [(x["step"], x["val_loss"]) for x in m if "val_loss" in x]}


def reached(run: dict, target: float) -> int | None:
    return next((step for step, loss in run["val"] if loss <= target), None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, from: " + ", ".join(VARIANTS))
    args = ap.parse_args()
    names = [n for n in args.variants.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        sys.exit(f"unknown variant {unknown[0]!r}; variants: {', '.join(VARIANTS)}")
    for must in ("every-step", "local-sgd-8", "paper-lr0.7-nesterov0.9"):
        if must not in names:
            names.insert(0, must)
    runs = {}
    with tempfile.TemporaryDirectory(prefix="shoal-diloco-") as tmp:
        for name in names:
            runs[name] = train(name, VARIANTS[name], args.steps, Path(tmp))
            print(f"{name}: done", file=sys.stderr, flush=True)
    target_step = int(0.8 * args.steps) // VAL_EVERY * VAL_EVERY
    target = dict(runs["every-step"]["val"])[target_step]
    print(f"{args.steps} steps, 2 processes; target: val loss {target:.4f} (every-step at step {target_step})")
    print("| variant | first step at target | final val loss | val loss at steps 50 / 100 / 150 |")
    print("|---|---|---|---|")
    for name, r in runs.items():
        vals = dict(r["val"])
        at = reached(r, target)
        mid = " / ".join(f"{vals[s]:.3f}" if s in vals else "-" for s in (50, 100, 150))
        print(f"| {name} | {at if at is not None else 'never'} | {r['val'][-1][1]:.4f} | {mid} |")
    diloco = {n: r for n, r in runs.items() if VARIANTS[n][:1] == D8[:1] and reached(r, target) is not None}
    best = min(diloco, key=lambda n: (reached(diloco[n], target), diloco[n]["val"][-1][1])) if diloco else None
    paper = reached(runs["paper-lr0.7-nesterov0.9"], target)
    print(f"RESULT paper_reaches={paper if paper is not None else 'never'} best_variant={best or 'none'} "
          f"best_steps={reached(diloco[best], target) if best else '-'} "
          f"best_final={runs[best]['val'][-1][1] if best else float('nan'):.4f} "
          f"local_sgd_steps={reached(runs['local-sgd-8'], target)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
