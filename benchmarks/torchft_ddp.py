"""One replica group of torchft's fault-tolerant data parallelism training shoal's default GPT: the torchft
mode of benchmarks/elastic.py.

The job is benchmarks/elastic.py's: the default job's GPT (configs/gpt-tiny.toml), AdamW at its lr, one
worker with one thread per replica group, each replica's share of the global batch (BATCH) in micro-batches
of MICRO (gradient accumulation, as shoal does). Its tokens are random bytes, not the data loader's (the
loader costs shoal ~0.1 ms of a ~150 ms step). It is torchft's way (torchft 0.2.0, after pytorch/torchft's
train_ddp.py): a replica group per host, a lighthouse on h0 that forms a quorum each step, a failed
replica's share of the step dropped (the step commits with the others), and a replacement healed from a
live peer (PGTransport: over the process group) at its first quorum.

The gradients go through the Manager's fault-tolerant all-reduce, flattened into one buffer as DDP's one
bucket would be, not through torchft's DistributedDataParallel: with torch 2.13 on gloo, a peer's death
made that wrapper's comm hook fail its `assert fut._fut` (torchft/ddp.py) in the survivors' backward, and
DDP's reducer, left mid-reduction, refused the next step ("Expected to have finished reduction in the
prior iteration"): the survivors crashed at the first or second failure.

Environment: REPLICA_GROUP_ID, HOST_ADDR (this host's address: the replica's store and manager bind and
advertise it), TORCHFT_LIGHTHOUSE (http://h0:port), RUN_DIR, BATCH, MICRO. Replica group 0 (never
killed by the benchmark) appends a line per committed step to RUN_DIR/metrics.jsonl ({"step", "time",
"participants"}) and keeps RUN_DIR/progress.json, as a shoal run's rank 0 does.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from shoal.config import load_config  # noqa: E402
from shoal.models.gpt import build  # noqa: E402


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def main() -> None:
    from torchft import Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    replica, host = int(os.environ["REPLICA_GROUP_ID"]), os.environ["HOST_ADDR"]
    run_dir, batch, micro = Path(os.environ["RUN_DIR"]), int(os.environ["BATCH"]), int(os.environ["MICRO"])
    torch.set_num_threads(1)
    torch.manual_seed(0)  # every replica builds the same model
    cfg = load_config(str(ROOT / "configs" / "gpt-tiny.toml"), [])
    model = build(cfg.model, SimpleNamespace(vocab_size=256)).model
    seq = cfg.model.seq_len
    port = free_port(host)
    store = dist.TCPStore(host, port, 1, is_master=True, wait_for_workers=False)  # the replica group's own
    pg = ProcessGroupGloo(timeout=timedelta(seconds=5))  # as torchft's train_ddp.py on CPU
    state = {}

    def load_state_dict(sd) -> None:
        model.load_state_dict(sd["model"])
        state["optim"].load_state_dict(sd["optim"])

    manager = Manager(pg=pg, min_replica_size=1, load_state_dict=load_state_dict,
                      state_dict=lambda: {"model": model.state_dict(), "optim": state["optim"].state_dict()},
                      replica_id=f"h{replica}", timeout=timedelta(seconds=30), store_addr=host, store_port=port,
                      rank=0, world_size=1, hostname=host,
                      checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=10), device=torch.device("cpu")))
    params = [p for p in model.parameters() if p.requires_grad]
    state["optim"] = optimizer = Optimizer(manager, torch.optim.AdamW(model.parameters(), lr=cfg.train.lr))
    tokens = torch.Generator().manual_seed(1000 + replica)
    run_dir.mkdir(parents=True, exist_ok=True)
    log = open(run_dir / "metrics.jsonl", "a") if replica == 0 else None  # noqa: SIM115 - open for the run
    n = batch // micro
    while True:
        optimizer.zero_grad()  # starts the step's quorum
        for _ in range(n):
            x = torch.randint(0, 256, (micro, seq + 1), generator=tokens)
            loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()) / n
            loss.backward()
        # the gradients averaged over the quorum's participants in one fault-tolerant all-reduce (a failure is
        # reported to the manager, not raised), as DDP's one bucket would
        grads = [p.grad for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        manager.allreduce(flat).wait()
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        optimizer.step()  # commits only if every participant's all-reduce succeeded
        if log is not None:
            line = {"step": manager.current_step(), "time": time.time(), "participants": manager.num_participants()}
            log.write(json.dumps(line) + "\n")
            log.flush()
            (run_dir / "progress.json").write_text(json.dumps({"step": line["step"], "time": line["time"]}))
    del store


if __name__ == "__main__":
    main()
