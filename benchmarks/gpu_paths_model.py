"""A user model for benchmarks/gpu_paths.py (model.name = "gpu_paths_model:build"): shoal's GPT, built from the
[model] section's n_layer, n_head, d_model and seq_len (the same weights as model.name = "gpt" with the same
seed), whose gradients overflow once, on purpose, so that fp16 loss scaling must skip a step.

  overflow_call  the training forward (1-based, counted in this process) whose backward multiplies the gradient
                 of the logits by the largest number of its dtype: under fp16 autocast the logits are fp16, and
                 every gradient above 1 in magnitude (the loss scale of 2^16 puts the target tokens' near 16)
                 becomes inf, as a loss scale too large for the step makes it do; 0: never
  trace_file     where each training forward appends "<call> <sum of the embedding's weights>": a step whose
                 update was skipped leaves the weights the next step starts from unchanged
"""

import torch

from shoal.models.gpt import GPTConfig
from shoal.models.gpt import build as build_gpt


class Overflow(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * torch.finfo(grad.dtype).max


def build(cfg, spec):
    gpt_cfg = GPTConfig(n_layer=cfg.n_layer, n_head=cfg.n_head, d_model=cfg.d_model, seq_len=cfg.seq_len)
    bundle = build_gpt(gpt_cfg, spec)
    model, calls = bundle.model, [0]
    forward = model.forward
    at, trace = getattr(cfg, "overflow_call", 0), getattr(cfg, "trace_file", "")

    def overflowing_forward(idx, *rest):  # the target, when the loss is taken inside the forward
        if model.training:  # validation: neither counted nor traced
            calls[0] += 1
            if trace:
                with open(trace, "a") as f:
                    f.write(f"{calls[0]} {model.tok_emb.weight.detach().double().sum().item()!r}\n")
        return forward(idx, *rest)

    def overflow(module, args, logits):  # on the head's output: the loss may be taken inside the forward
        return Overflow.apply(logits) if model.training and calls[0] == at else logits

    model.head.register_forward_hook(overflow)
    model.forward = overflowing_forward
    return bundle
