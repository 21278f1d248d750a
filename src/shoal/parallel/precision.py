"""Number formats: autocast for compute, fp32 master weights and optimizer state, and how sharded
data parallelism gathers parameters and reduces gradients (FSDP2's mixed-precision policy).

bf16 needs no loss scaling (same exponent range as fp32). fp16 does: a GradScaler multiplies the
loss before backward and unscales before clipping; it exists for CUDA only here (the layout refuses
fp16 on CPU before any worker starts).
"""

from __future__ import annotations

import contextlib
import types

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from shoal.compat import scaler_found_inf, scaler_scale
from shoal.config import PrecisionConfig
from shoal.parallel.zero import local_optimizer

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

    def backward(self, loss: torch.Tensor, scale: torch.Tensor | float | None = None) -> None:
        """`loss`'s backward, its gradients multiplied by `scale` (a number or a device scalar; None: 1). The
        scale enters as the gradient the backward starts from, not as a multiplication in the graph: the same
        products (1 x scale either way), without an autograd node and its backward (the multiplication alone took
        11.5 us of host time inside a small model's step here)."""
        root = self.scaler.scale(loss) if self.scaler else loss
        root.backward(None if scale is None else start_gradient(scale, root))

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler:
            self.scaler.unscale_(optimizer)

    def overflowed(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """fp16, after unscale(): 1.0 where the gradients held an inf or NaN (the scaler skips the update),
        on the device; None without loss scaling."""
        if not self.scaler:
            return None
        found = scaler_found_inf(self.scaler, optimizer).values()
        return torch.stack([f.to(self.device) for f in found]).sum().clamp(max=1.0)

    def scale(self) -> torch.Tensor | None:
        """fp16: the loss scale, on the device (GradScaler.get_scale() would read it on the host)."""
        return scaler_scale(self.scaler) if self.scaler else None

    def step(self, optimizer: torch.optim.Optimizer, skip: torch.Tensor | float) -> None:
        """The update, unless `skip` (1.0 skips) or, with fp16, an overflow says no; a skipped step leaves the
        weights, the optimizer's state and its step count as they were. `skip` a number: the host decided (the
        CPU, Stepper.host_decides), and skips the call. A device scalar: a fused optimizer takes the verdict as
        GradScaler hands it one (`found_inf`) and skips on the device; any other optimizer reads the verdict (one
        wait for the device). fp16: the scaler then lowers its scale after an overflow (or a bad step), grows it
        after enough good ones."""
        if not isinstance(skip, torch.Tensor) and self.scaler is None:
            if not skip:
                optimizer.step()
            return
        inner = local_optimizer(optimizer)
        found_inf = skip if self.scaler is None else (skip + self.overflowed(optimizer)).clamp(max=1.0)
        if takes_found_inf(inner):
            inner.found_inf = found_inf
            try:
                optimizer.step()
            finally:
                del inner.found_inf
        elif not found_inf.item():
            optimizer.step()
        if self.scaler:
            # what unscale_() recorded for this optimizer, with the bad-step verdict added, is what
            # update() reads to lower the scale
            states = scaler_found_inf(self.scaler, optimizer)
            for device, found in states.items():
                states[device] = found_inf.to(found.device)
            self.scaler.update()

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


def start_gradient(scale: torch.Tensor | float, root: torch.Tensor) -> torch.Tensor:
    """`scale` as the gradient of `root` (a scalar): its dtype, shape and device. A number is filled in on the device
    (a fill, where a tensor made from a number would be a copy from the host that waits for the device's queue)."""
    if isinstance(scale, torch.Tensor):
        return scale.to(root.dtype).reshape(root.shape)
    return torch.full_like(root, scale)


def by_kind(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`params` as plain tensors, then DTensors (the kinds present, in their order)."""
    plain = [p for p in params if not isinstance(p, DTensor)]
    distributed = [p for p in params if isinstance(p, DTensor)]
    return [kind for kind in (plain, distributed) if kind] or [params]


def one_kind_per_group(optimizer: torch.optim.Optimizer) -> None:
    """A fused kernel takes DTensors or plain tensors, not both, and tensor parallelism leaves some parameters
    plain (the norms, unless sequence parallel): where a group mixes them, each step (also the one DCP takes
    to initialise the state before a first load) sees the group split by kind. The optimizer's state is per
    parameter and its groups stay as they are, so nothing else sees the split (checkpoints, the schedule)."""
    if not optimizer.defaults.get("fused"):
        return
    kinds = [by_kind(g["params"]) for g in optimizer.param_groups]  # the parameters never change
    if all(len(k) == 1 for k in kinds):
        return
    step = optimizer.step

    def split_step(self, *args, **kwargs):
        groups = self.param_groups
        self.param_groups = [{**g, "params": kind} for g, of_group in zip(groups, kinds, strict=True)
                             for kind in of_group]
        try:
            return step(*args, **kwargs)
        finally:
            self.param_groups = groups

    # a bound method, as torch's learning-rate schedulers expect to find (they wrap it in turn)
    optimizer.step = types.MethodType(split_step, optimizer)


def keep_implementation(optimizer: torch.optim.Optimizer | None) -> None:
    """After loading a saved state: each group runs the implementation this optimizer was built with (fused or
    foreach), not the one the saved groups name (a checkpoint from before the fused step names foreach)."""
    if optimizer is None:
        return
    for group in optimizer.param_groups:
        group.update({k: optimizer.defaults.get(k) for k in ("fused", "foreach") if k in group})


def takes_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` skips its update by a device tensor: torch's fused Adam, AdamW and SGD read the
    `found_inf` attribute GradScaler sets (their kernels return early where it is nonzero)."""
    fused = all(g.get("fused") for g in optimizer.param_groups)
    return fused and isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD))


def sharded_mixed_precision(cfg: PrecisionConfig) -> MixedPrecisionPolicy:
    """bf16: gather parameters in bf16 for compute, reduce gradients in precision.reduce_dtype; the
    sharded master parameters and the optimizer state stay fp32."""
    if cfg.dtype == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=DTYPES[cfg.dtype], reduce_dtype=DTYPES[cfg.reduce_dtype])
