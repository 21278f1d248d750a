"""Windows of a token stream as batches, whole or as packed documents (data.pack_documents).

A window is seq_len + 1 consecutive tokens of the stream: its first seq_len are the input, its last seq_len the
target. Unpacked, a window is one sequence, whatever documents it spans (nanoGPT's and torchtitan's default).
Packed, each document in it is a sequence of its own, as Megatron's reset_position_ids / reset_attention_mask /
eod_mask_loss and Hugging Face's DataCollatorWithFlattening make it: a document ends with its end-of-document
token, and the window's first token begins a document (the tail of one cut by the window's start counts as one);
the positions start again at 0 on each document's first token ("positions", (B, T)), the model keeps attention
inside each document (models/documents.py, from those positions), and the target that crosses from a document's
end-of-document token into the next document is not counted (-1). Each document then trains as it would alone:
its tokens' losses are those of the document given to the model by itself.
"""

from __future__ import annotations

import numpy as np
import torch

from shoal.models.spec import Batch


def window_batch(w: np.ndarray | torch.Tensor, eos: int | None) -> Batch:
    """The batch of windows `w` (B, seq_len + 1), packed by the end-of-document token `eos` (None: unpacked)."""
    w = torch.as_tensor(w)
    batch = {"input": w[:, :-1].contiguous(), "target": w[:, 1:].contiguous()}
    if eos is not None:
        batch["positions"] = document_positions(batch["input"], eos)
        # into the next document: not a prediction of this one (a copy: the target may share `w`'s memory)
        batch["target"] = batch["target"].masked_fill(batch["input"] == eos, -1)
    return batch


def document_positions(tokens: torch.Tensor, eos: int) -> torch.Tensor:
    """Each token's place in its document (B, T): 0 on the first token and on every token after an `eos`."""
    B, T = tokens.shape
    index = torch.arange(T).expand(B, T)
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = tokens[:, :-1] == eos
    first = torch.where(starts, index, 0).cummax(dim=1).values  # each token's document's first index
    return index - first
