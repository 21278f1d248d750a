"""Horovod's data movements: allgather (first dimensions may differ across processes), broadcast and
alltoall (uneven splits), in their in-place and asynchronous forms; barrier.

An allgather first all-gathers every process's shape (one small collective), so that tensors which
differ beyond dim 0 are refused in one line on every process alike instead of failing inside gloo.
"""

from __future__ import annotations

import torch

from shoal.errors import UserError
from shoal.horovod import runtime
from shoal.horovod.handles import Handle, done, synchronize
from shoal.horovod.process_sets import global_process_set, whole
from shoal.horovod.reduce import contiguous, group, label, owned

# a tensor's dtype as a number, to compare across processes (-1: any other)
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128)
MAX_DIMS = 16


# --- allgather -------------------------------------------------------------------------------------

def shapes(tensor: torch.Tensor, name: str | None) -> list[tuple[int, tuple[int, ...]]]:
    """Every process's (dtype number, shape), in rank order; refused alike everywhere unless they differ in
    dim 0 only."""
    if tensor.dim() == 0 or tensor.dim() > MAX_DIMS:
        raise UserError(f"{label('allgather', name)}: a tensor of {tensor.dim()} dimensions; an allgather "
                        f"concatenates along dim 0 and takes 1 to {MAX_DIMS}")
    rt = runtime.runtime()
    code = DTYPES.index(tensor.dtype) if tensor.dtype in DTYPES else -1
    # on the tensor's device (NCCL takes no CPU tensor), read by the host once
    mine = torch.tensor([code, tensor.dim(), *tensor.shape, *[0] * (MAX_DIMS - tensor.dim())], dtype=torch.int64,
                        device=tensor.device)
    every = torch.empty(rt.place.size * mine.numel(), dtype=torch.int64, device=tensor.device)
    rt.comm.all_gather_into(every, mine, label("allgather", name) + ", shapes").wait()
    got = [(r[0], tuple(r[2:2 + r[1]])) for r in every.view(rt.place.size, -1).tolist()]
    if any(c != got[0][0] or s[1:] != got[0][1][1:] for c, s in got):
        seen = ", ".join(f"rank {r}: {list(s)} {DTYPES[c] if c >= 0 else '?'}" for r, (c, s) in enumerate(got))
        raise UserError(f"{label('allgather', name)}: the tensors differ beyond the first dimension ({seen}); "
                        f"only dim 0 may differ")
    return got


def allgather_async(tensor, name=None, process_set=global_process_set) -> Handle:
    """Every process's `tensor`, concatenated along dim 0 in rank order (a new tensor)."""
    whole(process_set)
    rt = runtime.runtime()
    if rt.place.size == 1:
        return done(owned(tensor))
    rows = [s[0] for _, s in shapes(tensor, name)]
    m = max(rows)
    # measured with torch 2.13: gloo's all_gather refuses tensors of different sizes ("ProcessGroupGloo::
    # allgather: invalid tensor size"); every process sends m rows (zeros past its own) and the padding is
    # cut from the result
    src = tensor.detach().new_zeros((m, *tensor.shape[1:]))
    src[:tensor.shape[0]] = tensor.detach()
    out = src.new_empty((rt.place.size * m, *tensor.shape[1:]))
    pending = rt.comm.all_gather_into(out, src, label("allgather", name))
    if all(r == m for r in rows):
        return Handle([pending], lambda: out)
    return Handle([pending], lambda: torch.cat([out[r * m:r * m + n] for r, n in enumerate(rows)]))


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> Handle:
    return group([allgather_async(t, name, process_set) for t in tensors])


# --- broadcast -------------------------------------------------------------------------------------

def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> Handle:
    """`tensor` replaced, on every process, by root_rank's."""
    whole(process_set)
    rt = runtime.runtime()
    if not 0 <= root_rank < rt.place.size:
        raise UserError(f"{label('broadcast', name)}: root_rank={root_rank}, but the ranks are 0 to "
                        f"{rt.place.size - 1}")
    t = contiguous(tensor, "broadcast_")
    if rt.place.size == 1:
        return done(t)
    return Handle([rt.comm.broadcast_async(t, root_rank, label("broadcast", name))], lambda: t)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> Handle:
    return broadcast_async_(owned(tensor), root_rank, name, process_set)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# --- alltoall --------------------------------------------------------------------------------------

def send_rows(splits, n: int, world: int, name: str | None) -> list[int]:
    """The rows this process sends each process: `splits`, else dim 0 split evenly."""
    if splits is None:
        if n % world:
            raise UserError(f"{label('alltoall', name)}: {n} rows do not split evenly over {world} processes; give "
                            f"splits= (rows for each process, in rank order)")
        return [n // world] * world
    rows = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    if len(rows) != world or sum(rows) != n or min(rows) < 0:
        raise UserError(f"{label('alltoall', name)}: splits={rows} should be {world} non-negative numbers of rows "
                        f"adding up to the tensor's {n}")
    return rows


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> Handle:
    """Rows splits[j] of `tensor` to process j; the result is what every process sent this one, in rank
    order, and how many rows came from each (int32)."""
    whole(process_set)
    if tensor.dim() == 0:
        raise UserError(f"{label('alltoall', name)}: the tensor has no dimension to split; give it at least one")
    rt = runtime.runtime()
    rows = send_rows(splits, tensor.shape[0], rt.place.size, name)
    got = torch.empty(rt.place.size, dtype=torch.int64, device=tensor.device)  # NCCL takes no CPU tensor
    rt.comm.all_to_all_async(got, torch.tensor(rows, dtype=torch.int64, device=tensor.device), None, None,
                             label("alltoall", name) + ", splits").wait()
    received = got.tolist()
    out = tensor.new_empty((sum(received), *tensor.shape[1:]))
    pending = rt.comm.all_to_all_async(out, tensor.detach().contiguous(), received, rows, label("alltoall", name))
    return Handle([pending], lambda: (out, torch.tensor(received, dtype=torch.int32)))


def barrier(process_set=global_process_set) -> None:
    """Wait until every process arrives here."""
    whole(process_set)
    rt = runtime.runtime()
    if rt.place.size > 1:
        rt.comm.barrier("hvd.barrier")
