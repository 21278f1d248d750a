"""Horovod's reduction ops (its own values: scripts compare them and pass them around) and how each
runs on torch.distributed.

Average is a sum followed by a division by the number of processes, applied with the operation's
post-scale factor (as Horovod's own backend does): one all-reduce, and the same `prescale_factor` /
`postscale_factor` arithmetic for every op. Adasum (Horovod's adaptive summation) has no counterpart
in torch.distributed and is refused.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from shoal.errors import UserError

Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5  # Horovod's ReduceOp values

NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}
TORCH = {Average: dist.ReduceOp.SUM, Sum: dist.ReduceOp.SUM, Min: dist.ReduceOp.MIN, Max: dist.ReduceOp.MAX,
         Product: dist.ReduceOp.PRODUCT}

ADASUM = ("op=hvd.Adasum: shoal's Horovod does not implement Adasum (adaptive summation has no torch.distributed "
          "collective); use op=hvd.Average (the default) and scale the learning rate by hvd.size()")


def resolve(op, average=None) -> int:
    """The op a call asks for: `op`, else the deprecated `average` flag, else Average (Horovod's rule)."""
    if op is not None and average is not None:
        raise UserError("give op= or the deprecated average=, not both (op supersedes average)")
    if op is None and average is None:
        op = Average
    elif op is None:
        warnings.warn("average= is deprecated in Horovod; use op=hvd.Average or op=hvd.Sum", DeprecationWarning,
                      stacklevel=3)
        op = Average if average else Sum
    return check(op)


def check(op) -> int:
    if op == Adasum:
        raise UserError(ADASUM)
    if op not in TORCH:
        raise UserError(f"op={op!r}: not a Horovod reduction op; use hvd.Average, hvd.Sum, hvd.Min, hvd.Max or "
                        f"hvd.Product")
    return op


def torch_op(op: int):
    return TORCH[op]


def post_factor(op: int, postscale_factor: float, world: int) -> float:
    """What multiplies the reduced tensor: the caller's post-scale, and 1/world for an average."""
    return postscale_factor / world if op == Average else postscale_factor


def scale_(t: torch.Tensor, factor: float) -> torch.Tensor:
    """`t` multiplied by `factor` in place; an integer tensor keeps its type (rounded toward zero, as
    Horovod scales integer buffers)."""
    if factor == 1.0:
        return t
    if t.is_floating_point() or t.is_complex():
        return t.mul_(factor)
    return t.copy_(t.double().mul_(factor).trunc_())
