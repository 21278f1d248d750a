"""How often the host reads a tensor's value in a step, per step, on one CPU process.

On a GPU each such read (`.item()`, `float(t)`, `bool(t)`, `.tolist()`, `.cpu()`, `.numpy()`) makes the
host wait until the device has computed the value, and the device then idles until the host queues
more work. On a CPU nothing waits, but the same code makes the same calls, so counting them here (the
counter of benchmarks/read_counter.py) tells how a step behaves on a GPU. One `shoal train` of the tiny GPT
(2 x 32, 6 steps, global batch 8 in 4 micro-batches, log interval past the run but for its last step,
no checkpoints), in this process; the step report's one late read is not counted (it waits for a copy,
not for the step).

    python -m benchmarks.host_reads [--set key=value ...]

Prints the reads of each step and where the first ones come from. Last line:
    RESULT unlogged_max=<reads on the worst step that is not logged> logged=<reads on the last step>
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6
BASE = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.seq_len=32", "data.max_bytes=200000",
        "train.val_batches=2", "metrics.tensorboard=false", "metrics.progress=false", f"train.steps={STEPS}",
        "train.warmup_steps=2", "train.global_batch_size=8", "train.micro_batch_size=2", "train.val_interval=0",
        "metrics.log_interval=100", "checkpoint.enabled=false"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", action="append", default=[], help="a config override, as shoal train takes it")
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29517"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    import torch

    from benchmarks.read_counter import HostReads, as_on_a_gpu
    from shoal import dist as shoal_dist
    from shoal.comm.collectives import Comm
    from shoal.comm.phase import Phase
    from shoal.config import load_config
    from shoal.preflight import check_job
    from shoal.worker import run_rank

    torch.set_num_threads(1)
    env = shoal_dist.init("gloo", 60, device=torch.device("cpu"))
    cfg = load_config(None, [*BASE, *args.set])
    job = check_job(cfg, [1], cuda=False, quiet=True)
    phase = Phase()
    with HostReads(phase) as reads, as_on_a_gpu(reads), tempfile.TemporaryDirectory() as tmp:
        with contextlib.redirect_stdout(io.StringIO()):
            run_rank(cfg, job, Path(tmp) / "run", env, Comm(env.store, env.rank, env.world_size), "never", phase=phase)
    for step in range(1, STEPS + 1):
        where = reads.where.get(step, [])
        print(f"step {step}{' (logged)' if step == STEPS else ''}: {len(where)} reads"
              + (f"; first: {', '.join(where[:4])}" if where else ""))
    unlogged = max(reads.per_step.get(s, 0) for s in range(1, STEPS))
    print(f"RESULT unlogged_max={unlogged} logged={reads.per_step.get(STEPS, 0)}")


if __name__ == "__main__":
    main()
