"""Number formats: autocast for compute, fp32 master weights and optimizer state, and how sharded
data parallelism gathers parameters and reduces gradients (FSDP2's mixed-precision policy).

bf16 needs no loss scaling (same exponent range as fp32). fp16 does: a GradScaler multiplies the
loss before backward and unscales before clipping; it exists for CUDA only here (the layout refuses
fp16 on CPU before any worker starts).
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from shoal.config import PrecisionConfig

# fp8: bf16 autocast and FSDP2 gathers for all but the linear layers, which float8.py converts
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


class Precision:
    def __init__(self, dtype: str, device: torch.device):
        self.dtype = DTYPES[dtype]
        self.device = device
        self.scaler = torch.amp.GradScaler("cuda") if dtype == "fp16" else None

    def autocast(self):
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler:
            self.scaler.unscale_(optimizer)

    def skip(self, optimizer: torch.optim.Optimizer) -> None:
        """No update this step; the scaler still closes its step (and lowers the scale on overflow)."""
        if self.scaler:
            self.scaler.update()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler:
            self.scaler.step(optimizer)  # skips the step when gradients overflowed
            self.scaler.update()
        else:
            optimizer.step()

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


def sharded_mixed_precision(cfg: PrecisionConfig) -> MixedPrecisionPolicy:
    """bf16: gather parameters in bf16 for compute, reduce gradients in precision.reduce_dtype; the
    sharded master parameters and the optimizer state stay fp32."""
    if cfg.dtype == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=DTYPES[cfg.dtype], reduce_dtype=DTYPES[cfg.reduce_dtype])
