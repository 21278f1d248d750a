"""What one micro-batch costs the model, traced on the meta device: every aten operator of its forward
and backward (FLOPs by torch's own flop counter registry, bytes read and written) and the tensors
autograd saves for backward (the activations), per block and outside blocks. The optimizer's step is
traced the same way over the whole model's parameters."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from shoal.allocator import THRESHOLD


@dataclass
class Ops:
    """Operators as (name, FLOPs, bytes moved)."""

    items: list[tuple[str, float, float]] = field(default_factory=list)
    fresh_bytes: int = 0  # outputs larger than the mmap threshold ZeRO 2/3 fix on CPU (allocator.py)
    times: dict = field(default_factory=dict, repr=False, compare=False)  # predict.op_time's, once per key

    @property
    def flops(self) -> float:
        return sum(f for _, f, _ in self.items)


_VIEWS = frozenset(getattr(torch.ops.aten, n) for n in (
    "detach", "view", "_unsafe_view", "t", "transpose", "expand", "permute", "alias", "unsqueeze", "squeeze",
    "slice", "split"))


def describe_op(func, args, kwargs, out) -> tuple[str, float, float] | None:
    """(name, FLOPs by torch's flop counter registry, bytes read and written) of one aten call; None for a
    view (no kernel runs). The planner's trace and the probe's timed reference step both use it, so the
    probe's per-operator rates are keyed as the planner looks them up."""
    packet = func._overloadpacket
    if packet in _VIEWS:
        return None
    count = flop_registry.get(packet)
    flops = float(count(*args, **kwargs, out_val=out)) if count else 0.0
    moved = sum(t.numel() * t.element_size() for t in tree_flatten((args, kwargs, out))[0]
                if isinstance(t, torch.Tensor))
    return str(packet).removeprefix("aten."), flops, float(moved)


class _Trace(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Ops()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        op = describe_op(func, args, kwargs, out)
        if op is not None:
            self.ops.items.append(op)
            self.ops.fresh_bytes += sum(t.numel() * t.element_size() for t in tree_flatten(out)[0]
                                        if isinstance(t, torch.Tensor) and t.numel() * t.element_size() > THRESHOLD)
        return out


class _FusedAttention(TorchFunctionMode):
    """On the meta device scaled_dot_product_attention falls back to its math decomposition (matmuls, a
    mask, a softmax and copies, each with its own backward) where a CPU or GPU runs one fused kernel. The
    trace takes the CPU's fused kernel instead, which has a meta implementation and its own backward, so
    the operators traced are the ones a run executes and the probe times."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and not kwargs.get("enable_gqa"):
            q, k, v, *rest = args
            names = ("attn_mask", "dropout_p", "is_causal", "scale")
            given = {**dict(zip(names, rest, strict=False)), **kwargs}
            if q.device.type == "meta" and q.shape[-1] == v.shape[-1]:
                return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    q, k, v, given.get("dropout_p", 0.0), given.get("is_causal", False),
                    attn_mask=given.get("attn_mask"), scale=given.get("scale"))[0]
        return func(*args, **kwargs)


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
        with _FusedAttention(), trace, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
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


def trace_optimizer_step(model: torch.nn.Module, name: str, momentum: float, clip: bool) -> Ops:
    """The gradient clipping (`clip`) and one step of the run's optimizer (torch's own, on the meta
    parameters with meta gradients): the second step, as every step after the first (which also makes
    the state) runs. On meta, torch picks the per-tensor kernels a CPU run uses (no foreach)."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.empty_like(p)
    opt = (torch.optim.AdamW(params, lr=1e-3, foreach=False) if name == "adamw"
           else torch.optim.SGD(params, lr=1e-3, momentum=momentum, foreach=False))
    opt.step()
    trace = _Trace()
    with trace:
        if clip:  # as parallel/clip.py clips
            grads = [p.grad for p in params]
            torch.nn.utils.clip_grads_with_norm_(params, 1.0, torch.nn.utils.get_total_norm(grads))
        opt.step()
    for p in params:
        p.grad = None
    return trace.ops
