"""This process's Horovod: `init` / `shutdown`, its place in the job (size, rank, local and cross ranks)
and what is built.

Horovod's API is one per process by its nature (`hvd.rank()` anywhere in a script), so the state is
one module-level object made by `init`. `init` joins the job's default process group as shoal's
workers do (dist.init: a per-attempt store, torch's flight recorder on), or adopts one that exists
already (the script, torchrun's user or a test made it). CPU tensors travel over gloo; where CUDA and
NCCL are present, CUDA tensors travel over NCCL in the same group (torch's "cpu:gloo,cuda:nccl"), as
Horovod moves each tensor where it lives.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shoal import dist as shoal_dist
from shoal.comm.user_ops import UserComm
from shoal.errors import UserError

# parallel.timeout_s's default: a collective that waits longer fails, naming itself, instead of hanging
TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Place:
    """Where this process sits: Horovod's six numbers."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


@dataclass
class Runtime:
    place: Place
    comm: UserComm
    owns_group: bool  # made by init (shutdown destroys it), or adopted (left to its maker)
    group: object  # the default group it runs on: a process group made again since is joined again


_runtime: Runtime | None = None


def init(comm=None, process_sets=None) -> None:
    """Join the job (a second call does nothing, as in Horovod)."""
    global _runtime
    if comm is not None:
        raise UserError("hvd.init(comm=...): shoal's Horovod runs on torch.distributed, not MPI; call hvd.init() and "
                        "start the processes with `shoal run --horovod`")
    if process_sets:
        raise UserError("hvd.init(process_sets=...): process sets are not supported by shoal's Horovod; every "
                        "operation runs over all processes (leave process_sets out)")
    if _runtime is not None and dist.is_initialized() and _runtime.group is dist.group.WORLD:
        return
    owns = not dist.is_initialized()
    if owns:
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
        shoal_dist.init(backend, TIMEOUT_S)
    rank, size = dist.get_rank(), dist.get_world_size()
    comm = UserComm(None, rank, size)
    _runtime = Runtime(place_of(comm, rank, size), comm, owns, dist.group.WORLD)


def place_of(comm: UserComm, rank: int, size: int) -> Place:
    """Local and cross ranks from every process's node and local rank (one all-gather at init): the
    launcher's LOCAL_RANK and GROUP_RANK (torch elastic's node rank) where set, else the host name."""
    node = os.environ.get("GROUP_RANK") or socket.gethostname()
    local = os.environ.get("LOCAL_RANK")
    everyone = comm.all_gather_objects((node, None if local is None else int(local)), "hvd.init")
    # a rank's local rank: the launcher's, else its place among the ranks of its node before it
    locals_ = [lr if lr is not None else sum(1 for m, _ in everyone[:r] if m == n)
               for r, (n, lr) in enumerate(everyone)]
    nodes = list(dict.fromkeys(n for n, _ in everyone))  # in the order of their first rank
    local_rank = locals_[rank]
    local_size = sum(1 for n, _ in everyone if n == node)
    cross_size = sum(1 for lr in locals_ if lr == local_rank)  # the nodes that have this local rank
    return Place(rank, size, local_rank, local_size, nodes.index(node), cross_size)


def shutdown() -> None:
    """Leave the job; `init` may join again (Horovod's elastic reset does both)."""
    global _runtime
    if _runtime is not None and _runtime.owns_group:
        shoal_dist.shutdown()
    _runtime = None


def is_initialized() -> bool:
    return _runtime is not None


def runtime() -> Runtime:
    if _runtime is None:
        raise UserError("Horovod has not been initialized; call hvd.init() first")
    return _runtime


def size() -> int:
    return runtime().place.size


def rank() -> int:
    return runtime().place.rank


def local_size() -> int:
    return runtime().place.local_size


def local_rank() -> int:
    return runtime().place.local_rank


def cross_size() -> int:
    return runtime().place.cross_size


def cross_rank() -> int:
    return runtime().place.cross_rank


def is_homogeneous() -> bool:
    """Every node runs as many processes (as Horovod means it)."""
    p = runtime().place
    return p.size == p.local_size * p.cross_size


# --- what is built, as Horovod's scripts ask it -----------------------------------------------------
# Horovod reports how it was compiled; here the transports are torch's: gloo always, NCCL where torch
# has CUDA and NCCL. No MPI, DDL, oneCCL or ROCm path exists.

def gloo_built() -> bool:
    return dist.is_gloo_available()


def gloo_enabled() -> bool:
    return gloo_built()


def nccl_built() -> bool:
    return torch.cuda.is_available() and dist.is_nccl_available()


def cuda_built() -> bool:
    return torch.cuda.is_available()


def mpi_built() -> bool:
    return False


def mpi_enabled() -> bool:
    return False


def mpi_threads_supported() -> bool:
    raise UserError("hvd.mpi_threads_supported(): shoal's Horovod has no MPI (check hvd.mpi_enabled() first)")


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def rocm_built() -> bool:
    return False
