"""precision.dtype = "fp8": the model's linear layers train in float8 through torchao's float8 training
(`convert_to_float8_training`: each matmul's input, weight and output gradient cast to float8 with one
dynamic scale per tensor, the product accumulated in higher precision), and the rest of the model under
bf16 autocast (precision.py), as torchtitan does. Parameters and optimizer state stay fp32.

Which layers: every nn.Linear whose two dimensions are multiples of 16 (what float8 tensor cores take),
but the output head: a weight shared with another module (a GPT's head tied to its token embedding) or a
layer named head, lm_head or output. torchtitan leaves the output head in bf16 too; the logits feed the
loss, and a tied weight is also an embedding table. The conversion comes first in parallel/apply.py, so
that activation checkpointing, torch.compile and FSDP2 wrap Float8Linear modules (torchtitan's order).

Where it runs: NVIDIA GPUs of compute capability 8.9 or newer (Ada 8.9, Hopper 9.0, Blackwell), torchao
installed (pip install 'shoal[fp8]'). `refusal` says why not, one line, as a function of (device type,
capability, torchao installed) so that a CPU test covers every branch; the preflight asks it before any
worker starts, and the conversion again on the worker's own GPU (shoal.Session has no preflight).
Tensor parallelism with fp8 is refused by the layout (torchao's float8 tensor-parallel styles are not
wired in).

[Note: fp8 choices]
- Tensorwise scaling, torchao's default recipe: in torchao's own measurements the fastest on an H100,
  and it runs on Ada (rowwise scaling keeps more precision at some speed).
- No float8 all-gather under ZeRO 2/3 (torchao's enable_fsdp_float8_all_gather): FSDP2 gathers the
  weights in bf16 (MixedPrecisionPolicy) and each Float8Linear casts its own. Float8 all-gather halves
  the gather's bytes, but it needs precompute_float8_dynamic_scale_for_fsdp after every optimizer step
  (otherwise each weight's amax is all-reduced inside FSDP's gather): collectives outside comm/, which
  the hang report would not see, in the step that is being reassembled; and its gain, bytes between
  GPUs, has not been measured (one GPU at hand). A ZeRO 3 run across nodes is where to try it next.
- Without train.compile the casts run as separate kernels: fp8 pays off with compile, on linear layers
  large enough (torchao's tables: K and N in the thousands).
"""

from __future__ import annotations

import importlib.util

import torch

from shoal.errors import UserError, require

CAPABILITY = (8, 9)  # float8 tensor cores: Ada (8.9), Hopper (9.0) and newer
HEADS = ("head", "lm_head", "output")  # the last name of an output head, left in bf16


def torchao_installed() -> bool:
    return importlib.util.find_spec("torchao") is not None


def refusal(device: str, capability: tuple[int, int] | None, torchao: bool) -> str | None:
    """Why precision.dtype = "fp8" cannot train on `device` ("cpu" | "cuda"; `capability`: the lowest
    compute capability of its GPUs) with torchao installed or not, in one line; None: it can."""
    if device != "cuda":
        return ('precision.dtype = "fp8" trains on NVIDIA GPUs of compute capability 8.9 or newer (L4, L40S, H100, '
                'H200), not on the CPU; use "bf16"')
    if capability is None or tuple(capability) < CAPABILITY:
        have = f"{capability[0]}.{capability[1]}" if capability else "unknown"
        return (f'precision.dtype = "fp8" needs float8 tensor cores (compute capability 8.9 or newer: L4, L40S, '
                f'H100, H200), but this GPU has compute capability {have}; use "bf16"')
    if not torchao:
        return ('precision.dtype = "fp8" needs the torchao package; install it with: pip install \'shoal[fp8]\'')
    return None


def gpu_capability(device: torch.device | None = None) -> tuple[int, int] | None:
    """The compute capability of `device`, or the lowest of the visible GPUs; None: no GPU."""
    if not torch.cuda.is_available():
        return None
    if device is not None:
        return torch.cuda.get_device_capability(device)
    return min((torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())), default=None)


def check(device: str | torch.device) -> None:
    """Raise `refusal`'s line for a run of precision.dtype = "fp8" on `device`: "cuda" (the preflight:
    the lowest capability of the visible GPUs), a worker's own GPU, or "cpu"."""
    device = torch.device(device)
    capability = gpu_capability(device if device.index is not None else None) if device.type == "cuda" else None
    said = refusal(device.type, capability, torchao_installed())
    if said:
        raise UserError(said)


def float8_training(model: torch.nn.Module, dtype: str, device: torch.device) -> torch.nn.Module:
    """`model` with its linear layers in float8 when `dtype` is "fp8" (checked again on this worker's
    GPU); otherwise `model` as it is."""
    if dtype != "fp8":
        return model
    check(device)
    return convert(model)


def convert(model: torch.nn.Module, emulate: bool = False) -> torch.nn.Module:
    """Swap the linear layers that train in float8 (`converts`) for torchao's Float8Linear, in place (a
    bare nn.Linear is returned anew). `emulate`: torchao's high-precision stand-in for the float8
    matmul, which runs on a CPU (tests)."""
    f8 = require("torchao.float8", "fp8", 'precision.dtype = "fp8"')
    shared = _shared_weights(model)
    return f8.convert_to_float8_training(model, config=f8.Float8LinearConfig(emulate=emulate),
                                         module_filter_fn=lambda m, fqn: converts(m, fqn, shared))


def converts(module: torch.nn.Module, fqn: str, shared: set[int] = frozenset()) -> bool:
    """Whether this layer trains in float8: an nn.Linear with both dimensions multiples of 16 that is not
    the output head (named in HEADS, or its weight among `shared`: ids of weights other modules use too)."""
    if not isinstance(module, torch.nn.Linear):
        return False
    out_features, in_features = module.weight.shape
    head = fqn.rsplit(".", 1)[-1] in HEADS or id(module.weight) in shared
    return out_features % 16 == 0 and in_features % 16 == 0 and not head


def _shared_weights(model: torch.nn.Module) -> set[int]:
    """ids of the parameters that more than one module holds (tied weights)."""
    holders: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            holders[id(p)] = holders.get(id(p), 0) + 1
    return {pid for pid, n in holders.items() if n > 1}
