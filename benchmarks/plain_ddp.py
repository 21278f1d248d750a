"""The peer for dp_overhead.py: a minimal hand-written torch DDP training loop, run under torchrun.

Same model class, batch shape, optimizer and thread count as shoal's run; nothing else: no config,
no validation, no metrics files, no prefetch. Prints one JSON line with its per-step times (rank 0).

    torchrun --standalone --nproc-per-node 2 benchmarks/plain_ddp.py --steps 60 --micro 16
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from shoal.data.sources import stdlib_bytes
from shoal.models.gpt import GPT, GPTConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=args.n_layer, n_head=4, d_model=args.d_model, seq_len=args.seq_len)
    model = DDP(GPT(cfg, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    data = torch.from_numpy(stdlib_bytes(8_000_000).astype("int64"))
    g = torch.Generator().manual_seed(rank)

    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        starts = torch.randint(len(data) - args.seq_len - 1, (args.micro,), generator=g)
        w = torch.stack([data[s:s + args.seq_len + 1] for s in starts.tolist()])
        logits = model(w[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        print(json.dumps({"step_times": times}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # skip gloo's exit-time destructors: they abort now and then (2 of 20 runs here)


if __name__ == "__main__":
    main()
