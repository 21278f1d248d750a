"""Attention kept inside each packed document (data.pack_documents; the batch's side is data/packing.py).

A packed batch carries each token's place in its document ("positions", (B, T), 0 on a document's first token).
That is all attention needs: token i of a sequence may see token j when j <= i (causal) and j >= i - positions[i]
(its document's first token), so neither the model nor a context-parallel rank needs document ids or the other
ranks' positions. Inside `DocumentAttention`, F.scaled_dot_product_attention's causal calls (shoal's GPT's,
transformers' "sdpa") take that mask instead of the causal one. The mask is dense, (B, 1, T, T) booleans: T² bytes
a sequence, against the scores' 4 T² bytes per head that the unfused kernels hold anyway; parallel.cp builds it a
block at a time (parallel/context.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from shoal.errors import UserError


def packed_positions(batch: dict) -> torch.Tensor | None:
    """The per-token positions (B, T) of a packed batch; None for a batch of whole sequences (whose positions, if
    any, are parallel.cp's (T,) share of 0 .. T - 1)."""
    positions = batch.get("positions")
    return positions if positions is not None and positions.dim() == 2 else None


def visible(q_index: torch.Tensor, q_positions: torch.Tensor, k_index: torch.Tensor) -> torch.Tensor:
    """Which keys each query sees, (B, 1, tq, tk): queries at sequence indices `q_index` (tq,) with their places
    in their documents `q_positions` (B, tq), keys at `k_index` (tk,)."""
    first = (q_index - q_positions).unsqueeze(-1)  # (B, tq, 1): each query's document's first index
    k = k_index.view(1, 1, -1)
    return ((k <= q_index.view(1, -1, 1)) & (k >= first)).unsqueeze(1)


class DocumentAttention(TorchFunctionMode):
    """Inside it, causal F.scaled_dot_product_attention over a packed batch whose positions are `positions` (B, T)
    keeps each query inside its document. Leaving it, it checks the model did call it: a model whose attention is
    computed otherwise (transformers' "eager") would mix the documents unseen."""

    def __init__(self, positions: torch.Tensor):
        super().__init__()
        self.positions, self.calls = positions, 0
        self._mask = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        self.calls += 1
        return self.attend(*args, **kwargs)

    def attend(self, q, k, v, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
               scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
        if attn_mask is not None or not is_causal:
            raise UserError("data.pack_documents keeps attention inside each document of a causal model's "
                            "sequences; this model's attention has " + ("a mask of its own" if attn_mask is not None
                                                                        else "no causal mask")
                            + "; set data.pack_documents = false")
        if self._mask is None or self._mask.device != q.device:  # one mask for every layer of the forward
            index = torch.arange(q.shape[-2], device=q.device)
            self._mask = visible(index, self.positions.to(q.device), index)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self._mask, dropout_p=dropout_p, scale=scale,
                                              enable_gqa=enable_gqa)

    def __exit__(self, kind, value, traceback):
        out = super().__exit__(kind, value, traceback)
        if kind is None and self.calls == 0:
            raise_unseen("data.pack_documents = true", "data.pack_documents = false")
        return out


def raise_unseen(setting: str, fix: str) -> None:
    """A forward under `setting` never called F.scaled_dot_product_attention."""
    raise UserError(f"{setting} replaces the model's F.scaled_dot_product_attention, which its forward never called "
                    f"(a transformers model loaded with attn_implementation = \"eager\" computes attention itself); "
                    f"load it with attention \"sdpa\", or set {fix}")
