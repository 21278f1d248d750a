"""What does a Horovod script pay on shoal's Horovod, against shoal's own data parallelism?

Runs, alternated in rounds so machine noise hits both alike:
  - shoal dp=2 (`shoal train`, 2 workers x 1 thread) on the default GPT, as dp_overhead.py runs it;
  - a Horovod training loop (this file with --worker) under `shoal run --horovod -np 2`: the same GPT
    class, batch shape, AdamW and thread count, gradients
    averaged by hvd.DistributedOptimizer, clipped between synchronize() and step() as Horovod's docs
    show, parameters and optimizer state broadcast from rank 0 at the start.
Per run, the wall time per step over intervals of 10 steps after a warmup (everything between steps
counts); across rounds, the median.

    python -m benchmarks.horovod [--rounds 3] [--steps 60]

Prints the median step-time ratio Horovod-on-shoal / shoal dp (target <= 1.05). Last line:
    RESULT ratio=<horovod/shoal> horovod_ms=<median step> shoal_ms=<median step>
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.dp_overhead import INTERVAL, SEQ_LEN, WARMUP, per_step, shoal_run

ROOT = Path(__file__).resolve().parents[1]


def horovod_run(steps: int, micro: int) -> float:
    """Wall time per step of the Horovod loop under `shoal run --horovod -np 2`, over the same intervals."""
    cmd = [sys.executable, "-m", "shoal", "run", "--horovod", "-np", "2", "-m", "benchmarks.horovod", "--worker",
           "--steps", str(steps), "--micro", str(micro)]  # as a module: it imports its siblings from the package
    out = subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True).stdout
    times = json.loads(out.strip().splitlines()[-1])["step_times"]
    ends = list(itertools.accumulate(times))  # ends[k - 1]: when step k ended
    return per_step([ends[k - 1] for k in range(WARMUP, steps + 1, INTERVAL)])


def worker(steps: int, micro: int) -> None:
    """One process of the Horovod loop: what a Horovod user's script does, on shoal's default GPT."""
    import torch
    import torch.nn.functional as F

    # `import horovod.torch as hvd` in a script of its own; here this very file is a module named horovod
    # to Python (benchmarks/ is the script's folder), so the alias stands aside for it, as for a real one
    import shoal.horovod as hvd
    from shoal.data.sources import stdlib_bytes
    from shoal.models.gpt import GPT, GPTConfig

    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_head=4, d_model=128, seq_len=SEQ_LEN), 256)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    data = torch.from_numpy(stdlib_bytes(8_000_000).astype("int64"))
    g = torch.Generator().manual_seed(hvd.rank())
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        starts = torch.randint(len(data) - SEQ_LEN - 1, (micro,), generator=g)
        w = torch.stack([data[s:s + SEQ_LEN + 1] for s in starts.tolist()])
        opt.zero_grad()
        loss = F.cross_entropy(model(w[:, :-1]).flatten(0, 1), w[:, 1:].flatten())
        loss.backward()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with opt.skip_synchronize():
            opt.step()
        loss.item()
        times.append(time.perf_counter() - t0)
    if hvd.rank() == 0:
        print(json.dumps({"step_times": times}), flush=True)
    hvd.barrier()
    sys.stdout.flush()
    os._exit(0)  # skip gloo's exit-time destructors, as plain_ddp.py does (they abort now and then)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--worker", action="store_true", help="be one process of the Horovod loop (shoal run starts them)")
    args = ap.parse_args()
    if args.worker:
        return worker(args.steps, args.micro)
    shoal_t, hvd_t = [], []
    with tempfile.TemporaryDirectory() as d:
        for r in range(args.rounds):
            shoal_t.append(shoal_run(2, args.steps, args.micro, Path(d)))
            hvd_t.append(horovod_run(args.steps, args.micro))
            print(f"round {r + 1}: shoal dp2 {shoal_t[-1] * 1e3:.1f} ms/step, Horovod on shoal "
                  f"{hvd_t[-1] * 1e3:.1f} ms/step", flush=True)
    shoal_ms, hvd_ms = statistics.median(shoal_t) * 1e3, statistics.median(hvd_t) * 1e3
    print(f"median step time: Horovod on shoal {hvd_ms:.1f} ms, shoal dp {shoal_ms:.1f} ms -> ratio "
          f"{hvd_ms / shoal_ms:.3f} (target <= 1.05)")
    print(f"RESULT ratio={hvd_ms / shoal_ms:.4f} horovod_ms={hvd_ms:.1f} shoal_ms={shoal_ms:.1f}")


if __name__ == "__main__":
    main()
