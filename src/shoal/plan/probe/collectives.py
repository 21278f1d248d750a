"""The group's collective curves: all-reduce, all-gather, reduce-scatter, all-to-all and point-to-point over
message sizes, issued through comm/, each time the slowest rank's; on a GPU with what NCCL's communicator adds."""

from __future__ import annotations

import statistics
import time

import torch

from shoal.comm.collectives import Comm
from shoal.plan.probe.gpu_memory import outside_bytes

KIB = 1024
DEFAULT_SIZES = tuple(4 * KIB * 4 ** k for k in range(8))  # 4 KiB .. 64 MiB
# all_to_all: expert parallelism's dispatch (parallel/experts.py), each rank's message split evenly over the group;
# a plan's spot measurement leaves it out (a mixture of experts' plan then prices it as a reduce-scatter)
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


def collective_curves(comm: Comm, device: torch.device, sizes, repeats: int, sync, ops=COLLECTIVES) -> dict:
    """{op: [[message bytes, seconds], ...]} over the whole group for each of `ops`; the message is what one
    rank contributes (all-gather: its shard; reduce-scatter: the whole input it reduces; all-to-all: all it
    sends)."""
    world, rank = comm.world_size, comm.rank
    curves: dict[str, list[tuple[float, float]]] = {op: [] for op in COLLECTIVES}
    for size in sizes:
        n = max(size // 4, world)
        n -= n % world  # reduce-scatter splits the input evenly
        t = torch.ones(n, device=device)
        shard, received = torch.ones(n // world, device=device), torch.empty(n, device=device)
        peer = rank ^ 1  # pairs 0-1, 2-3, ...
        runs = {
            "all_reduce": lambda t=t: comm.all_reduce(t, label="probe"),
            "all_gather": lambda s=shard: comm.all_gather_flat(s, label="probe"),
            "reduce_scatter": lambda t=t, s=shard: comm.reduce_scatter(s, t, label="probe"),
            "all_to_all": lambda t=t, o=received: comm.all_to_all(o, t, label="probe"),
        }
        if world > 1 and world % 2 == 0:
            def send_recv(t=t, peer=peer):
                if rank % 2 == 0:
                    comm.send(t, peer, "probe").wait()
                    comm.recv(t, peer, "probe")
                else:
                    comm.recv(t, peer, "probe")
                    comm.send(t, peer, "probe").wait()
            runs["send_recv"] = send_recv  # a round trip: half of it is one message's time
        # small messages take 0.2 ms or, now and then, 3-4 (a peer's thread not yet scheduled): a median
        # needs more than a few of them
        times = repeats if size > 256 * KIB else max(repeats, 15)
        for op, fn in ((op, fn) for op, fn in runs.items() if op in ops):
            seconds = [_group_time(comm, fn, sync, device) for _ in range(times + 1)][1:]  # 1st warms up
            sec = statistics.median(seconds)
            # keyed by what one rank contributes, as predict.py asks: an all-gather's shard, an all-to-all's whole
            message = n // world * 4 if op == "all_gather" else n * 4
            curves[op].append((float(message), sec / 2 if op == "send_recv" else sec))
    return {op: envelope(pts) for op, pts in curves.items() if pts}


def envelope(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Each size's time at most any larger size's: a message's time never falls as it grows, so a small
    one measured slower than a larger one met the slow mode (here 2.5-3.7 ms against 0.3-0.7 for 16 KiB to
    1 MiB, now at one size, now at another, probe to probe) in most of its repetitions."""
    out, least = [], float("inf")
    for size, seconds in sorted(points, reverse=True):
        least = min(least, seconds)
        out.append((size, least))
    return out[::-1]


def _group_time(comm: Comm, fn, sync, device) -> float:
    """One run of `fn` started together (a barrier), timed as the slowest rank's."""
    comm.barrier(label="probe")
    t0 = time.perf_counter()
    fn()
    sync()
    took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
    comm.all_reduce(took, label="probe: slowest rank", op=torch.distributed.ReduceOp.MAX)
    return float(took.item())


def gpu_collectives(comm: Comm, device: torch.device, sizes, repeats: int, sync, outside=outside_bytes) -> dict:
    """A GPU's collective curves, with what the process holds outside the caching allocator before them (the
    CUDA context with the kernels loaded so far: context_bytes) and what that grew by across the all-reduces,
    all-gathers and reduce-scatters of the default group at every size (its NCCL communicator's buffers, which
    NCCL sets up at the first collective and as each new algorithm first runs: nccl_bytes). Point-to-point
    runs after them: torch's NCCL backend may make a communicator of its own for a pair of ranks."""
    context = outside(device)
    curves = collective_curves(comm, device, sizes, repeats, sync, ops=COLLECTIVES[:3])
    nccl = max(outside(device) - context, 0)
    curves |= collective_curves(comm, device, sizes, repeats, sync, ops=COLLECTIVES[3:])  # all-to-all, point-to-point
    return {"collectives": curves, "context_bytes": context, "nccl_bytes": nccl}


def sizes_up_to(max_bytes: int) -> tuple[int, ...]:
    return tuple(s for s in DEFAULT_SIZES if s <= max_bytes) or (DEFAULT_SIZES[0],)
