"""The value a config leaves to the machine: precision.dtype = "auto" (the default), chosen once where the
config is loaded, the same way in the launcher and in each worker (NVML, no CUDA context), so every rank and
the preflight train the same config; the run dir's config.toml stores the value chosen.

bf16 where the workers train on GPUs that all have bf16 tensor cores (compute capability 8.0 or newer:
A100, L4, H100, H200), as torchtitan and Accelerate's mixed_precision="bf16" train; fp32 on the CPU (autocast
to bf16 there is slower than fp32 on most CPUs, and the CPU tests compare layouts in fp32) and on older
GPUs (bf16 would be emulated, fp16 needs a loss scaler: set it yourself)."""

from __future__ import annotations

from shoal import hardware
from shoal.config.root import Config

BF16_CAPABILITY = (8, 0)  # Ampere and newer


def resolve_auto(cfg: Config) -> tuple[Config, str | None]:
    """`cfg` with precision.dtype "auto" replaced by its value on this machine, and the line that says what was
    chosen and why (None: the config named its dtype)."""
    if cfg.precision.dtype != "auto":
        return cfg, None
    dtype, why = auto_dtype(cfg.parallel.device)
    precision = cfg.precision.model_copy(update={"dtype": dtype})
    return cfg.model_copy(update={"precision": precision}), f'precision.dtype "auto": {dtype} ({why})'


def auto_dtype(device: str) -> tuple[str, str]:
    """("bf16" | "fp32", why) for workers on parallel.device `device` here."""
    import torch  # here, not at the top: `shoal train` loads its config before torch, which it imports meanwhile

    on_gpu = device != "cpu" and torch.cuda.is_available()
    return choose_dtype(on_gpu, hardware.gpu_capabilities() if on_gpu else None)


def choose_dtype(on_gpu: bool, capabilities: list[tuple[int, int]] | None) -> tuple[str, str]:
    """The rule: ("bf16" | "fp32", why) for workers on GPUs of these compute capabilities, or on the CPU."""
    if not on_gpu:
        return "fp32", "training on the CPU"
    if not capabilities:
        return "fp32", "the GPUs' compute capability could not be read; set bf16 for Ampere (8.0) or newer"
    lowest = min(capabilities)
    if lowest < BF16_CAPABILITY:
        return "fp32", f"compute capability {lowest[0]}.{lowest[1]} has no bf16 tensor cores"
    return "bf16", f"GPUs of compute capability {lowest[0]}.{lowest[1]}: bf16 tensor cores"
