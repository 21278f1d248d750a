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
from shoal.models.cross_entropy import chunked_cross_entropy, cross_entropy_sum, fused_cross_entropy_sum
from shoal.models.spec import Batch, DataSpec, ModelBundle, ModelSection


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
    vocab_multiple: int = Field(1, ge=1)
    """Pad the vocabulary (embedding and output rows) up to a multiple of this, as GPT-2's 50257 ->
    50304: tensor parallelism needs the vocabulary divisible by tp. Padded classes never occur in the
    data; their logits are trained down like any wrong class."""
    loss_chunks: int = Field(1, ge=1)
    """Take the loss over this many chunks of a micro-batch's tokens, each chunk's logits made, upcast to fp32,
    turned into its loss and gradients and freed, so that the logits (tokens x vocab) never exist whole, in
    fp32 or in the compute dtype (as Liger-Kernel's fused linear cross-entropy); 1: over the whole logits.
    The same loss (fp32: within 1e-6). Not with parallel.tp > 1 (the logits are split over the vocabulary
    already) or parallel.pp > 1."""
    fused_loss: bool | Literal["auto"] = "auto"
    """Take the loss (over the whole logits) through torch.compile of the loss alone, the model staying eager:
    inductor fuses the fp32 upcast, the log-softmax and the pick of the target, so the fp32 logits need not be
    written out and read back by each of the plain loss's passes (on a GPU: not yet measured). "auto":
    on a CUDA device when the model is not compiled already (train.compile compiles the loss with it) and the
    logits are a plain tensor (not tensor parallelism's); false: the plain loss everywhere."""

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
        self.head_dim = d_model // n_head
        # separate projections, so that tensor parallelism can split each by heads (gpt_parallel.py)
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # (B, T, C) -> (B, heads, T, head_dim); under tensor parallelism C and heads are this rank's share
        q, k, v = (lin(x).view(B, T, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(B, T, -1)
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
        self.loss_chunks, self.fused_loss = cfg.loss_chunks, cfg.fused_loss
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

    def forward(self, idx: torch.Tensor, target: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """The logits (B, T, vocab); given the target (B, T), the loss summed over its counted tokens instead.
        `positions` (T,): the tokens' places in their sequence (parallel.cp: this rank's part of it), or (B, T):
        in their documents (data.pack_documents); default 0 .. T - 1."""
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device) if positions is None else positions
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        if target is None:
            return self.head(x)
        if self.loss_chunks > 1:
            return chunked_cross_entropy(x, self.head.weight, target, self.loss_chunks)
        logits = self.head(x)
        if takes_fused_loss(self.fused_loss, cuda=logits.is_cuda, plain=type(logits) is torch.Tensor,
                            compiling=torch.compiler.is_compiling()):
            return fused_cross_entropy_sum(logits, target)
        return cross_entropy_sum(logits, target)


def takes_fused_loss(setting: bool | str, *, cuda: bool, plain: bool, compiling: bool) -> bool:
    """model.fused_loss: true, or "auto" for plain (not tensor-parallel) logits on a GPU outside a compiled
    model (which compiles its loss with it)."""
    return setting is True or (setting == "auto" and cuda and plain and not compiling)


def lm_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Next-token cross-entropy summed over counted tokens (see [Note: loss contract]). Taken inside the
    model's forward: ZeRO 3 holds the head's gathered weight only there (the chunked loss reads it), and a
    compiled model compiles its loss too."""
    if "positions" in batch:  # parallel.cp's share of each sequence, or packed documents' (data/packing.py)
        return model(batch["input"], batch["target"], batch["positions"])
    return model(batch["input"], batch["target"])


def count_tokens(batch: Batch) -> torch.Tensor:
    return (batch["target"] != -1).sum()


def build(cfg: GPTConfig, spec: DataSpec) -> ModelBundle:
    model = GPT(cfg, padded_vocab(cfg, spec))
    return ModelBundle(model, lm_loss, count_tokens, block_types=(Block,), items_name="tokens",
                       tensor_parallel=tensor_parallel, pipeline=pipeline_layers, flops_per_sample=flops(model, cfg),
                       tp_split=tp_split, loss_in_forward=True, takes_positions=True)


def padded_vocab(cfg: GPTConfig, spec: DataSpec) -> int:
    """The output classes: model.vocab_size or the data's, padded up to model.vocab_multiple."""
    vocab = cfg.vocab_size or spec.vocab_size
    if vocab is None:
        raise UserError("model.vocab_size is not set and the data source has no fixed vocabulary; set it")
    if spec.vocab_size is not None and vocab < spec.vocab_size:
        raise UserError(
            f"model.vocab_size ({vocab}) is smaller than the data's vocabulary ({spec.vocab_size}); "
            f"raise it or leave it unset"
        )
    return -(-vocab // cfg.vocab_multiple) * cfg.vocab_multiple


# gpt_parallel.py imports DTensor's parallel styles (~0.5 s): only a run that splits the model pays for it
def tensor_parallel(model, tp: int, mesh=None, sequence_parallel: bool = False):
    from shoal.models import gpt_parallel

    refuse_chunked_loss(model, f"parallel.tp = {tp}", "tensor parallelism splits the logits over the vocabulary "
                        "already (loss_parallel: each rank holds 1/tp of them)")
    return gpt_parallel.tensor_parallel(model, tp, mesh, sequence_parallel)


def tp_split(model):
    from shoal.models import gpt_parallel

    return gpt_parallel.split_parameters(model)


def pipeline_layers(model):
    from shoal.models import gpt_parallel

    refuse_chunked_loss(model, "parallel.pp > 1", "the pipeline takes the last stage's loss from its whole logits "
                        "(the schedule calls the loss apart from the head)")
    return gpt_parallel.pipeline_layers(model)


def refuse_chunked_loss(model: GPT, layout: str, why: str) -> None:
    """model.loss_chunks needs the loss taken in the model's forward, where the head's weight is."""
    if model.loss_chunks > 1:
        raise UserError(f"model.loss_chunks = {model.loss_chunks} with {layout}: {why}; set model.loss_chunks = 1")


def flops(model: GPT, cfg: GPTConfig) -> float:
    """Training FLOPs of one sequence (Kaplan et al. 2020; PaLM's appendix B): 6 per weight of a matmul
    per token (forward 2, backward 4), the tied embedding counted once as the head's matmul, the position
    table (a lookup) not at all; plus attention's scores and weighted sum, 12 x layers x seq_len x d_model
    per token, as if not causal (the usual convention). Norms and the softmax are left out."""
    matmul = sum(p.numel() for p in model.parameters()) - model.pos_emb.weight.numel()
    per_token = 6 * matmul + 12 * cfg.n_layer * cfg.seq_len * cfg.d_model
    return float(per_token * cfg.seq_len)
