"""The plain forms of Horovod's collectives: a new tensor, differentiable as in Horovod.

Each backward is Horovod's rule: an all-reduce's gradient is the all-reduce of the gradients (same op
and factors); an allgather's is the averaged gradient's rows of this process; a broadcast's is the
averaged gradient on the root and zero elsewhere; an alltoall's is the alltoall of the gradients back
along the received splits; a reducescatter's is the allgather of the gradients (times size for Sum).
"""

from __future__ import annotations

import torch

from shoal.errors import UserError
from shoal.horovod import compression as compressions
from shoal.horovod import ops, runtime
from shoal.horovod.gather import allgather_async, alltoall_async, broadcast_async
from shoal.horovod.handles import synchronize
from shoal.horovod.process_sets import global_process_set, whole
from shoal.horovod.reduce import allreduce_async, codec_allreduce, owned, reducescatter_async

NONE = compressions.Compression.none


def _averaged(grad: torch.Tensor) -> torch.Tensor:
    return synchronize(allreduce_async(grad, op=ops.Average))


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, name, prescale_factor, postscale_factor):
        ctx.args = (op, prescale_factor, postscale_factor)
        return synchronize(allreduce_async(tensor, None, name, op, prescale_factor, postscale_factor))

    @staticmethod
    def backward(ctx, grad):
        op, pre, post = ctx.args
        return synchronize(allreduce_async(grad, None, None, op, pre, post)), None, None, None, None


def allreduce(tensor, average=None, name=None, compression=NONE, op=None, prescale_factor=1.0, postscale_factor=1.0,
              process_set=global_process_set) -> torch.Tensor:
    """`tensor` reduced over every process (Average by default)."""
    op = ops.resolve(op, average)
    whole(process_set)
    compressions.check(compression)
    if compressions.is_codec(compression):
        return codec_allreduce(tensor, name, compression, op, prescale_factor * postscale_factor)
    sent, ctx = compression.compress(tensor)
    return compression.decompress(_Allreduce.apply(sent, op, name, prescale_factor, postscale_factor), ctx)


def grouped_allreduce(tensors, average=None, name=None, compression=NONE, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set) -> list[torch.Tensor]:
    return [allreduce(t, average, name, compression, op, prescale_factor, postscale_factor, process_set)
            for t in tensors]


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name):
        ctx.n = tensor.shape[0]
        return synchronize(allgather_async(tensor, name))

    @staticmethod
    def backward(ctx, grad):
        rows = synchronize(allgather_async(torch.tensor([ctx.n]))).tolist()  # every process's first dimension
        start = sum(rows[:runtime.rank()])
        return _averaged(grad)[start:start + ctx.n], None


def allgather(tensor, name=None, process_set=global_process_set) -> torch.Tensor:
    """Every process's `tensor` concatenated along dim 0, in rank order."""
    whole(process_set)
    return _Allgather.apply(tensor, name)


def grouped_allgather(tensors, name=None, process_set=global_process_set) -> list[torch.Tensor]:
    return [allgather(t, name, process_set) for t in tensors]


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name):
        ctx.root = root_rank
        return synchronize(broadcast_async(tensor, root_rank, name))

    @staticmethod
    def backward(ctx, grad):
        reduced = _averaged(grad)
        return (reduced if runtime.rank() == ctx.root else reduced.zero_()), None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    """root_rank's `tensor`, on every process (a new tensor)."""
    whole(process_set)
    return _Broadcast.apply(tensor, root_rank, name)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name):
        out, received = synchronize(alltoall_async(tensor, splits, name))
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _):
        back, _ = synchronize(alltoall_async(grad.contiguous(), ctx.received))
        return back, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """What every process sent this one, in rank order; with `splits`, also how many rows came from each."""
    whole(process_set)
    out, received = _Alltoall.apply(tensor, splits, name)
    return out if splits is None else (out, received)


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor):
        ctx.factor = prescale_factor * postscale_factor * (runtime.size() if op == ops.Sum else 1)
        return synchronize(reducescatter_async(tensor, name, op, global_process_set, prescale_factor,
                                               postscale_factor))

    @staticmethod
    def backward(ctx, grad):
        return allgather(ops.scale_(owned(grad), ctx.factor)), None, None, None, None


def reducescatter(tensor, name=None, compression=NONE, op=ops.Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0) -> torch.Tensor:
    """`tensor` reduced over every process; this process's rows of the result."""
    whole(process_set)
    compressions.check(compression)
    if compressions.is_codec(compression):
        raise UserError(f"hvd.reducescatter with {compression!r}: shoal's codecs are offered for allreduce and "
                        f"DistributedOptimizer; use compression=hvd.Compression.none or .fp16")
    sent, ctx = compression.compress(tensor)
    return compression.decompress(_Reducescatter.apply(sent, name, op, prescale_factor, postscale_factor), ctx)


def grouped_reducescatter(tensors, name=None, compression=NONE, op=ops.Average, process_set=global_process_set,
                          prescale_factor=1.0, postscale_factor=1.0) -> list[torch.Tensor]:
    return [reducescatter(t, name, compression, op, process_set, prescale_factor, postscale_factor) for t in tensors]
