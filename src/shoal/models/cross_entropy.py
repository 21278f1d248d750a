"""The language model's loss: the cross-entropy summed over counted tokens ([Note: loss contract]), taken
over the whole logits or over chunks of tokens so that the logits never exist whole.

A GPT-2-sized head at 16 x 1024 tokens and a vocabulary of 50,304 makes 1.6 GB of bf16 logits, and the
plain loss upcasts them to fp32 (3.3 GB) and keeps that for backward. `chunked_cross_entropy` takes the
head's input and weight instead, as Liger-Kernel's fused linear cross-entropy does (Hsu et al. 2024),
written with torch: for one chunk of tokens at a time it makes the logits, upcasts them, takes the loss
and, when a backward will follow, the gradients with respect to the chunk's hidden states and the weight
(the loss ends the graph, so backward only scales them by the incoming scalar). Memory holds one chunk's
logits at a time, and from forward to backward the two gradients where the plain head keeps its input and
the fp32 logits; compute is the plain loss's three matmuls per token, none recomputed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORED = -1  # a target that is not counted (padding; see [Note: batch formats])


def cross_entropy_sum(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The plain loss: logits (..., vocab) upcast to fp32 whole, summed over counted targets."""
    return F.cross_entropy(logits.flatten(0, -2).float(), target.flatten(), ignore_index=IGNORED, reduction="sum")


_fused = None  # cross_entropy_sum under torch.compile, made at its first use (importing the compiler costs ~1 s)


def fused_cross_entropy_sum(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """cross_entropy_sum compiled on its own, for an eager model on a GPU (model.fused_loss): inductor fuses
    the fp32 upcast into the log-softmax and the target's pick, so that the fp32 logits need not be written
    out and read back by each pass (what it makes of it on a GPU, and at what speed, gpu_step.py's loss
    section and --trace show; not yet measured). The softmax is still taken in fp32: the plain loss's value
    within rounding. Shapes are static (every micro-batch has the same), so it compiles once for training
    and once for validation (no_grad)."""
    global _fused
    if _fused is None:
        _fused = torch.compile(cross_entropy_sum, dynamic=False)
    return _fused(logits, target)


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                          chunks: int) -> torch.Tensor:
    """cross_entropy_sum(hidden @ weight.T, target) over `chunks` chunks of the tokens: hidden (..., d),
    weight (vocab, d), target (...). Under autocast each chunk's logits are in the autocast dtype, as the
    plain head's are; the loss and the softmax are taken in fp32."""
    hidden, target = hidden.flatten(0, -2), target.flatten()
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(hidden, weight, target, chunks)
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for h, t in zip(hidden.tensor_split(chunks), target.tensor_split(chunks), strict=True):
        loss = loss + _chunk_loss(F.linear(h, weight).float(), t)[0]
    return loss


def _chunk_loss(z: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss sum, log-sum-exp per token, which tokens count) of fp32 logits z (n, vocab)."""
    counted = t != IGNORED
    lse = torch.logsumexp(z, dim=-1)
    picked = z.gather(1, torch.where(counted, t, 0).unsqueeze(1)).squeeze(1)
    return torch.where(counted, lse - picked, 0.0).sum(), lse, counted


def _logits_grad(z: torch.Tensor, t: torch.Tensor, lse: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
    """d loss / d logits = softmax - one-hot(target) on counted tokens, 0 on the others; made in place of
    the fp32 logits z, which are not needed after."""
    grad = z.sub_(lse.unsqueeze(1)).exp_()
    grad.scatter_add_(1, torch.where(counted, t, 0).unsqueeze(1), grad.new_full((len(t), 1), -1.0))
    return grad.mul_(counted.unsqueeze(1))


class _LinearCrossEntropy(torch.autograd.Function):
    """Loss and gradients in forward, chunk by chunk; backward scales the gradients."""

    @staticmethod
    def forward(ctx, hidden, weight, target, chunks):
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        # summed in fp32 over the chunks, as one matmul over all the tokens accumulates
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for i, (h, t) in enumerate(zip(hidden.tensor_split(chunks), target.tensor_split(chunks), strict=True)):
            logits = F.linear(h, weight)
            z = logits.float()  # fp32 logits already are z (a chunk's, not needed after)
            chunk_loss, lse, counted = _chunk_loss(z, t)
            loss = loss + chunk_loss
            # handed to the matmuls in the logits' dtype, as autograd hands the plain head's
            grad = _logits_grad(z, t, lse, counted).to(logits.dtype)
            if want_hidden:
                grad_hidden.tensor_split(chunks)[i].copy_(grad @ weight)
            if want_weight:
                grad_weight += (grad.t() @ h).float()
        ctx.save_for_backward(grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype))
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        return (None if grad_hidden is None else grad_hidden * grad_loss,
                None if grad_weight is None else grad_weight * grad_loss, None, None)
