"""The all-to-all that expert parallelism sends tokens by (parallel/experts.py), differentiable: rows go to the
ranks the splits say, and their gradients come back by the reverse all-to-all. Through Comm, so that each is
logged under its mesh axis's label and a rank that never arrives is named by the hang report."""

from __future__ import annotations

import torch

from shoal.comm.collectives import Comm


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, group, label: str, out_splits: list[int],
                in_splits: list[int]) -> torch.Tensor:
        ctx.comm, ctx.group, ctx.label, ctx.splits = comm, group, label, (out_splits, in_splits)
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        return comm.all_to_all(out, x.contiguous(), group, label, out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(in_splits), *grad.shape[1:])
        ctx.comm.all_to_all(back, grad.contiguous(), ctx.group, ctx.label, in_splits, out_splits)
        return back, None, None, None, None, None


def exchange(x: torch.Tensor, comm: Comm, group, label: str, out_splits: list[int],
             in_splits: list[int]) -> torch.Tensor:
    """Rows in_splits[j] of `x` (in order) to rank j of `group`; the result holds out_splits[r] rows from each
    rank r, in rank order."""
    return _Exchange.apply(x, comm, group, label, out_splits, in_splits)
