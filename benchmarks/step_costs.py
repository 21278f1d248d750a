"""What shoal adds to a training step, piece by piece, each against the same step without it.

Two gloo processes (this script under torchrun), the default GPT of dp_overhead.py (128-byte windows,
micro-batch 16, 1 thread per worker) in torch DDP, AdamW. Three copies of the model take steps in
turn, so that the machine's noise hits each alike: plain DDP (its built-in all-reduce), DDP whose
blocks carry the layer tracker (comm/phase.py: the hang report's layer), and DDP whose gradient
buckets go through shoal's logged comm hook (comm/hooks.py) around torch's all-reduce hook. In every
step, in alternating order:
- the step flags all-reduce (training/flags.py) started before the gradient clipping and waited for
  after it, against the clipping alone: the wait it adds;
- the item-count all-reduce (training/step.py ItemCount: the count made on the host) started before
  the forward, waited for after it: the wait it adds;
- one publish of this rank's status to the rendezvous store, on the training thread (comm/watchdog.py;
  its thread does it once a second);
- building the step's micro-batches from the corpus in the training thread: what data.prefetch's
  thread takes off the step.

    python -m benchmarks.step_costs [--steps 100]

Per piece the median over steps (rank 0's; the tracker and the hook: of the difference between the
variant's forward and backward and the plain one's in the same round). Target: all of it together
< 2% of the plain step. Last line:
    RESULT step_ms=... tracker_ms=... hook_ms=... flags_ms=... count_ms=... watchdog_ms=... batch_ms=...
           overhead=<pieces per step / plain step>
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
WARMUP = 10


def worker(steps: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from shoal.comm.collectives import Comm
    from shoal.comm.hooks import logged
    from shoal.comm.phase import Phase
    from shoal.comm.watchdog import Watchdog
    from shoal.config import DataConfig
    from shoal.data.sources import build_source
    from shoal.models.gpt import GPT, Block, GPTConfig
    from shoal.training.flags import StepFlags
    from shoal.training.step import ItemCount

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, device = dist.get_rank(), torch.device("cpu")
    comm, phase = Comm(dist.distributed_c10d._get_default_store(), rank, dist.get_world_size()), Phase()
    watchdog = Watchdog(comm.log, comm.store, rank, phase, interval=3600)  # published here, by hand
    source = build_source(DataConfig(), seq_len=128)
    cfg = GPTConfig(n_layer=4, n_head=4, d_model=128, seq_len=128)

    def model(variant: str):
        torch.manual_seed(0)
        m = GPT(cfg, 256)
        if variant == "tracked":
            phase.track(m, (Block,))
        ddp = DDP(m)
        if variant == "hooked":
            ddp.register_comm_hook(None, logged(allreduce_hook, comm.log, "dp"))
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3)

    variants = {v: model(v) for v in ("plain", "tracked", "hooked")}
    g = torch.Generator().manual_seed(rank)
    times: dict[str, list[float]] = {k: [] for k in
                                     ("plain", "tracked", "hooked", "step", "flags", "count", "watchdog", "batch")}
    for step in range(WARMUP + steps):
        for variant, (ddp, opt) in variants.items():
            t0 = time.perf_counter()
            batch = source.train_batch(torch.randint(source.num_train, (16,), generator=g))
            t_batch = time.perf_counter() - t0
            t_step = time.perf_counter()
            count = ItemCount(batch["target"].numel(), comm, SimpleNamespace(dp=dist.get_world_size(), dp_group=None),
                              device)
            t0 = time.perf_counter()
            logits = ddp(batch["input"])
            t_fwd = time.perf_counter() - t0
            t0 = time.perf_counter()
            count.scale()  # where the step first needs the global count: the first backward's scale
            t_count = time.perf_counter() - t0
            t0 = time.perf_counter()
            loss = F.cross_entropy(logits.flatten(0, 1), batch["target"].flatten())
            loss.backward()
            t_fb = t_fwd + time.perf_counter() - t0
            params = list(ddp.parameters())
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
            clip_alone, with_flags = 0.0, 0.0
            for order in ((0, 1) if step % 2 else (1, 0)):
                t0 = time.perf_counter()
                if order:
                    flags = StepFlags(comm, device)
                    flags.start(loss.detach(), ~torch.isfinite(norm), stop=False, save=False)
                torch.nn.utils.clip_grads_with_norm_(params, 1e9, norm)  # a factor of 1: the work, no change
                if order:
                    flags.result()
                    with_flags = time.perf_counter() - t0
                else:
                    clip_alone = time.perf_counter() - t0
            opt.step()
            opt.zero_grad(set_to_none=True)
            t_all = time.perf_counter() - t_step
            t0 = time.perf_counter()
            watchdog.publish()
            t_watchdog = time.perf_counter() - t0
            if step < WARMUP:
                continue
            times[variant].append(t_fb)
            if variant == "plain":
                times["step"].append(t_all)
            times["flags"].append(with_flags - clip_alone)
            for k, v in (("count", t_count), ("watchdog", t_watchdog), ("batch", t_batch)):
                times[k].append(v)
    if rank == 0:
        print(json.dumps(times), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # skip gloo's exit-time destructors: they abort now and then


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a.steps)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
           "--worker", "--steps", str(a.steps)]
    out = subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True).stdout
    times = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    step = ms["step"]
    watchdog_per_step = ms["watchdog"] * step / 1e3  # once a second

    def paired(variant: str) -> float:  # the median of a round's difference: slow drifts of the machine cancel
        return statistics.median(a - b for a, b in zip(times[variant], times["plain"], strict=True)) * 1e3

    piece = {"tracker": paired("tracked"), "hook": paired("hooked"), "flags": ms["flags"],
             "count": ms["count"], "watchdog": ms["watchdog"], "batch": ms["batch"]}
    print(f"plain DDP step: {step:.1f} ms (forward and backward {ms['plain']:.1f} ms), {a.steps} steps per variant")
    print(f"layer tracker:             {piece['tracker']:+.2f} ms of forward and backward")
    print(f"logged comm hook:          {piece['hook']:+.2f} ms of forward and backward")
    print(f"step flags all-reduce:     {piece['flags']:+.2f} ms beyond the clipping it overlaps")
    print(f"item-count all-reduce:     {piece['count']:+.2f} ms of wait after the first forward")
    print(f"watchdog publish:          {piece['watchdog']:.3f} ms, once a second")
    print(f"a step's batches built:    {piece['batch']:.2f} ms in the training thread (data.prefetch = 0)")
    overhead = (piece["tracker"] + piece["hook"] + piece["flags"] + piece["count"] + watchdog_per_step) / step
    print("RESULT " + " ".join(f"{k}_ms={v:.3f}" for k, v in {"step": step, **piece}.items())
          + f" overhead={overhead:.4f}")


if __name__ == "__main__":
    main()
