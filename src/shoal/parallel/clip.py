"""Gradient-norm clipping over a model whose gradients live on different meshes."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from shoal.comm.collectives import Comm


def plain(t: torch.Tensor) -> torch.Tensor:
    """A value computed on DTensors (a vocab-parallel loss, a norm) as an ordinary, replicated tensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def grad_norm(params: list[tuple[torch.Tensor, bool]], comm: Comm, device: torch.device, stage_group=None
              ) -> torch.Tensor:
    """The total gradient norm (a float64 scalar on `device`, never read by the host here) of gradients that
    are plain tensors and DTensors on different meshes (tensor-parallel layers on dp x tp, replicated ones
    on dp only, ...): tensors of different kinds cannot share one foreach kernel, so each kind's norm is
    taken apart and the total combined; with pipeline stages (`stage_group`), summed over the stages.
    `params`: (parameter, counted in the norm); a weight tied across stages is counted on one of them."""
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for group in _by_mesh(params).values():
        grads = [p.grad for p, counted in group if counted]
        if grads:
            squares = squares + plain(torch.nn.utils.get_total_norm(grads)).double().to(device) ** 2
    if stage_group is not None:
        squares = comm.all_reduce(squares, group=stage_group, label="pp, gradient norm")
    return squares.sqrt()


def clip_grads(params: list[tuple[torch.Tensor, bool]], max_norm: float, total: torch.Tensor) -> None:
    """Scale every gradient by torch's clip coefficient, min(1, max_norm / (total + 1e-6)), given the total
    norm: clip_grads_with_norm_'s arithmetic, applied to each gradient's local part (a DTensor's shard, a
    partial sum or a replica: scaling the part scales the whole, whatever its placement). torch 2.11's
    foreach multiply leaves a DTensor gradient whose placement is Partial unscaled (sequence parallelism's
    norm gains and biases: measured, their clipped gradients were the unclipped ones), so the clip never
    goes through DTensor's dispatch."""
    coef = torch.clamp(max_norm / (total.float() + 1e-6), max=1.0)
    kinds: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p, _ in params:
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        kinds.setdefault((g.device, g.dtype), []).append(g)
    for (device, _), grads in kinds.items():
        torch._foreach_mul_(grads, coef.to(device))


def _by_mesh(params: list[tuple[torch.Tensor, bool]]) -> dict[object, list[tuple[torch.Tensor, bool]]]:
    groups: dict[object, list[tuple[torch.Tensor, bool]]] = {}
    for p, counted in params:
        groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append((p, counted))
    return groups
