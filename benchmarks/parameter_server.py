"""A parameter server against all-reduce, with and without a straggler; sparse against dense pushes.

On the one-machine cluster (`shoal cluster up`: network namespaces joined by a bridge, one process
per host, one thread each, links not rate-limited): 3 workers, plus 1 server for the parameter-server
modes. The model is a GPT of 0.4M parameters (2 layers, d_model 128, 64-byte context) on 8 sequences
per worker and global step. The straggler is worker 2: its every forward sleeps twice the median step
time of the all-reduce run without it, so its steps take ~3x as long (a sleep, not a CPU cap: the
other workers keep their share of the 2 cores).

Modes, each on the same data (seed, global batch of 24 sequences), for the same budget of data
(--steps global batches): every-step all-reduce (DDP), the synchronous parameter server, and the
asynchronous one at max_staleness 4 and 64 (each worker's update applied on arrival, at a third of the
learning rate: 3 updates per global batch; AdamW's beta1 = 0, as docs/parameter-server.md advises for it). The
target is the validation loss all-reduce reaches at 80% of its budget without the straggler; time to
target is wall time from the first step to the first validation (every 10 of worker 0's steps) at
or below it. Per mode: time to target, updates applied per second, the largest and mean staleness,
bytes a worker sends per step. The synchronous server's loss is compared step by step with
all-reduce's, and so is ZeRO 2's (the same math, FSDP2 adding in another order): the drift rounding
alone causes. Then NCF (2,000 users, 1,000 items, SGD) on the synchronous server, with embedding
tables sent dense and by rows: bytes per step both ways.

    sudo python -m benchmarks.parameter_server [--steps 150] [--quick]

Last line:
    RESULT async_vs_allreduce_time_straggler=<best async time to target / all-reduce's, with the straggler>
           ps_sync_parity_rel=<largest relative loss difference, sync server vs all-reduce, per step>
           sparse_bytes_ratio=<NCF bytes per step (push + pull), by rows / dense>
(inf: no asynchronous mode reached the target within its budget.)
Targets: async_vs_allreduce_time_straggler <= 0.6, ps_sync_parity_rel <= 1e-5, sparse_bytes_ratio <= 0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VAL_EVERY = 10
WORKERS, STRAGGLER = 3, 2
GPT = ['model.name="parameter_server:slow_gpt"', "model.n_layer=2", "model.d_model=128", "model.n_head=4",
       "model.seq_len=64"]
TRAIN = ["train.global_batch_size=24", "train.micro_batch_size=8", "train.lr=2e-3", "train.warmup_steps=10",
         f"train.val_interval={VAL_EVERY}", "train.val_batches=2", "parallel.threads_per_worker=1",
         "checkpoint.enabled=false", "metrics.log_interval=1", "metrics.tensorboard=false", "metrics.progress=false"]
PS = ['sync.mode="parameter-server"', "ps.servers=1"]
# asynchronous: AdamW's beta1 = 0, since staleness already acts as momentum (measured at k = 16 on this
# model: beta1 0.9 ends at val 2.77-2.91, 0.5 at 2.60-2.61, 0 at 2.62-2.64; all-reduce 2.645)
ASYNC = [*PS, 'ps.mode="async"', "train.beta1=0"]
MODES = {
    "all-reduce": [],
    "ps-sync": PS,
    "ps-async-4": [*ASYNC, "ps.max_staleness=4"],
    "ps-async-64": [*ASYNC, "ps.max_staleness=64"],
}
# the same math as all-reduce with another order of additions (FSDP2's reduce-scatter): how far two
# exact layouts drift apart by rounding alone, next to the synchronous server's drift
FLOOR = ["parallel.zero=2"]
NCF = ["model.name=ncf", "data.source=interactions", "train.global_batch_size=96", "train.micro_batch_size=32",
       'train.optimizer="sgd"', "train.momentum=0", "train.weight_decay=0", "train.lr=0.5", "train.steps=30",
       "train.val_interval=0", "train.val_batches=1", "parallel.threads_per_worker=1", "checkpoint.enabled=false",
       "metrics.log_interval=1", "metrics.tensorboard=false", "metrics.progress=false", *PS]


def slow_gpt(cfg, spec):
    """The benchmark's model (model.name = "parameter_server:slow_gpt"): a GPT whose forward on global
    rank `slow_rank` first sleeps `delay_s`."""
    from shoal.models.gpt import GPTConfig
    from shoal.models.gpt import build as build_gpt

    bundle = build_gpt(GPTConfig(n_layer=cfg.n_layer, d_model=cfg.d_model, n_head=cfg.n_head,
                                 seq_len=cfg.seq_len), spec)
    # a worker's rank: its slot when the asynchronous roles run as jobs of their own (one machine)
    rank = int(os.environ.get("SHOAL_PS_SLOT", os.environ.get("RANK", 0)))
    delay, slow = float(getattr(cfg, "delay_s", 0.0)), rank == getattr(cfg, "slow_rank", -1)
    forward = bundle.model.forward

    def slowed(*args, **kwargs):  # the GPT's forward takes the input and, fused with its loss, the target
        if slow and delay and bundle.model.training:
            time.sleep(delay)
        return forward(*args, **kwargs)

    bundle.model.forward = slowed
    return bundle


def shoal(*args: str, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{Path(__file__).parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-m", "shoal", *args], cwd=ROOT, text=True, env=env, **kw)


def cluster(hosts: int) -> None:
    shoal("cluster", "down", capture_output=True)
    up = shoal("cluster", "up", "--hosts", str(hosts), capture_output=True)
    if up.returncode:
        sys.exit(up.stderr.strip())


def train(name: str, sets: list[str], tmp: Path) -> dict:
    run_dir = tmp / name
    args = [a for kv in sets for a in ("--set", kv)]
    r = shoal("train", "--cluster", "--nproc", "1", "--run-dir", str(run_dir), *args, capture_output=True)
    if r.returncode:
        sys.exit(f"{name}: shoal train failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    m = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in m if "step_time_s" in x]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"steps": steps, "summary": summary, "start": steps[0]["time"] - steps[0]["step_time_s"],
            "val": [(x["time"], x["val_loss"]) for x in m if "val_loss" in x]}


def time_to(run: dict, target: float) -> float | None:
    return next((t - run["start"] for t, v in run["val"] if v <= target), None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150, help="global batches of data per run (default 150)")
    ap.add_argument("--quick", action="store_true", help="no straggler pass and no ps-async-64: every kind of run "
                                                         "once (a try of the script; the comparison needs them)")
    args = ap.parse_args()
    runs: dict[tuple[str, bool], dict] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="shoal-ps-") as tmp:
            base = [*GPT, *TRAIN, f"train.steps={args.steps}"]
            delay = 0.0
            for straggler in (False,) if args.quick else (False, True):
                for mode, extra in MODES.items():
                    if args.quick and mode == "ps-async-64":
                        continue
                    cluster(WORKERS + (1 if mode != "all-reduce" else 0))
                    slow = [f"model.slow_rank={STRAGGLER}", f"model.delay_s={delay}"] if straggler else []
                    t0 = time.perf_counter()
                    runs[mode, straggler] = train(f"{mode}-{straggler}", [*base, *extra, *slow], Path(tmp))
                    print(f"{mode}{' (straggler)' if straggler else ''}: {time.perf_counter() - t0:.0f} s",
                          file=sys.stderr, flush=True)
                    if mode == "all-reduce" and not straggler:  # the straggler sleeps twice a normal step
                        delay = 2 * statistics.median(x["step_time_s"] for x in runs[mode, False]["steps"][1:])
            cluster(WORKERS)
            runs["zero-2", False] = train("zero-2", [*base, *FLOOR], Path(tmp))
            cluster(WORKERS + 1)
            ncf = {kind: train(f"ncf-{kind}", [*NCF, f"ps.sparse={str(kind == 'sparse').lower()}"], Path(tmp))
                   for kind in ("dense", "sparse")}
    finally:
        shoal("cluster", "down", capture_output=True)
    return report(runs, ncf, args, delay)


def report(runs: dict, ncf: dict, args, delay: float) -> int:
    ref = runs["all-reduce", False]
    target_step = int(0.8 * args.steps) // VAL_EVERY * VAL_EVERY
    target = next(x["val_loss"] for x in ref["steps"] if x["step"] == target_step and "val_loss" in x)
    print(f"{WORKERS} workers (+1 server), one namespaced host and thread each; {args.steps} global batches of 24; "
          f"target val loss {target:.4f} (all-reduce at step {target_step}); straggler: worker {STRAGGLER}, "
          f"+{delay * 1000:.0f} ms per step")
    header = ("mode", "straggler", "time to target s", "vs all-reduce", "updates/s", "staleness max", "staleness mean",
              "bytes/step (worker)", "final val loss")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    ratios = {}
    for (mode, straggler), r in runs.items():
        if mode == "zero-2":
            continue
        s = r["summary"]
        tt, base = time_to(r, target), time_to(runs["all-reduce", straggler], target)
        ps = s.get("parameter_server", {})
        train_s = r["steps"][-1]["time"] - r["start"]
        ups = ps.get("updates_per_s") or len(r["steps"]) / train_s
        hist = {int(k): v for k, v in ps.get("staleness_histogram", {}).items()}
        mean = sum(k * v for k, v in hist.items()) / sum(hist.values()) if hist else 0
        ratio = tt / base if tt is not None and base else None
        if mode.startswith("ps-async") and straggler and ratio is not None:
            ratios[mode] = ratio
        print(f"| {mode} | {'yes' if straggler else 'no'} | {f'{tt:.1f}' if tt is not None else 'never'} | "
              f"{f'{ratio:.2f}' if ratio is not None else '-'} | {ups:.1f} | {ps.get('staleness_max', 0)} | "
              f"{mean:.2f} | {s['comm_bytes'] / 1e6:.2f} MB | {r['val'][-1][1]:.4f} |")
    def drift(mode: str) -> float:
        losses = {x["step"]: x["loss"] for x in runs[mode, False]["steps"]}
        return max(abs(losses[x["step"]] - x["loss"]) / abs(x["loss"]) for x in ref["steps"])

    parity, floor = drift("ps-sync"), drift("zero-2")
    print(f"largest relative loss difference from all-reduce over {args.steps} steps: ps-sync {parity:.2e}, "
          f"ZeRO 2 (the same math, another order of additions) {floor:.2e}")

    def per_step(r: dict) -> float:
        last = r["steps"][-1]
        return (last["comm_bytes_total"] + last["pulled_bytes_total"]) / len(r["steps"])

    dense, sparse = per_step(ncf["dense"]), per_step(ncf["sparse"])
    print(f"NCF on the synchronous server, bytes per worker and step (push + pull): dense {dense / 1e6:.3f} MB, "
          f"by rows {sparse / 1e6:.3f} MB; final loss {ncf['dense']['steps'][-1]['loss']:.6f} vs "
          f"{ncf['sparse']['steps'][-1]['loss']:.6f}")
    best = min(ratios.values()) if ratios else float("inf")  # inf: no asynchronous mode reached the target
    print(f"RESULT async_vs_allreduce_time_straggler={best:.3f} ps_sync_parity_rel={parity:.2e} "
          f"sparse_bytes_ratio={sparse / dense:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
