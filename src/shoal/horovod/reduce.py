"""Horovod's reductions: allreduce and reducescatter, in their plain (differentiable), in-place (`_`),
asynchronous (`_async`) and grouped forms.

Each is one torch.distributed collective (all_reduce, reduce_scatter_tensor), logged through comm/.
The arithmetic is Horovod's: the input times `prescale_factor`, reduced, times `postscale_factor` (and
1/size for Average). A reducescatter splits dim 0 as Horovod does when it does not divide: the first
(rows mod size) processes get one row more.
"""

from __future__ import annotations

import torch

from shoal.errors import UserError
from shoal.horovod import ops, runtime
from shoal.horovod.handles import Handle, done, synchronize
from shoal.horovod.process_sets import global_process_set, whole


def label(kind: str, name: str | None) -> str:
    return f"hvd.{kind}" + (f" {name}" if name else "")


def owned(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy the operation may change (the out-of-place forms leave their input alone)."""
    return tensor.detach().clone(memory_format=torch.contiguous_format)


def contiguous(tensor: torch.Tensor, kind: str) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise UserError(f"hvd.{kind}: the tensor must be contiguous to be changed in place (pass t.contiguous(), "
                        f"or use the out-of-place form)")
    return tensor


# --- allreduce -------------------------------------------------------------------------------------

def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set) -> Handle:
    """Reduce `tensor` over every process, in place; a handle for synchronize()."""
    op = ops.resolve(op, average)
    whole(process_set)
    rt = runtime.runtime()
    t = ops.scale_(contiguous(tensor, "allreduce_"), prescale_factor)
    post = ops.post_factor(op, postscale_factor, rt.place.size)
    if rt.place.size == 1:
        return done(ops.scale_(t, post))
    pending = rt.comm.all_reduce_async(t, ops.torch_op(op), label("allreduce", name))
    return Handle([pending], lambda: ops.scale_(t, post))


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set) -> Handle:
    return allreduce_async_(owned(tensor), average, name, op, prescale_factor, postscale_factor, process_set)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set) -> torch.Tensor:
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def codec_allreduce(tensor, name, compression, op: int, factor: float) -> torch.Tensor:
    """Through one of shoal's codecs, which averages (its error feedback is kept under the op's name)."""
    if op not in (ops.Average, ops.Sum):
        raise UserError(f"hvd.allreduce with {compression!r}: a codec averages or sums; op={ops.NAMES[op]} needs "
                        f"compression=hvd.Compression.none")
    rt = runtime.runtime()
    out = owned(tensor)
    if rt.place.size > 1:
        codec = compression.shared_codec(rt.comm)
        codec.all_reduce_mean([out], [name or "allreduce"], None, label("allreduce", name))
    return ops.scale_(out, factor * (rt.place.size if op == ops.Sum else 1))


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                             process_set=global_process_set) -> Handle:
    return group([allreduce_async_(t, average, name, op, prescale_factor, postscale_factor, process_set)
                  for t in tensors])


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                            process_set=global_process_set) -> Handle:
    return grouped_allreduce_async_([owned(t) for t in tensors], average, name, op, prescale_factor,
                                    postscale_factor, process_set)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set) -> list[torch.Tensor]:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


def group(handles: list[Handle]) -> Handle:
    """One handle for several operations: waits for all, returns their results as a list."""
    return Handle([p for h in handles for p in h.pendings], lambda: [h.finish() for h in handles])


# --- reducescatter ---------------------------------------------------------------------------------

def rows_of(n: int, world: int) -> list[int]:
    """Horovod's split of n rows: the first n mod world processes get one more."""
    return [n // world + (1 if r < n % world else 0) for r in range(world)]


def reducescatter_async(tensor, name=None, op=ops.Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0) -> Handle:
    """Reduce `tensor` over every process; this process gets its rows of the result."""
    op = ops.check(op)
    whole(process_set)
    if op not in (ops.Average, ops.Sum):
        raise UserError(f"hvd.reducescatter: op={ops.NAMES[op]}; a reducescatter averages or sums (hvd.Average, "
                        f"hvd.Sum)")
    if tensor.dim() == 0:
        raise UserError("hvd.reducescatter: the tensor has no dimension to split; give it at least one")
    rt = runtime.runtime()
    w, rows = rt.place.size, rows_of(tensor.shape[0], rt.place.size)
    m = rows[0]
    # reduce_scatter_tensor takes equal chunks: each process's rows are placed in a chunk of m rows
    src = tensor.detach().new_zeros((w * m, *tensor.shape[1:]))
    offsets = [sum(rows[:r]) for r in range(w)]
    for r in range(w):
        src[r * m:r * m + rows[r]] = tensor.detach()[offsets[r]:offsets[r] + rows[r]]
    ops.scale_(src, prescale_factor)
    post = ops.post_factor(op, postscale_factor, w)
    out = src.new_empty((m, *tensor.shape[1:]))
    if w == 1:
        return done(ops.scale_(src, post))
    pending = rt.comm.reduce_scatter_into(out, src, ops.torch_op(op), label("reducescatter", name))
    return Handle([pending], lambda: ops.scale_(out[:rows[rt.place.rank]], post))


def grouped_reducescatter_async(tensors, name=None, op=ops.Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0) -> Handle:
    return group([reducescatter_async(t, name, op, process_set, prescale_factor, postscale_factor) for t in tensors])
