"""How to split the GPT for tensor parallelism (Megatron-LM, Shoeybi et al. 2019), with DTensor's
parallel styles. It lives beside the model, not in it: a user model brings its own functions the same way
(ModelBundle.tensor_parallel, ModelBundle.pipeline).

  q, k, v, mlp.up   column-parallel: each rank computes its share of the heads / hidden units
  proj, mlp.down    row-parallel: partial results all-reduced back into the replicated residual stream
  tok_emb           vocab-parallel: each rank holds a slice of the vocabulary's rows; outputs summed
  head              vocab-parallel output, tied to tok_emb (both shard the same [vocab, d] matrix by
                    rows); logits stay sharded and the cross-entropy runs over the sharded vocabulary
                    (loss_parallel), so no rank materializes the full logits
  norms, pos_emb    replicated

With sequence parallelism (Korthikanti et al. 2022) the norms, residual adds and dropout, which
tensor parallelism leaves replicated, run on 1/tp of the sequence instead: each row-parallel
all-reduce becomes a reduce-scatter over the sequence, and each column-parallel layer all-gathers the
sequence first; the same bytes move, and activations outside the split layers take 1/tp the memory.

Under precision.dtype = "fp8" the float8 layers (all but the head) take torchao's float8 styles of the same
layouts (tp_plan.float8_styles): with sequence parallelism the sequence is gathered in float8, cast once for
q, k and v (and once for mlp.up).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
)

from shoal.errors import UserError
from shoal.models.cross_entropy import cross_entropy_sum
from shoal.models.spec import PipelineLayers
from shoal.models.tp_plan import parallelize, split_by


def tensor_parallel(model, tp: int, mesh=None, sequence_parallel: bool = False):
    """Check that `tp` divides the model's heads, hidden sizes and vocabulary (always); with a mesh,
    split the model in place and return the context for the loss and its backward."""
    n_head = model.blocks[0].attn.q.out_features // model.blocks[0].attn.head_dim
    d_model, vocab = model.tok_emb.embedding_dim, model.tok_emb.num_embeddings
    for what, n in (("model.n_head", n_head), ("model.d_model", d_model), ("4 x model.d_model", 4 * d_model)):
        if n % tp:
            raise UserError(f"parallel.tp ({tp}) must divide {what} ({n}); choose a tp that divides it")
    if vocab % tp:
        padded = -(-vocab // tp) * tp
        raise UserError(f"parallel.tp ({tp}) must divide the vocabulary ({vocab}); set model.vocab_multiple = {tp} "
                        f"to pad it to {padded} (as GPT-2 pads 50257 to 50304)")
    if any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules()):
        raise UserError("model.dropout > 0 with parallel.tp > 1 is not supported (dropout masks would differ "
                        "between tensor-parallel ranks); set model.dropout = 0")
    if sequence_parallel and model.seq_len % tp:
        raise UserError(f"parallel.sequence_parallel splits the sequence: parallel.tp ({tp}) must divide "
                        f"model.seq_len ({model.seq_len})")
    if mesh is None:
        return None
    tied = model.head.weight is model.tok_emb.weight
    parallelize(model, mesh, styles(model, sequence_parallel))  # a float8 layer by torchao's float8 style
    if tied:  # each style distributed its own copy of the shared matrix: share it again
        model.head.weight = model.tok_emb.weight
    return loss_parallel


def split_parameters(model) -> list[nn.Parameter]:
    """The parameters tensor_parallel splits over the tp ranks (ModelBundle.tp_split), read from the styles it
    applies: q, k, v and mlp.up (weights and biases), proj and mlp.down (weights), the tied embedding and
    head; the norms, pos_emb and the row-parallel layers' biases are whole on every rank (with or without
    sequence parallelism, which splits the norms' activations, not their weights)."""
    return split_by(model, styles(model, False))


def styles(model, sequence_parallel: bool) -> dict:
    """{module name: DTensor ParallelStyle}: the split of the module docstring, as parallelize_module takes it."""
    seq = Shard(1) if sequence_parallel else Replicate()  # the residual stream between split layers
    plan = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate()),
        "head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    }
    if sequence_parallel:
        # the embeddings' sum is split by sequence where it leaves the dropout (a slice: no communication)
        plan["drop"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=seq)
        plan["ln_f"] = SequenceParallel()
    for i in range(len(model.blocks)):
        block = f"blocks.{i}"
        plan.update({f"{block}.attn.{name}": ColwiseParallel() for name in ("q", "k", "v")})
        plan[f"{block}.attn.proj"] = RowwiseParallel(output_layouts=seq)
        if hasattr(model.blocks[i].mlp, "up"):  # a dense MLP; a mixture of experts' (moe.py) stays whole
            plan[f"{block}.mlp.up"] = ColwiseParallel()
            plan[f"{block}.mlp.down"] = RowwiseParallel(output_layouts=seq)
        if sequence_parallel:  # norms on the sequence shard; the whole sequence gathered for attention / MLP
            plan.update({f"{block}.{norm}": SequenceParallel() for norm in ("ln1", "ln2")})
            gather = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
            plan.update({f"{block}.{sub}": gather for sub in ("attn", "mlp")})
    return plan


# --- pipeline parallelism -------------------------------------------------------------------------
# The GPT as a sequence of layers: the embeddings, each block, and the final norm with the output head.
# A stage is a contiguous run of them, built from the whole model with the other layers left out; the
# names of what it keeps are the whole model's (blocks.3.mlp.up.weight), so checkpoints of any split
# load into any other layout.


class GPTStage(nn.Module):
    """Layers [first, last) of a GPT (0: embeddings, 1..n_layer: blocks, n_layer + 1: norm and head)."""

    def __init__(self, model, first: int, last: int):
        super().__init__()
        n = len(model.blocks)
        self.embeds = first == 0
        self.outputs = last == n + 2
        if self.embeds:
            self.tok_emb, self.pos_emb, self.drop = model.tok_emb, model.pos_emb, model.drop
        elif self.outputs and model.head.weight is model.tok_emb.weight:
            # the tied matrix lives on the first and the last stage: registered first under its first
            # name, so both stages save it as the one-stage model does (the loop keeps the two in step)
            self.tok_emb = nn.Embedding(*model.tok_emb.weight.shape, device="meta")
            self.tok_emb.weight = model.tok_emb.weight
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(max(first - 1, 0), min(last - 1, n))})
        if self.outputs:
            self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x, positions=None):
        """`positions` (B, T), first stage: the tokens' places in their sequence (parallel.cp: this rank's share);
        default 0 .. T - 1."""
        if self.embeds:
            pos = torch.arange(x.shape[1], device=x.device) if positions is None else positions
            x = self.drop(self.tok_emb(x) + self.pos_emb(pos))
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.ln_f(x)) if self.outputs else x


def pipeline_layers(model) -> PipelineLayers:
    """The GPT as layers: embeddings, each block, final norm + head; costs are forward FLOPs."""
    d, T = model.tok_emb.embedding_dim, model.seq_len
    linear = [sum(m.weight.numel() for m in block.modules() if isinstance(m, nn.Linear)) for block in model.blocks]
    # forward FLOPs per token: 2 per matrix weight, plus attention's scores and weighted sum (4 T d)
    costs = [0] + [2 * w + 4 * T * d for w in linear] + [2 * model.head.weight.numel()]
    names = ["embeddings"] + [f"blocks.{i}" for i in range(len(model.blocks))] + ["ln_f+head"]
    return PipelineLayers(names, costs, lambda first, last: GPTStage(model, first, last), output_loss)


def output_loss(logits, target):
    """The last stage's loss: lm_loss without the forward (a sum, see [Note: loss contract])."""
    return cross_entropy_sum(logits, target)
