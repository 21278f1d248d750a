"""Context parallelism (parallel.cp): each sequence split over the cp ranks of a group, so that a rank holds the
activations of 1 / cp of it, and attention, the one layer that mixes positions, computed over the whole sequence.

The split is head-tail (torchtitan's load balancing, Megatron's "zigzag"): the sequence cut into 2 cp chunks, rank
r holding chunk r and chunk 2 cp - 1 - r, so that under the causal mask every rank attends to as many keys as the
others. The ranks of a group train on the same sequences (the data-parallel batch is split over dp / cp groups),
each on its own tokens' positions: its loss is over its tokens, and its gradients are reduced over every dp rank
as data parallelism's are, so ZeRO 2/3 shards over dp x cp as torchtitan does.

Attention (GatheredAttention, standing in for F.scaled_dot_product_attention inside the forward): the group's
keys and values are all-gathered (Llama 3's context parallelism; the volume of a ring's, in one collective), and
each of the rank's two query chunks attends to the chunks before its own in full and to its own under the causal
mask, two blocks whose results are merged by their log-sum-exps (the online softmax). Only the rank's own keys and
values are kept for backward: the backward gathers them again, computes each block's gradients from the merged
output and log-sum-exp (flash attention's backward), and returns the keys' and values' gradients to the ranks
that hold them by a reduce-scatter. On a CPU the blocks are the CPU's fused attention kernel
(aten._scaled_dot_product_flash_attention_for_cpu and its backward), which torch's own context parallelism does
not cover (it replaces CUDA's flash, efficient and cuDNN kernels); elsewhere the same blocks in plain torch ops.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from shoal.comm.collectives import Comm
from shoal.errors import UserError
from shoal.models.documents import packed_positions, raise_unseen, visible

# the devices whose fused attention kernel (with its log-sum-exp and its backward) computes the blocks; elsewhere
# plain torch ops, which hold a block's scores
FUSED = frozenset({"cpu"})


def head_tail(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The positions cp rank `rank` holds of a sequence of `seq_len`: chunk `rank` and chunk 2 cp - 1 - rank of
    2 cp equal chunks."""
    c = seq_len // (2 * cp)
    first, last = rank * c, (2 * cp - 1 - rank) * c
    return torch.cat([torch.arange(first, first + c, device=device), torch.arange(last, last + c, device=device)])


class ContextParallel:
    """A rank's part of parallel.cp: its group (`group`, `cp` ranks, this one `rank` of them)."""

    def __init__(self, comm: Comm, group, cp: int, rank: int):
        self.comm, self.group, self.cp, self.rank = comm, group, cp, rank

    def shard(self, batch: dict) -> dict:
        """This rank's positions of every sequence of `batch` ("input", "target" (B, T)), and the positions
        themselves ("positions", for the model's position embedding or rotary angles: (t,), or (B, t) of a packed
        batch's, each token's place in its document)."""
        pos = head_tail(batch["input"].shape[1], self.cp, self.rank, batch["input"].device)
        out = {k: (v[:, pos] if k in ("input", "target", "positions") else v) for k, v in batch.items()}
        out.setdefault("positions", pos)
        return out

    def attention(self, batch: dict) -> contextlib.AbstractContextManager:
        """Inside it, F.scaled_dot_product_attention (shoal's GPT's, transformers' "sdpa") attends over the whole
        sequence the group holds; over a packed batch (`batch`, as shard gave it), inside each document."""
        positions = packed_positions(batch)
        return _Attention(self, None if positions is None else _Masks(positions))


class _Attention(TorchFunctionMode):
    def __init__(self, cp: ContextParallel, masks: _Masks | None):
        super().__init__()
        self.cp, self.masks, self.calls = cp, masks, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        self.calls += 1
        return gathered_attention(self.cp, self.masks, *args, **kwargs)

    def __exit__(self, kind, value, traceback):
        out = super().__exit__(kind, value, traceback)
        if kind is None and self.calls == 0:
            raise_unseen(f"parallel.cp = {self.cp.cp}", "parallel.cp = 1")
        return out


def gathered_attention(cp: ContextParallel, masks: _Masks | None, q, k, v, attn_mask=None,
                       dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                       enable_gqa: bool = False) -> torch.Tensor:
    """`masks`: a packed batch's, which keep each query inside its document."""
    if attn_mask is not None or not is_causal or dropout_p:
        has = "a mask" if attn_mask is not None else "dropout" if dropout_p else "no causal mask"
        raise UserError(f"parallel.cp = {cp.cp} replaces causal attention without a mask or dropout; this model's "
                        f"attention has {has}; set parallel.cp = 1 (or its attention dropout to 0)")
    if enable_gqa and k.shape[1] != q.shape[1]:  # grouped-query attention: each key head serves several queries
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return GatheredAttention.apply(q, k, v, cp, scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]),
                                   masks)


class GatheredAttention(torch.autograd.Function):
    """Causal attention of this rank's queries (B, H, t, D: its two chunks) over the group's whole sequence, block
    by block: each query chunk over each key chunk up to its own (its own under the causal mask), the blocks merged
    as they come. Its output is laid out as F.scaled_dot_product_attention's (B, t, H, D in memory), so that the
    model's usual transpose back is a view."""

    @staticmethod
    def forward(ctx, q, k, v, cp: ContextParallel, scale: float, masks: _Masks | None):
        gathered = _Gathered(cp, k, v)
        B, H, t, D = q.shape
        c = t // 2
        out = q.new_empty(B, t, H, D).transpose(1, 2)
        lse = q.new_empty(B, H, t, dtype=torch.float32)
        for i, g in enumerate(_chunks(cp)):
            rows = slice(i * c, (i + 1) * c)
            merged = _block(q[:, :, rows], *gathered.chunk(g), True, scale, _mask(masks, rows, g, g))
            for j in range(g):  # the chunks before: every key (of the query's document, when packed)
                merged = _merge(merged, _block(q[:, :, rows], *gathered.chunk(j), False, scale,
                                               _mask(masks, rows, g, j)))
            out[:, :, rows], lse[:, :, rows] = merged
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp, ctx.scale, ctx.masks = cp, scale, masks
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        cp, scale, masks = ctx.cp, ctx.scale, ctx.masks
        gathered = _Gathered(cp, k, v)
        c = q.shape[2] // 2
        dq = torch.zeros_like(q)
        sums = torch.zeros_like(gathered.parts)  # every rank's keys' and values' gradients, as gathered
        for i, g in enumerate(_chunks(cp)):
            rows = slice(i * c, (i + 1) * c)
            saved = (grad[:, :, rows].contiguous(), q[:, :, rows], out[:, :, rows], lse[:, :, rows])
            for j in range(g + 1):
                dqi, dkj, dvj = _block_backward(saved, *gathered.chunk(j), j == g, scale, _mask(masks, rows, g, j))
                dq[:, :, rows] += dqi
                owner, half = _owner(cp, j)
                sums[owner, 0, :, :, half] += dkj
                sums[owner, 1, :, :, half] += dvj
        B, H, t, D = k.shape
        mine = sums.new_empty(2, B, H, t, D)  # this rank's two chunks, summed over the ranks
        cp.comm.reduce_scatter(mine.view(-1), sums.view(-1), cp.group, label="cp")
        return dq, mine[0], mine[1], None, None, None


class _Masks:
    """A packed batch's block masks (B, 1, c, c), which keys of global chunk j the queries of chunk g (this rank's
    `rows`) see: those of their own documents. Each made once per micro-batch, for every layer and the backward."""

    def __init__(self, positions: torch.Tensor):
        self.positions, self.made = positions, {}

    def block(self, rows: slice, g: int, j: int) -> _BlockMask:
        if (g, j) not in self.made:
            c = rows.stop - rows.start
            index = torch.arange(c, device=self.positions.device)
            self.made[g, j] = _BlockMask(visible(index + g * c, self.positions[:, rows], index + j * c))
        return self.made[g, j]


class _BlockMask:
    def __init__(self, seen: torch.Tensor):
        self.seen, self._added = seen, {}

    def added(self, dtype: torch.dtype) -> torch.Tensor:
        """As the CPU kernel takes it: added to the scores, in the queries' dtype."""
        if dtype not in self._added:
            self._added[dtype] = torch.zeros(self.seen.shape, dtype=dtype, device=self.seen.device).masked_fill(
                ~self.seen, float("-inf"))
        return self._added[dtype]


def _mask(masks: _Masks | None, rows: slice, g: int, j: int) -> _BlockMask | None:
    """Block (g, j)'s mask of a packed batch; None when the batch is not packed (the block's causal flag says it)."""
    return None if masks is None else masks.block(rows, g, j)


def _chunks(cp: ContextParallel) -> tuple[int, int]:
    """The global chunk indices of this rank's two query chunks (head_tail)."""
    return cp.rank, 2 * cp.cp - 1 - cp.rank


def _owner(cp: ContextParallel, chunk: int) -> tuple[int, int]:
    """The rank that holds global chunk `chunk`, and which of its two it is (0: head, 1: tail)."""
    return (chunk, 0) if chunk < cp.cp else (2 * cp.cp - 1 - chunk, 1)


class _Gathered:
    """The group's keys and values, all-gathered as each rank holds them: (rank, [keys, values], B, H, [head,
    tail], c, D); a chunk of the sequence is a view of it, nothing reordered."""

    def __init__(self, cp: ContextParallel, k: torch.Tensor, v: torch.Tensor):
        B, H, t, D = k.shape
        flat = cp.comm.all_gather_flat(torch.stack([k, v]).view(-1), cp.group, label="cp")
        self.cp, self.parts = cp, flat.view(cp.cp, 2, B, H, 2, t // 2, D)

    def chunk(self, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Global chunk `g`'s keys and values (B, H, c, D)."""
        owner, half = _owner(self.cp, g)
        return self.parts[owner, 0, :, :, half], self.parts[owner, 1, :, :, half]


def _merge(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]):
    """Two blocks' attention over disjoint keys as one: each output weighted by its share of the softmax's
    denominator, from the log-sum-exps (the online softmax)."""
    (out_a, lse_a), (out_b, lse_b) = a, b
    lse = torch.logaddexp(lse_a, lse_b)
    out = out_a * torch.exp(lse_a - lse).unsqueeze(-1).to(out_a.dtype) \
        + out_b * torch.exp(lse_b - lse).unsqueeze(-1).to(out_b.dtype)
    return out, lse


def _block(q, k, v, causal: bool, scale: float, mask: _BlockMask | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over k, v (causal: the square block on the diagonal; `mask`: which keys each query sees,
    instead); its output and log-sum-exp (B, H, t). A query that sees no key of the block (a packed document that
    begins after the block) has output 0 and log-sum-exp -inf: it adds nothing to the merge."""
    if q.device.type in FUSED:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal and mask is None, attn_mask=None if mask is None else mask.added(q.dtype), scale=scale)
        lse = lse.float()
        # the kernel gives such a query output 0 and log-sum-exp 0
        return out, (lse if mask is None else lse.masked_fill(~mask.seen.any(-1), float("-inf")))
    s = _scores(q, k, causal, scale, mask)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.unsqueeze(-1))
    if mask is not None:
        p = p.nan_to_num(0.0)  # a query that sees no key: -inf - -inf
    return (p @ v.float()).to(q.dtype), lse


def _block_backward(saved: tuple, k, v, causal: bool, scale: float, mask: _BlockMask | None):
    """_block's gradients for q, k and v; `saved`: the rows' output gradient, queries, and merged output and
    log-sum-exp (flash attention's backward: the probabilities recomputed from them)."""
    grad, q, out, lse = saved
    if q.device.type in FUSED:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(), lse.contiguous(), 0.0,
            causal and mask is None, attn_mask=None if mask is None else mask.added(q.dtype), scale=scale)
    p = torch.exp(_scores(q, k, causal, scale, mask) - lse.unsqueeze(-1))
    g, o = grad.float(), out.float()
    dv = p.transpose(-2, -1) @ g
    dp = g @ v.float().transpose(-2, -1)
    ds = p * (dp - (g * o).sum(-1, keepdim=True))
    return (ds @ k.float() * scale).to(q.dtype), (ds.transpose(-2, -1) @ q.float() * scale).to(k.dtype), dv.to(v.dtype)


def _scores(q, k, causal: bool, scale: float, mask: _BlockMask | None) -> torch.Tensor:
    """The block's scaled scores in fp32, -inf where a query does not see a key."""
    s = (q.float() @ k.float().transpose(-2, -1)) * scale
    if mask is not None:
        return s.masked_fill(~mask.seen, float("-inf"))
    return s.masked_fill(_upper(s), float("-inf")) if causal else s


def _upper(s: torch.Tensor) -> torch.Tensor:
    return torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
