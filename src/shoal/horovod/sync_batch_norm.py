"""Horovod's SyncBatchNorm: batch normalisation over the batch of every process together.

In training, each channel's mean and variance are those of all processes' samples: per channel, the
sum and count are all-reduced, then the sum of squared deviations from the global mean (two passes:
no cancellation between large squares). The all-reduces are differentiable (the gradient of a sum
over processes is the sum of the gradients), so backward is exactly that of one process normalising
the whole batch, as torch's and Horovod's SyncBatchNorm compute it. Unlike those, it runs on the CPU
too. Running statistics use the unbiased variance of the whole batch. In eval mode (with running
statistics) it is plain batch normalisation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from shoal.horovod import ops, runtime
from shoal.horovod.differentiable import allreduce


class SyncBatchNorm(_BatchNorm):
    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
        if (not self.training and self.track_running_stats) or runtime.size() == 1:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                                self.training or not self.track_running_stats, self._factor(), self.eps)
        return self._synced(input)

    def _factor(self) -> float:
        if self.momentum is not None:
            return self.momentum
        return 1.0 / float(self.num_batches_tracked) if self.track_running_stats else 0.0  # cumulative average

    def _synced(self, x: torch.Tensor) -> torch.Tensor:
        dims = [d for d in range(x.dim()) if d != 1]
        shape = [1, -1] + [1] * (x.dim() - 2)
        local = torch.cat([x.sum(dims), x.new_tensor([x.numel() // x.shape[1]])])
        total = allreduce(local, op=ops.Sum, name="sync_batch_norm.sum")
        n = total[-1]
        mean = total[:-1] / n
        var = allreduce((x - mean.view(shape)).pow(2).sum(dims), op=ops.Sum, name="sync_batch_norm.var") / n
        if self.training and self.track_running_stats:
            with torch.no_grad():
                f = self._factor()
                self.running_mean.mul_(1 - f).add_(mean.detach(), alpha=f)
                self.running_var.mul_(1 - f).add_(var.detach() * n / (n - 1).clamp_min(1), alpha=f)
        y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y
