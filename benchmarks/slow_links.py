"""Training across a slow link: which way of synchronising reaches a target loss soonest?

Two hosts of a cluster on this machine (`shoal cluster up --hosts 2 --rate 100mbit`: network
namespaces, each host's link rate-limited to 100 Mbit/s in each direction by tc tbf), one worker per
host with one thread (dp = 2 across the link). The model is a GPT of 1.66M parameters (2 layers,
d_model 256, 64-byte context; 6.6 MB of fp32 gradients) on 8 sequences per host and step: its
uncompressed gradient all-reduce sends 6.6 MB per rank and step, ~0.55 s at 100 Mbit/s, against ~0.06 s
of compute, about 9x (a 100M-parameter model on a GPU over such a link is 30x and more).

Modes, each trained for the same budget of steps on the same data (seed, global batch):
every-step with compression none / fp16 / int8 / topk (10%) / powersgd (rank 32 of these 256-wide
matrices: a fifth of the bytes) / int4 (every DDP bucket sent while backward goes on), local-sgd and
diloco (outer lr 0.7, no momentum: shoal's defaults) at H = 8 and 32, diloco with the paper's Nesterov
momentum 0.9 at H = 8, and streaming (two fragments synchronised at staggered steps, each sent while
the replicas take the next 2-3 steps): local SGD, local SGD with int8 pseudo-gradients, DiLoCo with int4.
The target is the validation loss the uncompressed run reaches at 80% of
its budget; a mode's time to target is its training time (the sum of its step times, startup and
validation left out) up to the first validation at or below the target (validation every 10 steps).
Per mode: time to target, bytes sent per step (counted by shoal, and what host 0's link carried,
read from the bridge port's counter), final validation loss after the budget, and the step time split
into compute (the median step of a periodic mode that sent nothing: forward, backward, optimizer) and
communication (the rest: exposed transfer time and compression arithmetic).

    sudo python -m benchmarks.slow_links [--steps 200] [--rate 100mbit] [--modes none,diloco-8,...]

Last line:
    RESULT best_vs_allreduce_time=<best mode's time to target / uncompressed's> best_mode=<name>
           loss_gap=<best's final loss / uncompressed's - 1> bytes_ratio=<best's bytes per step / uncompressed's>
           bound=<the uncompressed run's steps to the target at compute speed / its time to target>
Target: best_vs_allreduce_time <= 0.15 with loss_gap <= 0.02. The best mode is the fastest to the
target among those whose loss_gap is within 0.02.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VAL_EVERY = 10
MODEL = ["model.n_layer=2", "model.d_model=256", "model.n_head=4", "model.seq_len=64"]
TRAIN = ["train.global_batch_size=16", "train.micro_batch_size=8", "train.lr=2e-3", "train.warmup_steps=20",
         f"train.val_interval={VAL_EVERY}", "train.val_batches=4", "parallel.threads_per_worker=1",
         "checkpoint.enabled=false", "metrics.log_interval=1", "metrics.tensorboard=false", "metrics.progress=false"]
MODES = {
    "none": [],
    "fp16": ['comm.compression="fp16"'],
    "int8": ['comm.compression="int8"'],
    "topk": ['comm.compression="topk"', "comm.topk_ratio=0.1"],
    "powersgd": ['comm.compression="powersgd"', "comm.powersgd_rank=32"],
    "local-sgd-8": ['sync.mode="local-sgd"', "sync.every=8"],
    "local-sgd-32": ['sync.mode="local-sgd"', "sync.every=32"],
    "diloco-8": ['sync.mode="diloco"', "sync.every=8"],  # shoal's defaults: outer lr 0.7, no momentum
    "diloco-8-paper": ['sync.mode="diloco"', "sync.every=8", "sync.outer_momentum=0.9"],
    "diloco-32": ['sync.mode="diloco"', "sync.every=32"],
    "int4": ['comm.compression="int4"'],
    # streaming: two fragments (embeddings + block 0 + head, block 1), each sent while training goes on
    "stream-local-8": ['sync.mode="local-sgd"', "sync.every=8", "sync.fragments=2", "sync.fragment_delay=3"],
    "stream-local-8-int8": ['sync.mode="local-sgd"', "sync.every=8", "sync.fragments=2", "sync.fragment_delay=2",
                            'comm.compression="int8"'],
    "stream-diloco-8-int4": ['sync.mode="diloco"', "sync.every=8", "sync.fragments=2", "sync.fragment_delay=2",
                             'comm.compression="int4"'],
}


def shoal(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shoal", *args], cwd=ROOT, text=True, **kw)


def link_bytes(port: str) -> int:
    """Bytes host 0 has sent over its link: received by its bridge port in the root namespace."""
    return int(Path(f"/sys/class/net/{port}/statistics/rx_bytes").read_text())


def train(mode: str, steps: int, tmp: Path) -> dict:
    run_dir = tmp / mode
    sets = [a for kv in [*MODEL, *TRAIN, f"train.steps={steps}", *MODES[mode]] for a in ("--set", kv)]
    before = link_bytes("shoal-b0")
    t0 = time.perf_counter()
    r = shoal("train", "--cluster", "--nproc", "1", "--run-dir", str(run_dir), *sets, capture_output=True)
    if r.returncode:
        sys.exit(f"{mode}: shoal train failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    wall = time.perf_counter() - t0
    m = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_m = [x for x in m if "step_time_s" in x]
    return {"mode": mode, "steps": steps_m, "wall_s": wall, "link_bytes": link_bytes("shoal-b0") - before,
            "val": [(x["step"], x["val_loss"]) for x in m if "val_loss" in x]}


def time_to(run: dict, target: float) -> float | None:
    """Training seconds until the first validation at or below `target` (None: never)."""
    elapsed = 0.0
    vals = dict(run["val"])
    for x in run["steps"]:
        elapsed += x["step_time_s"]
        if x["step"] in vals and vals[x["step"]] <= target:
            return elapsed
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="the budget: steps per mode (default 200)")
    ap.add_argument("--rate", default="100mbit", help="each host's link rate (default 100mbit)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, from: " + ", ".join(MODES))
    args = ap.parse_args()
    modes = args.modes.split(",")
    if "none" not in modes:
        modes.insert(0, "none")
    unknown = [x for x in modes if x not in MODES]
    if unknown:
        sys.exit(f"unknown mode {unknown[0]}; modes: {', '.join(MODES)}")
    up = shoal("cluster", "up", "--hosts", "2", "--rate", args.rate, capture_output=True)
    if up.returncode:
        print(up.stderr.strip(), file=sys.stderr)
        return 2
    runs = {}
    try:
        with tempfile.TemporaryDirectory(prefix="shoal-slow-links-") as tmp:
            for mode in modes:
                runs[mode] = train(mode, args.steps, Path(tmp))
                print(f"{mode}: {runs[mode]['wall_s']:.0f} s", file=sys.stderr, flush=True)
    finally:
        shoal("cluster", "down", capture_output=True)
    return report(runs, args)


def report(runs: dict, args) -> int:
    base = runs["none"]
    target_step = int(0.8 * args.steps) // VAL_EVERY * VAL_EVERY
    target = dict(base["val"])[target_step]
    quiet = [x["step_time_s"] for r in runs.values() if r["mode"].startswith(("local", "diloco", "stream"))
             for x in r["steps"][1:] if x["comm_bytes"] == 0]
    compute = statistics.median(quiet) if quiet else None  # only a periodic mode's quiet steps show it
    print(f"{args.steps} steps per mode, 2 hosts at {args.rate}, 1 worker x 1 thread each; target: val loss "
          f"{target:.4f} (uncompressed at step {target_step}); compute "
          f"{f'{compute * 1000:.0f} ms' if compute else 'not measured (no local-sgd or diloco mode ran)'} per step")
    header = ("mode", "time to target s", "vs none", "bytes/step (shoal)", "bytes/step (link)", "final val loss",
              "step ms", "compute ms", "comm ms")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    rows = {}
    base_time = time_to(base, target)
    for mode, r in runs.items():
        steps = r["steps"]
        tt = time_to(r, target)
        per_step = statistics.fmean(x["step_time_s"] for x in steps[1:])  # the first step warms up
        rows[mode] = {"time": tt, "bytes": statistics.fmean(x["comm_bytes"] for x in steps),
                      "final": r["val"][-1][1], "link": r["link_bytes"] / len(steps)}
        reached = f"{tt:.1f} | {tt / base_time:.2f}" if tt is not None else "never | -"
        split = f"{compute * 1000:.0f} | {max(per_step - compute, 0) * 1000:.0f}" if compute else "- | -"
        print(f"| {mode} | {reached} | {rows[mode]['bytes'] / 1e6:.2f} MB | {rows[mode]['link'] / 1e6:.2f} MB | "
              f"{rows[mode]['final']:.4f} | {per_step * 1000:.0f} | {split} |")
    ref = rows["none"]
    ok = {m: r for m, r in rows.items()
          if m != "none" and r["time"] is not None and r["final"] / ref["final"] - 1 <= 0.02}
    best = min(ok, key=lambda m: ok[m]["time"]) if ok else "none"
    b = rows[best]
    # the compute-only bound: the uncompressed run's steps to the target, each costing only its compute
    reach = next((i + 1 for i, x in enumerate(base["steps"]) if x["step"] in dict(base["val"])
                  and dict(base["val"])[x["step"]] <= target), None)
    bound = f"{compute * reach / ref['time']:.3f}" if compute and reach and ref["time"] else "nan"
    print(f"RESULT best_vs_allreduce_time={b['time'] / ref['time']:.3f} best_mode={best} "
          f"loss_gap={b['final'] / ref['final'] - 1:.4f} bytes_ratio={b['bytes'] / ref['bytes']:.4f} bound={bound}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
