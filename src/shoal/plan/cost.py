"""What one micro-batch costs the model, traced on the meta device: every aten operator of its forward
and backward (FLOPs by torch's own flop counter registry, bytes read and written) and the tensors
autograd saves for backward (the activations), per block and outside blocks, each with where tensor
parallelism puts it. The optimizer's step is traced the same way over the whole model's parameters."""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from shoal.allocator import THRESHOLD
from shoal.compat import flop_formula
from shoal.plan.fusion import Flow, fused_bytes


@dataclass
class Ops:
    """Operators as (name, FLOPs, bytes moved)."""

    items: list[tuple[str, float, float]] = field(default_factory=list)
    fresh_bytes: int = 0  # outputs larger than the mmap threshold ZeRO 2/3 fix on CPU (allocator.py)
    outputs: list[int] = field(default_factory=list, repr=False)  # every output's bytes, in order
    # per matrix product, by its index in items: (batch, m, n, k) of its (batched) m x k by k x n product
    shapes: dict[int, tuple[int, int, int, int]] = field(default_factory=dict, repr=False)
    # per operator, the bytes it moves under torch.compile (fusion.fused_bytes; fusion.FUSED: folded into the
    # kernel of the run before it); empty where not traced for it (the optimizer's step)
    fused: list[float] = field(default_factory=list, repr=False)
    # an optimizer's step as torch's fused kernels run it on a GPU: the bytes they read and write, each
    # tensor once (trace_optimizer_step)
    fused_bytes: float = 0.0
    times: dict = field(default_factory=dict, repr=False, compare=False)  # predict.op_time's, once per key
    summed: tuple = field(default=(0, 0.0), repr=False, compare=False)  # (operators, their FLOPs) last summed

    @property
    def flops(self) -> float:
        """FLOPs of all the operators (summed again only when more were traced)."""
        if self.summed[0] != len(self.items):
            self.summed = (len(self.items), sum(f for _, f, _ in self.items))
        return self.summed[1]


_VIEWS = frozenset(getattr(torch.ops.aten, n) for n in (
    "detach", "view", "_unsafe_view", "t", "transpose", "expand", "permute", "alias", "unsqueeze", "squeeze",
    "slice", "split"))
_MATMULS = frozenset(getattr(torch.ops.aten, n) for n in ("mm", "addmm", "bmm", "baddbmm"))

# Where tensor parallelism puts a saved activation (Korthikanti et al. 2022, section 4.2): SPLIT between a
# column-parallel layer and the row-parallel one after it (attention's heads, the MLP's hidden units: 1/tp on
# each rank); GATHERED, a column-parallel layer's input (whole on every rank, under sequence parallelism too:
# the layer saves the sequence it gathered); WHOLE, the rest (norms' inputs, dropout masks, the residual
# stream: whole on every rank, 1/tp of the sequence under sequence parallelism).
SPLIT, GATHERED, WHOLE = 0, 1, 2


def _storage(t: torch.Tensor) -> int:
    """The identity of `t`'s memory: a view shares its base's."""
    return t.untyped_storage()._cdata


def describe_op(func, args, kwargs, out) -> tuple[str, float, float] | None:
    """(name, FLOPs by torch's flop counter registry, bytes read and written) of one aten call; None for a
    view (no kernel runs). The planner's trace and the probe's timed reference step both use it, so the
    probe's per-operator rates are keyed as the planner looks them up."""
    packet = func._overloadpacket
    if packet in _VIEWS or func.namespace == "prim":  # prim: a fake tensor's device asked, no kernel
        return None
    count = flop_formula(packet)
    flops = float(count(*args, **kwargs, out_val=out)) if count else 0.0
    moved = sum(t.numel() * t.element_size() for t in tree_flatten((args, kwargs, out))[0]
                if isinstance(t, torch.Tensor))
    return str(packet).removeprefix("aten."), flops, float(moved)


def matmul_shape(out: torch.Tensor, k: int) -> tuple[int, int, int, int]:
    """(batch, m, n, k) of a matrix product from its output (batch x) m x n and its inner dimension."""
    *batch, m, n = out.shape
    return math.prod(batch), m, n, k


class _Trace(TorchDispatchMode):
    """Every operator (Ops); while `placing`, which tensors tensor parallelism splits (_place); with `live`, the
    bytes of the tensors operators made that are alive, and their most (_Live)."""

    def __init__(self, weights: frozenset[int] = frozenset(), in_block=lambda: False, live: _Live | None = None,
                 flow: Flow | None = None):
        """`live` and `flow`: none for the optimizer's step (nothing of it is kept, nothing compiled)."""
        super().__init__()
        self.ops = Ops()
        self.weights = set(weights)  # the split parameters' storages, and their casts' (autocast's copies)
        self.casts: set[int] = set()
        self.placing = bool(weights)
        self.split, self.gathered = set(), set()  # storages
        self.in_block, self.row_parallel = in_block, 0  # row-parallel products inside the blocks
        self.live, self.flow = live, flow

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        op = describe_op(func, args, kwargs, out)
        if op is not None:
            if func._overloadpacket in _MATMULS:
                self.ops.shapes[len(self.ops.items)] = matmul_shape(out, args[-1].shape[-2])  # (.., k, n)
            self.ops.items.append(op)
            if self.flow is not None:
                self.flow.record(args, kwargs, out)
            sizes = [t.numel() * t.element_size() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            self.ops.outputs += sizes
            self.ops.fresh_bytes += sum(b for b in sizes if b > THRESHOLD)
        if func._overloadpacket is torch.ops.aten._to_copy and _storage(args[0]) in self.weights:
            self.casts.add(_storage(out))  # the weight a product under autocast takes
            self.weights.add(_storage(out))
        elif self.placing:
            self._place(func, args, kwargs, out)
        if self.live is not None:
            self.live.made(func, args, out, self)
        return out

    def _place(self, func, args, kwargs, out) -> None:
        """Megatron-LM's split (Shoeybi et al. 2019), which every tensor-parallel plan shoal runs follows: a
        matrix product with a weight splits its output where its input is whole (column-parallel) and makes
        it whole where its input is split (row-parallel: all-reduced); any other operator's output is split
        where an input is (a lookup in an embedding table gives whole rows)."""
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        acts = [t for t in inputs if _storage(t) not in self.weights]
        split = any(_storage(t) in self.split for t in acts)
        if func._overloadpacket in _MATMULS and len(acts) < len(inputs) and any(
                t.dim() >= 2 and _storage(t) in self.weights for t in inputs):
            if not split:
                self.gathered.update(_storage(t) for t in acts)
            else:
                self.row_parallel += self.in_block()
            split = not split
        if split:
            self.split.update(_storage(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))

    def forget(self, key: int) -> None:
        """A storage was freed: its identity may be given to a new one."""
        self.split.discard(key)
        self.gathered.discard(key)
        if key in self.casts:
            self.casts.discard(key)
            self.weights.discard(key)


class _Live:
    """The bytes alive of the tensors a forward and backward make, as a GPU's caching allocator holds them
    allocated: each operator's new storage from when it is made until the last tensor on it is freed (a
    weak reference to the storage). Not counted: the parameters; their copies in the autocast dtype (autocast
    keeps one per weight for the forward and its backward: the planner's buffers count them, by layout); and
    the parameters' gradients once accumulated (its model state). `most`: the largest total, the working set
    a micro-batch's forward and backward need at their worst moment (the start of backward for a language
    model: the saved activations, the fp32 log-probabilities and their gradient)."""

    def __init__(self, weights: frozenset[int]):
        self.weights = weights  # every parameter's storage
        self.copies: set[int] = set()  # storages of the parameters' casts
        self.sizes: dict[int, int] = {}  # alive storages counted, their bytes
        self.grads: set[int] = set()
        self.bytes = self.most = 0
        self.grad_bytes = self.grads_at_most = 0  # accumulated gradients' bytes: now, and when `most` was reached
        self.forgets = []  # called with a freed storage's key (the trace's and the saved tensors' sets)
        self.keeps = []  # called with each parameter's accumulated gradient (fusion.Flow.keep)

    def made(self, func, args, out, trace) -> None:
        if func._overloadpacket is torch.ops.aten._to_copy and isinstance(args[0], torch.Tensor) \
                and _storage(args[0]) in self.weights:
            self.copies.add(_storage(out))
            return
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            key = _storage(t)
            if key in self.sizes or key in self.weights or key in self.copies:
                continue
            storage = t.untyped_storage()
            self.sizes[key] = storage.nbytes()
            self.bytes += self.sizes[key]
            weakref.finalize(storage, self._freed, key)
        if self.bytes > self.most:
            self.most, self.grads_at_most = self.bytes, self.grad_bytes

    def accumulated(self, param: torch.Tensor) -> None:
        """A parameter's gradient is in .grad: model state from here on."""
        for keep in self.keeps:
            keep(param.grad)
        key = _storage(param.grad)
        if key in self.sizes and key not in self.grads:
            self.grads.add(key)
            self.bytes -= self.sizes[key]
            self.grad_bytes += self.sizes[key]

    def _freed(self, key: int) -> None:
        size = self.sizes.pop(key, 0)
        if key in self.grads:
            self.grads.discard(key)
            self.grad_bytes -= size
        else:
            self.bytes -= size
        self.copies.discard(key)
        for forget in self.forgets:
            forget(key)


class _Attention(TorchFunctionMode):
    """Attention and dropout as the run executes them.

    On the meta device scaled_dot_product_attention falls back to its math decomposition (matmuls, a
    mask, a softmax and copies, each with its own backward) where a CPU or GPU runs one fused kernel. The
    trace takes the CPU's fused kernel instead, which has a meta implementation and its own backward, so
    the operators traced are the ones a run executes and the probe times.

    `fused=False` traces attention as stacks before fused (flash) attention ran it (Megatron-LM's
    CoreAttention, 2021-2022): the s x s scores of every head materialised, scaled, masked, softmaxed and
    dropped out at `dropout` (their attention dropout; the model's own if it has one), each a
    memory-bound pass over them, and the softmax's output, the dropout's mask and its output saved for
    backward (Korthikanti et al. 2022, section 4.1: 5 a s^2 b bytes a layer in 16 bits). `hidden_dropout`
    replaces a dropout the model runs at 0 (its embeddings', after attention and after the MLP), as those
    stacks ran with 0.1 where shoal's GPT under tensor parallelism runs none.

    `native_dropout`: dropout as torch runs it on a GPU, one fused kernel that keeps a 1-byte mask for
    backward; on the CPU (and on meta) it multiplies by a noise tensor of the input's dtype, which
    backward keeps instead."""

    def __init__(self, fused: bool = True, dropout: float = 0.0, hidden_dropout: float = 0.0,
                 native_dropout: bool = False):
        super().__init__()
        self.fused, self.dropout, self.hidden_dropout = fused, dropout, hidden_dropout
        self.native_dropout = native_dropout

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout:
            given = {**dict(zip(("input", "p", "training", "inplace"), args, strict=False)), **kwargs}
            return self._dropout(given["input"], given.get("p", 0.5) or self.hidden_dropout,
                                 given.get("training", True), given.get("inplace", False))
        if func is F.scaled_dot_product_attention and _traced(args[0]):
            q, k, v, *rest = args
            if torch.is_autocast_enabled("cpu"):  # what autocast does at the call this replaces
                q, k, v = (t.to(torch.get_autocast_dtype("cpu")) for t in (q, k, v))
            names = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
            given = {**dict(zip(names, rest, strict=False)), **kwargs}
            if given.pop("enable_gqa", False) and k.shape[-3] != q.shape[-3]:
                k, v = _repeat_heads(k, q.shape[-3]), _repeat_heads(v, q.shape[-3])
            if not self.fused:
                return self._materialised(q, k, v, given.get("attn_mask"), given.get("dropout_p") or self.dropout,
                                          given.get("is_causal", False), given.get("scale"))
            if q.shape[-1] == v.shape[-1]:
                return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    q, k, v, given.get("dropout_p", 0.0), given.get("is_causal", False),
                    attn_mask=given.get("attn_mask"), scale=given.get("scale"))[0]
            return func(q, k, v, **given)
        return func(*args, **kwargs)

    def _dropout(self, x: torch.Tensor, p: float, training: bool, inplace: bool = False) -> torch.Tensor:
        if not training or not p:
            return x
        if self.native_dropout:
            return torch.native_dropout(x, p, True)[0]
        return F.dropout(x, p, True, inplace)

    def _materialised(self, q, k, v, attn_mask, dropout: float, is_causal: bool, scale) -> torch.Tensor:
        scale = scale if scale is not None else q.shape[-1] ** -0.5
        scores = (q * scale) @ k.transpose(-2, -1)
        if is_causal:  # an additive mask: its sum saves nothing for backward (a masked_fill keeps its mask)
            scores = scores + torch.full(scores.shape[-2:], float("-inf"), device=q.device).triu(1)
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
                else scores + attn_mask
        return self._dropout(torch.softmax(scores, -1), dropout, True) @ v


def _traced(t: torch.Tensor) -> bool:
    """A tensor of the planner's trace (meta, or fake under autocast), not of a run."""
    from torch._subclasses.fake_tensor import FakeTensor

    return t.device.type == "meta" or isinstance(t, FakeTensor)


def _repeat_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query attention's keys or values (B, kv heads, T, d) as (B, heads, T, d), each serving heads / kv
    heads query heads in turn (transformers' repeat_kv; Llama 3 8B: 8 for 32). A GPU's fused kernel reads them
    shared (`enable_gqa`); the trace's kernel takes as many as the query has, and so counts a copy of each and
    B T d (heads - kv heads) saved elements a layer more than the run (6% of what a Llama 3 8B layer saves)."""
    b, kv, n, d = t.shape
    return t[:, :, None].expand(b, kv, heads // kv, n, d).reshape(b, heads, n, d)


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
    # per saved tensor: its block (-1: outside), where tensor parallelism puts it (SPLIT, GATHERED, WHOLE) and
    # whether it is floating point (a 16-bit run halves it; a dropout's mask and indices keep their bytes)
    saved_kinds: list[tuple[int, int, bool]] = field(default_factory=list, repr=False)
    # row-parallel products in the blocks' forward: each all-reduces its output, again where checkpointing
    # recomputes the forward
    row_parallel: int = 0
    # the most a forward and backward hold at once beyond what the forward saves (activations' gradients,
    # the loss's working tensors, what an operator makes before it frees its inputs; _Live), not counting the
    # parameters, their autocast copies and their accumulated gradients
    working: int = 0
    # of the gradients a backward accumulates, the fraction that exists when the working set peaks (0 where
    # it peaks at the start of backward: a step's first backward starts without gradients)
    grads_at_peak: float = 1.0
    memo: dict = field(default_factory=dict, repr=False, compare=False)  # on_rank's, per its arguments

    def activation_bytes(self, checkpointing: bool, fraction: float = 1.0, in_flight: float = 1, *,
                         scale: float = 1.0, tp: int = 1, sequence_parallel: bool = False,
                         recomputed: bool = True) -> int:
        """Saved for backward at the end of a forward on one tensor-parallel rank of `tp`, with `in_flight`
        micro-batches' forwards waiting for their backward (a pipeline); `fraction` of the blocks (a
        pipeline stage); floating tensors at `scale` of the traced bytes. Under checkpointing, with the
        saved tensors of the block being recomputed (`recomputed`) or without (they come back after the
        backward's start, the working set's peak: recomputed_block)."""
        outside, per_block, inputs = self.on_rank(scale, tp, sequence_parallel)
        n = len(per_block)
        k = max(1, round(n * fraction)) if n else 0
        if checkpointing and n:
            # block inputs are kept; one block's saved tensors come back while it is recomputed, in the one
            # micro-batch whose backward runs
            return int(in_flight * (outside * fraction + sum(inputs[:k])) + recomputed * max(per_block))
        return int(in_flight * (outside * fraction + sum(per_block[:k])))

    def working_on_rank(self, tp: int) -> int:
        """The working set on one tp rank: a tp-th where the loss is split over the vocabulary (shoal's GPT:
        its largest saved tensor outside the blocks, the log-probabilities, is split), whole where every
        rank takes the whole loss (a Hugging Face model's head is whole on every tp rank)."""
        outside = [(n, where) for (block, where, _), n in zip(self.saved_kinds, self.saved, strict=True) if block < 0]
        split = bool(outside) and max(outside)[1] == SPLIT
        return self.working // tp if split else self.working

    def recomputed_block(self, tp: int = 1, sequence_parallel: bool = False) -> int:
        """The most one block's recomputed forward saves (checkpointing)."""
        return int(max(self.on_rank(1.0, tp, sequence_parallel)[1], default=0))

    def on_rank(self, scale: float, tp: int, sequence_parallel: bool) -> tuple[float, list[float], list[float]]:
        """(outside the blocks, per block, per block input) on one rank: SPLIT tensors 1/tp of the traced,
        GATHERED whole, WHOLE whole or (sequence parallelism) 1/tp; a block's input is the residual stream."""
        key = (scale, tp, sequence_parallel)
        if key not in self.memo:
            whole = 1 / tp if sequence_parallel else 1.0
            share = {SPLIT: 1 / tp, GATHERED: 1.0, WHOLE: whole}
            outside, per_block = 0.0, [0.0] * len(self.saved_per_block)
            if not self.saved_kinds:  # not traced with placements: every tensor taken as whole
                outside, per_block = float(self.saved_outside), [float(b) for b in self.saved_per_block]
            for (block, where, floating), nbytes in zip(self.saved_kinds, self.saved, strict=True):
                b = nbytes * (scale if floating else 1.0) * share[where]
                if block >= 0:
                    per_block[block] += b
                else:
                    outside += b
            self.memo[key] = (outside, per_block, [x * scale * whole for x in self.block_input])
        return self.memo[key]


class _Saved:
    """What autograd saves in a forward, by the block running (-1: outside every block), each block's
    input, and per saved tensor its bytes, its block, where tensor parallelism puts it and whether it is
    floating point (taken when it is saved: the trace has placed it by then)."""

    def __init__(self, weights: frozenset[int], blocks: list, trace: _Trace):
        self.weights, self.current, self.trace = weights, -1, trace
        self.per_block, self.block_input = [0] * len(blocks), [0] * len(blocks)
        self.outside, self.seen, self.sizes, self.kinds, self.pending = 0, set(), [], [], {}
        self.handles = []
        for i, b in enumerate(blocks):
            self.handles += [b.register_forward_pre_hook(partial(self._enter, i)),
                             b.register_forward_hook(self._leave)]

    def _enter(self, i: int, _module, args) -> None:
        self.current = i
        self.block_input[i] = sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))

    def _leave(self, _module, _args, _out) -> None:
        self.current = -1

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        # memory is counted once however many views of it are saved (q, k and v's layers each save their
        # input, one tensor), and a parameter's view (a linear layer saves its weight transposed) or its cast
        # to the autocast dtype is the parameter's: not an activation
        key = _storage(t)
        if key not in self.weights and key not in self.seen and key not in self.trace.live.copies:
            self.seen.add(key)
            nbytes = t.untyped_storage().nbytes()
            # where tp puts it is known once the operator that saves it has run (autograd saves an
            # operator's inputs before it runs): taken when its storage is freed, or at the end
            self.pending.setdefault(key, []).append(len(self.kinds))
            self.trace.flow.keep(t)
            self.sizes.append(nbytes)
            self.kinds.append((self.current, key, t.is_floating_point()))
            if self.current >= 0:
                self.per_block[self.current] += nbytes
            else:
                self.outside += nbytes
        return t

    def forget(self, key: int) -> None:
        self.seen.discard(key)
        self.place(key)

    def place_all(self) -> None:
        for key in list(self.pending):
            self.place(key)

    def place(self, key: int) -> None:
        """The saved tensors of storage `key`: their (block, where tp puts them, floating)."""
        where = SPLIT if key in self.trace.split else GATHERED if key in self.trace.gathered else WHOLE
        for i in self.pending.pop(key, ()):
            block, _, floating = self.kinds[i]
            self.kinds[i] = (block, where, floating)


def trace_micro_batch(bundle, batch: dict, block_types: tuple, fused_attention: bool = True,
                      attention_dropout: float = 0.0, hidden_dropout: float = 0.0,
                      native_dropout: bool = False, tp_split: list | None = None,
                      autocast: torch.dtype | None = None) -> MicroBatchCost:
    """Forward and backward of `batch` (meta tensors) through `bundle.model` (on meta); attention fused
    (flash) or materialised with its dropout, and dropout as a GPU or a CPU runs it (_Attention).
    `tp_split`: the parameters tensor parallelism splits, by the model's plan (tp_plan.split_parameters: a
    Hugging Face model's embeddings and output head are whole, and so are its logits on every tp rank; shoal's
    GPT splits its vocabulary, and so its logits); None: every parameter, the Megatron-LM split of
    _Trace._place. `autocast`: as a run in that dtype computes it (_autocast: every tensor in the dtype
    autocast gives it)."""
    model = bundle.model
    with _autocast(model, batch, autocast) as (params, batch):
        weights = frozenset(_storage(p) for p in params.values())
        split = weights if tp_split is None else frozenset(_storage(params[id(p)]) for p in tp_split)
        live, flow = _Live(weights), Flow()
        trace = _Trace(split, lambda: saved.current >= 0, live, flow)
        saved = _Saved(weights, [m for m in model.modules() if block_types and isinstance(m, block_types)], trace)
        live.forgets += [saved.forget, trace.forget, flow.forget]  # placed before the trace forgets the storage
        live.keeps.append(flow.keep)
        hooks = [p.register_post_accumulate_grad_hook(live.accumulated) for p in params.values() if p.requires_grad]
        try:
            with _Attention(fused_attention, attention_dropout, hidden_dropout, native_dropout), trace, \
                    torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                loss = bundle.loss_fn(model, batch).sum()
                forward_flops = trace.ops.flops
                flow.barrier()
                trace.placing = False  # backward's tensors are not saved for anything
                loss.backward()
                del loss
        finally:
            for h in saved.handles + hooks:
                h.remove()
        saved.place_all()
        trace.ops.fused = fused_bytes(trace.ops.items, flow)
        grads = live.grad_bytes
        for p in params.values():
            p.grad = None
    sizes = saved.sizes
    return MicroBatchCost(_batch_size(batch), trace.ops, forward_flops, saved.outside, saved.per_block,
                          saved.block_input, max(sizes, default=0), sizes, saved.kinds, trace.row_parallel,
                          working=max(live.most - sum(sizes), 0),
                          grads_at_peak=live.grads_at_most / grads if grads else 1.0)


@contextlib.contextmanager
def _autocast(model: torch.nn.Module, batch: dict, dtype: torch.dtype | None):
    """({id(parameter): the tensor the trace runs it as}, the batch): the meta model as it is; with `dtype`,
    the model run on fake CPU tensors (FakeTensorMode: shapes and dtypes, no data) under CPU autocast to
    `dtype`, which gives each tensor the dtype a GPU's autocast gives it in the models shoal plans: matrix
    products and attention in `dtype`; the loss's softmax upcast to fp32; a residual stream that an fp32
    embedding starts stays fp32, and so do the norms over it (GPU autocast runs layer_norm and softmax in fp32
    where their input is 16-bit; CPU autocast keeps the input's dtype: the planner's models never give them
    one). Autocast itself runs only on a device's tensors, never on meta; CUDA's cannot run without CUDA."""
    if dtype is None:
        yield {id(p): p for p in model.parameters()}, batch
        return
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.utils.stateless import _reparametrize_module

    mode = FakeTensorMode()
    cpu = torch.device("cpu")

    def fake(t: torch.Tensor) -> torch.Tensor:
        return mode.fake_tensor_converter.from_meta_and_device(mode, t.detach(), cpu).requires_grad_(t.requires_grad)

    made: dict[int, torch.Tensor] = {}  # tied tensors stay one
    named = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    for t in named.values():
        if id(t) not in made:
            made[id(t)] = fake(t)
    params = {id(p): made[id(p)] for p in model.parameters()}
    batch = {k: fake(v) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    with mode, _reparametrize_module(model, {n: made[id(t)] for n, t in named.items()}, tie_weights=True), \
            torch.autocast("cpu", dtype=dtype):
        yield params, batch


def affine(traced: list[MicroBatchCost]) -> Callable[[int], MicroBatchCost] | None:
    """Costs at any micro-batch size from three traced ones, where every number the traces hold (each
    operator's FLOPs and bytes, each output's and saved tensor's bytes, the per-block figures) is the same
    affine function of the micro-batch size in all three and the operators are the same ones in the same
    order: a model whose every tensor either holds the batch or does not (a GPT's do). The thresholded
    sums (freshly mapped bytes, the largest tensor) are taken again from the interpolated sizes, and the
    saved tensors' blocks and placements are the same in all three, so the result is what a trace at that
    size gives. None where any number is not affine: trace each size."""
    a, b, c = sorted(traced[:3], key=lambda t: t.micro_batch)
    same = [([n for n, *_ in t.ops.items], sorted(t.ops.shapes), t.saved_kinds, t.row_parallel, t.grads_at_peak)
            for t in (a, b, c)]
    if len({a.micro_batch, b.micro_batch, c.micro_batch}) < 3 or not same[0] == same[1] == same[2]:
        return None
    ma, mb, mc = a.micro_batch, b.micro_batch, c.micro_batch

    na, nb, nc = _numbers(a), _numbers(b), _numbers(c)
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
        k += 2 * n_blocks
        shapes = {i: tuple(int(x) for x in v[k + 4 * j:k + 4 * j + 4]) for j, i in enumerate(sorted(a.ops.shapes))}
        k += 4 * len(shapes)
        fused = v[k:k + len(a.ops.fused)]
        working, forward_flops, outside = int(v[-3]), v[-2], int(v[-1])
        ops = Ops(items, sum(b for b in outputs if b > THRESHOLD), outputs, shapes, fused)
        return MicroBatchCost(m, ops, forward_flops, outside, per_block, inputs, max(saved, default=0), saved,
                              list(a.saved_kinds), a.row_parallel, working, a.grads_at_peak)

    return at


def _numbers(t: MicroBatchCost) -> list[float]:
    """Every figure of a trace that cost.affine interpolates, in the order `at` reads them back."""
    return [v for _, f, m in t.ops.items for v in (f, m)] + [
        *t.ops.outputs, *t.saved, *t.saved_per_block, *t.block_input,
        *(x for i in sorted(t.ops.shapes) for x in t.ops.shapes[i]), *t.ops.fused, t.working, t.forward_flops,
        t.saved_outside]


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
    # fused AdamW reads a parameter, its gradient and two moments and writes three; SGD the parameter, the
    # gradient and its momentum buffer, writing two (one without momentum); the clip reads the gradients for
    # their norm, then scales them in place
    per_element = {"adamw": 7}.get(name, 5 if momentum else 3) + (3 if clip else 0)
    trace.ops.fused_bytes = float(sum(p.numel() * p.element_size() for p in params) * per_element)
    return trace.ops
