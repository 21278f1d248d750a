"""A model larger than a rank should hold, started under ZeRO 3: how much memory does a worker take, in its
start and over a step, against the loop a user would write by hand with FSDP2's meta-device start?

The model: shoal's GPT, 16 layers of width 2,048 (806M parameters, 3.0 GiB in fp32), sequences of 32,
4 processes on CPU (gloo), global batch 4 = micro 1 x dp 4, SGD without momentum, one step (issue 49's
acceptance run). Two runs, one after the other:
  - shoal: `shoal train configs/gpt-tiny.toml --nproc 4 --set parallel.zero=3 ...`; summary.json's
    start_memory_bytes (the most a rank grew while it built its share) and peak_memory_bytes (the largest
    worker's peak RSS);
  - by hand (torchtitan's recipe): the GPT built under torch.device("meta"), fully_shard per block and
    on the root, to_empty, the GPT's own init run on the local shards, one SGD step on random tokens; each
    process's VmHWM after its start and after its step (no data set, no metrics, no checkpoint).
Both workers run on tcmalloc when it is installed, as shoal's ZeRO 3 workers do.

    python -m benchmarks.sharded_start [--n-layer 16] [--d-model 2048]

Target (issue 49): shoal's peak RSS per worker < 0.75x the model's fp32 bytes. Last line:
    RESULT start_vs_model=<shoal start / model bytes> peak_vs_model=<shoal peak / model bytes>
           peak_vs_by_hand=<shoal peak / hand-written peak> start_vs_by_hand=<...>
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZE = {"n_layer": 16, "d_model": 2048, "n_head": 16, "seq_len": 32}
NPROC = 4
GIB = 2**30


def shoal_run(run_dir: Path, size: dict) -> tuple[int, int, int]:
    sets = [f"model.{k}={v}" for k, v in size.items()] + [
        "parallel.zero=3", "train.optimizer=\"sgd\"", "train.momentum=0", "train.steps=1", "train.global_batch_size=4",
        "train.micro_batch_size=1", "checkpoint.final_weights=false", "checkpoint.interval=0", "train.val_interval=0"]
    cmd = [str(ROOT / ".venv/bin/shoal"), "train", str(ROOT / "configs/gpt-tiny.toml"), "--nproc", str(NPROC),
           "--run-dir", str(run_dir)] + [a for s in sets for a in ("--set", s)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads((run_dir / "summary.json").read_text())
    return summary["start_memory_bytes"], summary["peak_memory_bytes"], summary["parameters"] * 4


def by_hand_worker(rank: int, port: int, out: str, size: dict) -> None:
    """One rank of the hand-written loop."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shoal.metrics.memory import memory_mark, memory_since, status_bytes
    from shoal.models.gpt import GPT, GPTConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=NPROC)
    mesh = init_device_mesh("cpu", (NPROC,))
    mark = memory_mark(torch.device("cpu"))  # as shoal measures its start (summary.json's start_memory_bytes)
    cfg = GPTConfig(**size)
    with torch.device("meta"):
        model = GPT(cfg, 256)
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        fully_shard(block, mesh=mesh, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    model.head.weight = model.tok_emb.weight
    with torch.no_grad():
        model.apply(GPT._init)  # the GPT's own init, on each rank's shards (DTensor ops act locally)
    start = memory_since(torch.device("cpu"), mark)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 256, (1, size["seq_len"] + 1), generator=torch.Generator().manual_seed(rank))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    optimizer.step()
    peak = status_bytes("VmHWM")
    gathered = [None] * NPROC
    dist.all_gather_object(gathered, (start, peak))
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def by_hand(workdir: Path, size: dict) -> tuple[int, int]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = workdir / "by_hand.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    tcmalloc = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
    if Path(tcmalloc).exists():
        env["LD_PRELOAD"] = tcmalloc
    procs = [subprocess.Popen([sys.executable, __file__, "--by-hand-rank", str(r), str(port), str(out),
                               json.dumps(size)], env=env)
             for r in range(NPROC)]
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"the hand-written loop failed (exit {p.returncode})")
    rows = json.loads(out.read_text())
    return max(r[0] for r in rows), max(r[1] for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-layer", type=int, default=SIZE["n_layer"],
                    help=f"the GPT's layers (default {SIZE['n_layer']})")
    ap.add_argument("--d-model", type=int, default=SIZE["d_model"], help=f"its width (default {SIZE['d_model']})")
    args = ap.parse_args()
    size = {**SIZE, "n_layer": args.n_layer, "d_model": args.d_model}
    with tempfile.TemporaryDirectory() as tmp:
        shoal_start, shoal_peak, model_bytes = shoal_run(Path(tmp) / "run", size)
        hand_start, hand_peak = by_hand(Path(tmp), size)
    print(f"model: {model_bytes / GIB:.2f} GiB in fp32, {NPROC} ranks, ZeRO 3")
    print(f"{'':10} {'start GiB':>10} {'peak GiB':>10} {'peak / model':>13}")
    for name, start, peak in (("shoal", shoal_start, shoal_peak), ("by hand", hand_start, hand_peak)):
        print(f"{name:10} {start / GIB:10.3f} {peak / GIB:10.3f} {peak / model_bytes:13.3f}")
    print(f"RESULT start_vs_model={shoal_start / model_bytes:.3f} peak_vs_model={shoal_peak / model_bytes:.3f} "
          f"peak_vs_by_hand={shoal_peak / hand_peak:.3f} start_vs_by_hand={shoal_start / hand_start:.3f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--by-hand-rank":
        by_hand_worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], json.loads(sys.argv[5]))
    else:
        main()
