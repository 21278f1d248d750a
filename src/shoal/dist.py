"""Process-group setup and teardown for one worker.

[Note: per-attempt store] After torch elastic restarts a worker group, building the new group on the
agent's store as-is fails often on gloo ("connectFullMesh failed ... Connection refused": keys of the
dead attempt are still there). Prefixing the store with the restart attempt gives each attempt clean
keys; measured 4 of 4 recoveries against 1 of 3 without (TORCH-CPU-FACTS, trap 2).

[Note: exit] A gloo worker can abort with SIGABRT in static destructors after all its work is done
(2 of 20 runs here even after barrier + destroy_process_group). Workers therefore end with os._exit
after flushing: the exit code is the run's, not the destructor's (trap 1).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from shoal.errors import UserError


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def choose_backend(requested: str) -> str:
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested == "nccl" and not torch.cuda.is_available():
        raise UserError('parallel.backend = "nccl" needs CUDA, which is not available; use "gloo" or "auto"')
    return requested


def is_launched() -> bool:
    """True inside a worker started by torch elastic (shoal --nproc, torchrun) or a similar launcher."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    restart_count: int
    device: torch.device
    store: dist.Store  # prefixed per attempt; shared by all ranks for small key/value exchanges
    status_store: dist.Store  # the same keys over a second connection, for the watchdog thread


def init(backend: str, timeout_s: float) -> DistEnv:
    """Join (or, alone, create) the default process group."""
    timeout = timedelta(seconds=timeout_s)
    if is_launched():
        env = os.environ
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local_rank = int(env.get("LOCAL_RANK", 0))
        local_world = int(env.get("LOCAL_WORLD_SIZE", 1))
        restart = int(env.get("TORCHELASTIC_RESTART_COUNT", 0))
        # under torch elastic the agent hosts the store; a hand-rolled env launch makes rank 0 host it
        agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        base = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world,
                             is_master=(rank == 0 and not agent_store), timeout=timeout)
        # a node joining an elastic job re-forms the group without counting a restart: the world size
        # tells those rounds apart
        prefix = f"shoal/attempt_{restart}_world_{world}"
        store = dist.PrefixStore(prefix, base)  # [Note: per-attempt store]
        side = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=False,
                             timeout=timedelta(seconds=10), wait_for_workers=False)
        status_store = dist.PrefixStore(prefix, side)
    else:
        rank, world, local_rank, local_world, restart = 0, 1, 0, 1, 0
        store = status_store = dist.HashStore()
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return DistEnv(rank, world, local_rank, local_world, restart, device, store, status_store)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int) -> None:
    """End a worker process with `code`, skipping destructors that may abort ([Note: exit])."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
