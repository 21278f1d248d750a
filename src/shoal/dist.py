"""Process-group setup and teardown for one worker.

[Note: per-attempt store] After torch elastic restarts a worker group, building the new group on the
agent's store as-is fails often on gloo ("connectFullMesh failed ... Connection refused": keys of the
dead attempt are still there; measured here 2 of 3 restarts failing). Prefixing the store with the
restart attempt gives each attempt clean keys: 4 of 4 recoveries.

[Note: exit] A gloo worker can abort with SIGABRT in static destructors after all its work is done
("terminate called without an active exception"; 2 of 20 plain DDP runs here, even after barrier +
destroy_process_group). Workers therefore end with os._exit after flushing: the exit code is the
run's, not the destructor's (0 of 16 runs aborted that way).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from shoal.comm import flight
from shoal.compat import release_dtensor_caches
from shoal.config import Config


def is_launched() -> bool:
    """True inside a worker started by torch elastic (shoal --nproc, torchrun) or a similar per-process
    launcher. LOCAL_RANK tells a worker from a Kubeflow PyTorchJob pod, which gets the other four for the
    node; an Azure ML node gets all five, and is told apart by its variables ([Note: pod or worker] in
    launch/environment.py)."""
    return (all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"))
            and not azureml_node(os.environ))


def azureml_node(env) -> bool:
    """A node of an Azure ML job with the PyTorch distribution (it sets RANK, LOCAL_RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT and NODE_RANK on each), as opposed to a worker that a launcher on it started
    (torch elastic's carry TORCHELASTIC_RUN_ID; shoal's live workers SHOAL_LIVE_ID)."""
    return ("AZUREML_RUN_ID" in env and "NODE_RANK" in env and "TORCHELASTIC_RUN_ID" not in env
            and "SHOAL_LIVE_ID" not in env)


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


def init(backend: str, timeout_s: float, device: str | None = None) -> DistEnv:
    """Join (or, alone, create) the default process group; `device` as join's."""
    if not is_launched():
        store = dist.HashStore()
        return join(backend, timeout_s, store, store, rank=0, world_size=1, device=device)
    env = os.environ
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    restart = int(env.get("TORCHELASTIC_RESTART_COUNT", 0))
    timeout = timedelta(seconds=timeout_s)
    # under torch elastic the agent hosts the store; a hand-rolled env launch makes rank 0 host it
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    base = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world,
                         is_master=(rank == 0 and not agent_store), timeout=timeout)
    # a node joining an elastic job re-forms the group without counting a restart: the world size
    # tells those rounds apart
    prefix = f"shoal/attempt_{restart}_world_{world}"
    side = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=False,
                         timeout=timedelta(seconds=10), wait_for_workers=False)
    store, status_store = dist.PrefixStore(prefix, base), dist.PrefixStore(prefix, side)  # [Note: per-attempt store]
    return join(backend, timeout_s, store, status_store, rank, world, int(env.get("LOCAL_RANK", 0)),
                int(env.get("LOCAL_WORLD_SIZE", 1)), restart, device=device)


def join(backend: str, timeout_s: float, store, status_store, rank: int, world_size: int, local_rank: int = 0,
         local_world_size: int = 1, restart_count: int = 0, device: str | None = None) -> DistEnv:
    """The default process group over `store`, with torch's flight recorder on (comm/flight.py). `device`:
    "cuda" or "cpu" (the layout's); None: GPUs under NCCL, the CPU under gloo. On GPUs, local rank r takes
    GPU r mod the GPUs: one each under NCCL (the launcher refuses more workers than GPUs), shared under gloo."""
    flight.enable()
    kind = device or ("cuda" if backend == "nccl" else "cpu")
    where = torch.device("cpu")
    if kind == "cuda":
        where = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(where)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    return DistEnv(rank, world_size, local_rank, local_world_size, restart_count, where, store, status_store)


def shutdown() -> None:
    """The run's process groups destroyed, and DTensor's caches, which hold its meshes (and so its groups)
    past it, emptied: in a process that runs again, each group ends here, on every rank alike."""
    if dist.is_initialized():
        release_dtensor_caches()
        dist.destroy_process_group()


def exit_process(code: int) -> None:
    """End a worker process with `code`, skipping destructors that may abort ([Note: exit])."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def threads_per_worker(cfg: Config, local_world_size: int) -> int:
    """The threads a worker computes with: parallel.threads_per_worker, else its share of the cores."""
    return cfg.parallel.threads_per_worker or share_of_cores(local_world_size)


def share_of_cores(local_world_size: int) -> int:
    """The cores this process may use, shared among the node's workers (at least 1 each)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // local_world_size)


def name_process(name: str) -> None:
    """This process's name as top and `ps -o comm` show it (Linux; 15 bytes): a forked worker's command
    line is its server's, so the name says which rank it is."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
