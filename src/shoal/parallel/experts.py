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

A transformers mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE) is split the same way: its router and its
balance loss stay its own, and its experts block's forward is replaced by one that sorts the choices the router
made and sends them through the same dispatch, its stacked weights (gate_up_proj, down_proj) sharded on the ep
ranks under their own names.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shoal.comm.collectives import Comm
from shoal.comm.exchange import exchange
from shoal.compat import split_mesh_axis
from shoal.errors import UserError
from shoal.models.moe import MoE, expert_matmul, grouped_choice, in_compute_dtype, local_weight

EXPERT_MESH = ("edp", "ep")  # the experts' mesh: the ranks holding the same experts, and the ep group

WEIGHTS = ("w_gate", "w_up", "w_down")


class ExpertParallel:
    """An MoE layer's `dispatch` under expert parallelism: this rank holds experts [rank x local, (rank + 1) x
    local) of the layer's E, as `experts` (their weights only)."""

    def __init__(self, experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], n_experts: int, comm: Comm,
                 group, ep: int, label: str = "ep"):
        self.experts, self.n_experts, self.comm, self.group, self.ep, self.label = experts, n_experts, comm, group, \
            ep, label
        self.local = n_experts // ep

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`rows`: this rank's choices sorted by expert, `counts` (E,) per expert; returns the experts' outputs
        for them, in the same order."""
        ep, local = self.ep, self.local
        # under autocast the experts compute in its dtype: the rows travel in it (half the bytes of fp32's), the
        # same values Experts would cast on arrival
        rows = in_compute_dtype(rows)
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


class ExpertLayout:
    """parallel.ep over the data-parallel ranks: the run's mesh's dp axis split into (dp / ep) x ep, each row of
    ep ranks splitting every layer's experts (their weights DTensors sharded on the row's "ep" dimension, which
    DCP saves and reshards as any DTensor), the columns ("edp") holding the same experts. Under tensor
    parallelism each tp rank has such a mesh of its own, over the dp ranks of its tp coordinate: the tp ranks of a
    dp rank hold the same tokens, and send them to their experts alike. DDP (or, under tp, FSDP2's replicate)
    leaves the experts' weights alone; their gradients, each holding the contributions of every token of its row
    that chose them, are summed over the column and divided by dp after the step's backward: DDP's mean over the
    dp ranks."""

    def __init__(self, model: nn.Module, ep: int, mesh, comm: Comm):
        from torch.distributed.tensor import Shard, distribute_tensor

        dp = mesh["dp"].size()
        self.mesh = split_mesh_axis(mesh, "dp", (dp // ep, ep), EXPERT_MESH)
        logging.getLogger("torch.distributed.tensor._redistribute").addFilter(_two_step_hint)
        self.comm, self.dp = comm, dp
        self.names: list[str] = []
        self.layers: list[nn.Module] = []  # each layer's experts (what ZeRO 2/3 shards over edp)
        group = self.mesh["ep"].get_group()
        for prefix, layer, block, weights in expert_blocks(model, ep):
            self.layers.append(block)
            for w in weights:
                setattr(block, w, nn.Parameter(distribute_tensor(getattr(block, w).detach(), self.mesh["ep"],
                                                                 [Shard(0)])))
                self.names.append(f"{prefix}.{w}")
            n = getattr(block, weights[0]).shape[0]
            if block is layer:  # a transformers block: its forward stands in for its own (RoutedRows)
                layer.forward = RoutedRows(ExpertParallel(TransformersExperts(layer), n, comm, group, ep), n)
            else:
                layer.dispatch = ExpertParallel(block, n, comm, group, ep)
        self.params = [p for n, p in model.named_parameters() if n in self.names]

    def sync_grads(self) -> None:
        """The experts' gradients summed over the ranks holding the same experts, then divided by dp."""
        group = self.mesh["edp"].get_group() if self.mesh["edp"].size() > 1 else None
        for p in self.params:
            if p.grad is None:
                continue
            local = p.grad.to_local()
            if group is not None:
                self.comm.all_reduce(local, group=group, label="edp")
            local.div_(self.dp)


    def units(self) -> list[tuple[nn.Module, object, int]]:
        """ZeRO 2/3's units for the experts (zero.py shard_parameters): each layer's Experts sharded over "edp",
        the ranks that hold the same experts (torchtitan's choice), their gradients reduce-scattered there and
        divided by dp rather than by edp's size: DDP's mean over every dp rank, as sync_grads gives."""
        return [(e, self.mesh["edp"], self.dp) for e in self.layers]


TRANSFORMERS_WEIGHTS = ("gate_up_proj", "down_proj")


def expert_blocks(model: nn.Module, ep: int) -> list[tuple[str, nn.Module, nn.Module, tuple[str, ...]]]:
    """Each MoE layer of `model` as parallel.ep (`ep`) splits it: (its experts' weights' name prefix, the layer, the
    module holding the weights, their names): shoal's MoE and its Experts, or a transformers experts block
    (transformers_experts) itself. A model with none of them is refused in one line (run before any worker starts:
    preflight.py)."""
    out = []
    for name, layer in model.named_modules():
        if isinstance(layer, MoE):
            out.append((f"{name}.experts" if name else "experts", layer, layer.experts, WEIGHTS))
        elif transformers_experts(layer):
            out.append((name, layer, layer, TRANSFORMERS_WEIGHTS))
    if not out:
        raise UserError(f"parallel.ep = {ep}: the model has experts, but none of its experts blocks is one shoal can "
                        f"split (shoal's MoE, or a transformers block with stacked gate_up_proj and down_proj weights "
                        f"and no biases, as Mixtral's and Qwen-MoE's); set parallel.ep = 1")
    return out


def transformers_experts(module: nn.Module) -> bool:
    """Whether `module` is a transformers experts block shoal's dispatch can stand in for: its experts' weights
    stacked, gate_up_proj (E, 2 I, H) with the gate's half first and down_proj (E, H, I), an `act_fn`, and a
    forward (hidden_states (N, H), top_k_index (N, k), top_k_weights (N, k)), without biases, a norm after each
    expert or a transposed layout (the flags transformers' use_experts_implementation sets, where the class has
    them): Mixtral's, Qwen2-MoE's and Qwen3-MoE's in transformers 5."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == down.dim() == 3):
        return False
    experts, width, hidden = gate_up.shape
    return (tuple(down.shape) == (experts, hidden, width // 2) and hasattr(module, "act_fn")
            and getattr(module, "has_gate", True) and getattr(module, "is_concatenated", True)
            and not any(getattr(module, flag, False) for flag in ("has_bias", "is_transposed", "has_post_expert_norm")))


class TransformersExperts:
    """A transformers experts block's products (ExpertParallel's `experts`) over rows sorted by expert: this rank's
    experts' gate_up_proj, the block's act_fn on the gate's half times the up half, then down_proj, as its own
    forward computes each expert's; one grouped GEMM (or batched product) over the experts for each, as Experts."""

    def __init__(self, block: nn.Module):
        self.block = block

    def __call__(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        x = in_compute_dtype(x)
        gate_up = local_weight(self.block.gate_up_proj, x.dtype).transpose(1, 2)  # (E, H, 2 I)
        down = local_weight(self.block.down_proj, x.dtype).transpose(1, 2)  # (E, I, H)
        grouped = grouped_choice("auto", x, gate_up, down)
        gate, up = expert_matmul(x, gate_up, offsets, counts, grouped).chunk(2, dim=-1)
        return expert_matmul(self.block.act_fn(gate) * up, down, offsets, counts, grouped)


class RoutedRows:
    """A transformers experts block's forward under parallel.ep: each token's choices sorted by expert and sent to
    their experts' ranks by `dispatch` (ExpertParallel), as MoE.forward sends shoal's, and the results weighted by
    the router's weights and summed per token."""

    def __init__(self, dispatch: ExpertParallel, experts: int):
        self.dispatch, self.experts = dispatch, experts

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        n, k = top_k_index.shape
        flat = top_k_index.reshape(-1)  # token t's choices at t k + j
        order = torch.argsort(flat, stable=True)
        out = self.dispatch(hidden_states[order // k], torch.bincount(flat, minlength=self.experts))
        out = out.to(hidden_states.dtype) * top_k_weights.reshape(-1)[order, None].to(hidden_states.dtype)
        mixed = hidden_states.new_zeros(n * k, hidden_states.shape[-1]).index_copy(0, order, out)
        return mixed.view(n, k, -1).sum(1)


def _two_step_hint(record: logging.LogRecord) -> bool:
    """Leave out DTensor's warning that a redistribution over the experts' (edp, ep) mesh takes one collective per
    axis (the gradient norm's reduction, the final weights' gather under ZeRO 2/3): a hint about shoal's layout,
    which a user cannot act on, printed by every rank. Only for that mesh: the record does not carry it, so it is
    read from the warning's caller (torch 2.13's _warn_flatten_optimization_not_possible, whose `device_mesh` it
    is); a warning whose mesh is not found, or is another's, is kept."""
    if "sequential" not in str(record.msg):
        return True
    frame = sys._getframe(1)
    while frame is not None and "device_mesh" not in frame.f_code.co_varnames:
        frame = frame.f_back
    mesh = frame.f_locals.get("device_mesh") if frame is not None else None
    return getattr(mesh, "mesh_dim_names", None) != EXPERT_MESH


def expert_parallel(model: nn.Module, ep: int, mesh, comm: Comm, zero: int) -> tuple[dict, list]:
    """Collective: parallel.ep applied to `model` before its wrappers (ExpertLayout, over the run's `mesh`); what
    the Parallelized takes of it ({} where ep is 1, or where ZeRO 2/3's FSDP2 reduces the experts' gradients
    itself) and the units ZeRO 2/3 shards the experts as. Under DDP, DDP is told to leave the experts' weights
    alone."""
    if ep == 1:
        return {}, []
    experts = ExpertLayout(model, ep, mesh, comm)
    if zero >= 2:
        return {}, experts.units()
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, experts.names)
    return {"expert_sync": experts.sync_grads}, []
