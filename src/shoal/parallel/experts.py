"""Expert parallelism: a mixture of experts' E experts split over the ep ranks of a group, each holding E / ep of
them (models/moe.py's layers), and every rank's tokens sent to the ranks of the experts they chose and back.

In each MoE layer, after the rank routed its own tokens and sorted its choices by expert (MoE.forward):
1. the choices per expert are exchanged (an all-to-all of E counts), so each rank learns how many rows it
   sends to each rank and receives from each (uneven: read on the host, the splits the next two need);
2. the rows go to their experts' ranks (comm/exchange.py: an all-to-all, differentiable);
3. they arrive by source rank, each source's rows by expert; they are put in expert order, the rank's experts
   run as one grouped GEMM over them (Experts), and the results are put back in arrival order;
4. the results go back to the ranks they came from by the reverse all-to-all, in the order they left.
The gradients take the same way back (the all-to-alls' backward). An expert's weight gradient so holds the
contributions of every rank's tokens that chose it; its replicas on other ep groups are the same experts.
"""

from __future__ import annotations

import torch
from torch import nn

from shoal.comm.collectives import Comm
from shoal.comm.exchange import exchange
from shoal.models.moe import Experts, MoE


class ExpertParallel:
    """An MoE layer's `dispatch` under expert parallelism: this rank holds experts [rank x local, (rank + 1) x
    local) of the layer's E, as `experts` (their weights only)."""

    def __init__(self, experts: Experts, n_experts: int, comm: Comm, group, ep: int, label: str = "ep"):
        self.experts, self.n_experts, self.comm, self.group, self.ep, self.label = experts, n_experts, comm, group, \
            ep, label
        self.local = n_experts // ep

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`rows`: this rank's choices sorted by expert, `counts` (E,) per expert; returns the experts' outputs
        for them, in the same order."""
        ep, local = self.ep, self.local
        received = torch.empty_like(counts)
        self.comm.all_to_all(received, counts, self.group, self.label)  # (source, my expert) counts
        sizes = received.view(ep, local)
        in_splits, out_splits = counts.view(ep, local).sum(1).tolist(), sizes.sum(1).tolist()
        arrived = exchange(rows, self.comm, self.group, self.label, out_splits, in_splits)
        order = by_expert(sizes)
        out = self.experts(arrived[order], sizes.sum(0))
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return exchange(out[back], self.comm, self.group, self.label, in_splits, out_splits)


def by_expert(sizes: torch.Tensor) -> torch.Tensor:
    """The rows of blocks arrived by source then expert (`sizes` (sources, experts): each block's rows), as
    indices in expert then source order."""
    starts = (torch.cumsum(sizes.reshape(-1), 0) - sizes.reshape(-1)).view_as(sizes)
    block_sizes, block_starts = sizes.t().reshape(-1), starts.t().reshape(-1)
    total = int(block_sizes.sum())
    first = torch.cumsum(block_sizes, 0) - block_sizes
    offset = torch.arange(total, device=sizes.device) - torch.repeat_interleave(first, block_sizes, output_size=total)
    return torch.repeat_interleave(block_starts, block_sizes, output_size=total) + offset


def split_experts(layer: MoE, comm: Comm, group, ep: int, ep_rank: int, label: str = "ep") -> None:
    """`layer` keeps only this rank's E / ep experts (a slice of its weights, made its parameters) and runs them
    by ExpertParallel."""
    e = layer.experts
    n = e.w_gate.shape[0]
    if n % ep:
        raise ValueError(f"ep {ep} does not divide the layer's {n} experts")
    local = slice(ep_rank * (n // ep), (ep_rank + 1) * (n // ep))
    for name in ("w_gate", "w_up", "w_down"):
        setattr(e, name, nn.Parameter(getattr(e, name).detach()[local].clone()))
    layer.dispatch = ExpertParallel(e, n, comm, group, ep, label)
