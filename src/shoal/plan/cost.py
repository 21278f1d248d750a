"""What one micro-batch costs the model, traced on the meta device: every aten operator of its forward
and backward (FLOPs by torch's own flop counter registry, bytes read and written) and the tensors
autograd saves for backward (the activations), per block and outside blocks. The optimizer's step is
traced the same way over the whole model's parameters."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry


@dataclass
class Ops:
    """Operators as (FLOPs, bytes moved) pairs."""

    items: list[tuple[float, float]] = field(default_factory=list)

    @property
    def flops(self) -> float:
        return sum(f for f, _ in self.items)


class _Trace(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Ops()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func._overloadpacket in (torch.ops.aten.detach, torch.ops.aten.view, torch.ops.aten._unsafe_view,
                                    torch.ops.aten.t, torch.ops.aten.transpose, torch.ops.aten.expand,
                                    torch.ops.aten.permute, torch.ops.aten.alias, torch.ops.aten.unsqueeze,
                                    torch.ops.aten.squeeze, torch.ops.aten.slice, torch.ops.aten.split):
            return out  # views: no kernel runs
        count = flop_registry.get(func._overloadpacket)
        flops = float(count(*args, **kwargs, out_val=out)) if count else 0.0
        moved = sum(t.numel() * t.element_size() for t in tree_flatten((args, kwargs, out))[0]
                    if isinstance(t, torch.Tensor))
        self.ops.items.append((flops, float(moved)))
        return out


@dataclass
class MicroBatchCost:
    micro_batch: int
    ops: Ops  # forward + backward of one micro-batch
    forward_flops: float
    saved_outside: int  # activation bytes saved outside the blocks (embeddings, head, loss)
    saved_per_block: list[int]  # per block, bytes its forward saves for backward
    block_input: list[int]  # per block, bytes of its input (what checkpointing keeps)
    largest: int  # bytes of the largest tensor made (logits and their gradient are often it)

    def activation_bytes(self, checkpointing: bool, fraction: float = 1.0) -> int:
        """Saved for backward at the end of a forward; `fraction` of the blocks (a pipeline stage)."""
        n = len(self.saved_per_block)
        k = max(1, round(n * fraction)) if n else 0
        if checkpointing and n:
            # block inputs are kept; one block's saved tensors come back while it is recomputed
            return int(self.saved_outside * fraction + sum(self.block_input[:k]) + max(self.saved_per_block))
        return int(self.saved_outside * fraction + sum(self.saved_per_block[:k]))


def trace_micro_batch(bundle, batch: dict, block_types: tuple) -> MicroBatchCost:
    """Forward and backward of `batch` (meta tensors) through `bundle.model` (on meta)."""
    model = bundle.model
    params = {id(p) for p in model.parameters()}
    blocks = [m for m in model.modules() if block_types and isinstance(m, block_types)]
    saved_per_block, block_input = [0] * len(blocks), [0] * len(blocks)
    outside, seen, keep = [0], set(), []
    current = [-1]
    handles = []
    for i, b in enumerate(blocks):
        def pre(_m, args, i=i):
            current[0] = i
            block_input[i] = sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))

        def post(_m, _args, _out):
            current[0] = -1
        handles += [b.register_forward_pre_hook(pre), b.register_forward_hook(post)]

    def pack(t):
        if id(t) not in params and id(t) not in seen:
            seen.add(id(t))
            keep.append(t)  # ids stay unique while the tensor lives
            size = t.numel() * t.element_size()
            if current[0] >= 0:
                saved_per_block[current[0]] += size
            else:
                outside[0] += size
        return t

    trace = _Trace()
    try:
        with trace, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = bundle.loss_fn(model, batch).sum()
            forward_flops = trace.ops.flops
            loss.backward()
    finally:
        for h in handles:
            h.remove()
    model.zero_grad(set_to_none=True)
    largest = max((t.numel() * t.element_size() for t in keep), default=0)
    return MicroBatchCost(_batch_size(batch), trace.ops, forward_flops, outside[0], saved_per_block, block_input,
                          largest)


def _batch_size(batch: dict) -> int:
    return next(iter(batch.values())).shape[0]


def trace_optimizer_step(model: torch.nn.Module, name: str, momentum: float) -> Ops:
    """One step of the run's optimizer (torch's own, on the meta parameters with meta gradients)."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.empty_like(p)
    opt = (torch.optim.AdamW(params, lr=1e-3, foreach=False) if name == "adamw"
           else torch.optim.SGD(params, lr=1e-3, momentum=momentum, foreach=False))
    trace = _Trace()
    with trace:
        opt.step()
    for p in params:
        p.grad = None
    return trace.ops
