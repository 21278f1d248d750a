"""A decoder-only transformer (GPT-2 shape, pre-norm), small enough to read in one sitting.

Radford et al. 2019, "Language Models are Unsupervised Multitask Learners"; layout as in nanoGPT.
Batches are {"input": (B, T) int64, "target": (B, T) int64}; targets of -1 are ignored.
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from shoal.errors import UserError
from shoal.models.registry import Batch, DataSpec, ModelBundle, ModelSection


class GPTConfig(ModelSection):
    """Decoder-only transformer for next-token prediction; trains on stdlib-text, text or tokens."""

    data_kinds: ClassVar = ("tokens",)
    name: Literal["gpt"] = "gpt"
    n_layer: int = Field(4, ge=1)
    """Transformer blocks."""
    n_head: int = Field(4, ge=1)
    """Attention heads; must divide d_model."""
    d_model: int = Field(128, ge=8)
    """Width of the residual stream."""
    seq_len: int = Field(128, ge=2)
    """Context length: tokens per sample."""
    vocab_size: int | None = Field(None, ge=2)
    """Output classes; default: the data's vocabulary (256 for byte-level text)."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on attention and residual paths (0: off, the usual choice for short runs)."""

    @model_validator(mode="after")
    def _heads_divide(self) -> GPTConfig:
        if self.d_model % self.n_head:
            raise ValueError(
                f"model.n_head ({self.n_head}) must divide model.d_model ({self.d_model}); "
                f"choose d_model as a multiple of n_head"
            )
        return self


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # each (B, T, C)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, d_model: int, dropout: float):
        super().__init__()
        self.up = nn.Linear(d_model, 4 * d_model)
        self.down = nn.Linear(4 * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.down(F.gelu(self.up(x))))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, vocab_size: int):
        super().__init__()
        self.seq_len = cfg.seq_len
        self.tok_emb = nn.Embedding(vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.n_head, cfg.dropout) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying (Press & Wolf 2017)
        self.apply(self._init)
        # GPT-2: scale residual projections by 1/sqrt(2 * n_layer) so the residual stream stays O(1)
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", "down.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, T, vocab)


def lm_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Next-token cross-entropy summed over counted tokens (see [Note: loss contract])."""
    logits = model(batch["input"])  # (B, T, vocab)
    return F.cross_entropy(logits.flatten(0, 1).float(), batch["target"].flatten(), ignore_index=-1,
                           reduction="sum")


def count_tokens(batch: Batch) -> torch.Tensor:
    return (batch["target"] != -1).sum()


def build(cfg: GPTConfig, spec: DataSpec) -> ModelBundle:
    vocab = cfg.vocab_size or spec.vocab_size
    if vocab is None:
        raise UserError("model.vocab_size is not set and the data source has no fixed vocabulary; set it")
    if spec.vocab_size is not None and vocab < spec.vocab_size:
        raise UserError(
            f"model.vocab_size ({vocab}) is smaller than the data's vocabulary ({spec.vocab_size}); "
            f"raise it or leave it unset"
        )
    return ModelBundle(GPT(cfg, vocab), lm_loss, count_tokens, block_types=(Block,), items_name="tokens")
