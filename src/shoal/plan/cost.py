"""What one micro-batch costs the model, traced on the meta device: every aten operator of its forward
and backward (FLOPs by torch's own flop counter registry, bytes read and written) and the tensors
autograd saves for backward (the activations), per block and outside blocks. The optimizer's step is
traced the same way over the whole model's parameters."""

from __future__ import annotations

from collections.abc import Callable
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
    outputs: list[int] = field(default_factory=list, repr=False)  # every output's bytes, in order
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
            sizes = [t.numel() * t.element_size() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            self.ops.outputs += sizes
            self.ops.fresh_bytes += sum(b for b in sizes if b > THRESHOLD)
        return out


class _Attention(TorchFunctionMode):
    """On the meta device scaled_dot_product_attention falls back to its math decomposition (matmuls, a
    mask, a softmax and copies, each with its own backward) where a CPU or GPU runs one fused kernel. The
    trace takes the CPU's fused kernel instead, which has a meta implementation and its own backward, so
    the operators traced are the ones a run executes and the probe times.

    `fused=False` traces attention as stacks before fused (flash) attention ran it (Megatron-LM and
    DeepSpeed in 2021-2022): the s x s scores of every head materialised, scaled, masked, softmaxed and
    dropped out at `dropout` (their attention dropout; the model's own if it has one), each a
    memory-bound pass over them, and the softmax's output and the dropout's mask saved for backward
    (Korthikanti et al. 2022, section 4.1: 5 a s^2 b bytes a layer in 16 bits)."""

    def __init__(self, fused: bool = True, dropout: float = 0.0):
        super().__init__()
        self.fused, self.dropout = fused, dropout

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and not kwargs.get("enable_gqa"):
            q, k, v, *rest = args
            names = ("attn_mask", "dropout_p", "is_causal", "scale")
            given = {**dict(zip(names, rest, strict=False)), **kwargs}
            if q.device.type == "meta" and not self.fused:
                return torch.ops.aten._scaled_dot_product_attention_math(
                    q, k, v, given.get("attn_mask"), given.get("dropout_p") or self.dropout,
                    given.get("is_causal", False), scale=given.get("scale"))[0]
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
    saved: list[int] = field(default_factory=list, repr=False)  # every tensor saved for backward, its bytes

    def activation_bytes(self, checkpointing: bool, fraction: float = 1.0, in_flight: int = 1) -> int:
        """Saved for backward at the end of a forward, with `in_flight` micro-batches' forwards waiting for
        their backward (a pipeline); `fraction` of the blocks (a pipeline stage)."""
        n = len(self.saved_per_block)
        k = max(1, round(n * fraction)) if n else 0
        if checkpointing and n:
            # block inputs are kept; one block's saved tensors come back while it is recomputed, in the one
            # micro-batch whose backward runs
            return int(in_flight * (self.saved_outside * fraction + sum(self.block_input[:k]))
                       + max(self.saved_per_block))
        return int(in_flight * (self.saved_outside * fraction + sum(self.saved_per_block[:k])))


def trace_micro_batch(bundle, batch: dict, block_types: tuple, fused_attention: bool = True,
                      attention_dropout: float = 0.0) -> MicroBatchCost:
    """Forward and backward of `batch` (meta tensors) through `bundle.model` (on meta); attention fused
    (flash) or materialised with its dropout (_Attention)."""
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
        # a parameter's view (a linear layer saves its weight transposed) is the parameter: not an activation
        base = t._base if t._base is not None else t
        if id(base) not in params and id(t) not in seen:
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
        with _Attention(fused_attention, attention_dropout), trace, \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = bundle.loss_fn(model, batch).sum()
            forward_flops = trace.ops.flops
            loss.backward()
    finally:
        for h in handles:
            h.remove()
    model.zero_grad(set_to_none=True)
    saved = [t.numel() * t.element_size() for t in keep]
    return MicroBatchCost(_batch_size(batch), trace.ops, forward_flops, outside[0], saved_per_block, block_input,
                          max(saved, default=0), saved)


def affine(traced: list[MicroBatchCost]) -> Callable[[int], MicroBatchCost] | None:
    """Costs at any micro-batch size from three traced ones, where every number the traces hold (each
    operator's FLOPs and bytes, each output's and saved tensor's bytes, the per-block figures) is the same
    affine function of the micro-batch size in all three and the operators are the same ones in the same
    order: a model whose every tensor either holds the batch or does not (a GPT's do). The thresholded
    sums (freshly mapped bytes, the largest tensor) are taken again from the interpolated sizes, so the
    result is what a trace at that size gives. None where any number is not affine: trace each size."""
    a, b, c = sorted(traced[:3], key=lambda t: t.micro_batch)
    if len({a.micro_batch, b.micro_batch, c.micro_batch}) < 3 or [n for n, *_ in a.ops.items] != \
            [n for n, *_ in b.ops.items] or [n for n, *_ in a.ops.items] != [n for n, *_ in c.ops.items]:
        return None
    ma, mb, mc = a.micro_batch, b.micro_batch, c.micro_batch

    def numbers(t: MicroBatchCost) -> list[float]:
        return [v for _, f, m in t.ops.items for v in (f, m)] + [
            *t.ops.outputs, *t.saved, *t.saved_per_block, *t.block_input, t.forward_flops, t.saved_outside]

    na, nb, nc = numbers(a), numbers(b), numbers(c)
    if not len(na) == len(nb) == len(nc) or any((z - x) * (mb - ma) != (y - x) * (mc - ma)
                                                 for x, y, z in zip(na, nb, nc, strict=True)):
        return None
    if any((y - x) % (mb - ma) for x, y in zip(na, nb, strict=True)):  # a slope that is not whole: not exact
        return None
    slopes = [(y - x) // (mb - ma) for x, y in zip(na, nb, strict=True)]

    def at(m: int) -> MicroBatchCost:
        v = [x + s * (m - ma) for x, s in zip(na, slopes, strict=True)]
        n_ops, n_out, n_saved, n_blocks = len(a.ops.items), len(a.ops.outputs), len(a.saved), len(a.saved_per_block)
        items = [(name, v[2 * i], v[2 * i + 1]) for i, (name, *_) in enumerate(a.ops.items)]
        k = 2 * n_ops
        outputs = [int(x) for x in v[k:k + n_out]]
        saved = [int(x) for x in v[k + n_out:k + n_out + n_saved]]
        k += n_out + n_saved
        per_block, inputs = [int(x) for x in v[k:k + n_blocks]], [int(x) for x in v[k + n_blocks:k + 2 * n_blocks]]
        forward_flops, outside = v[-2], int(v[-1])
        ops = Ops(items, sum(b for b in outputs if b > THRESHOLD), outputs)
        return MicroBatchCost(m, ops, forward_flops, outside, per_block, inputs, max(saved, default=0), saved)

    return at


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
