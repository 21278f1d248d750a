"""precision.dtype = "fp8": the model's linear layers train in float8 through torchao's float8 training
(`convert_to_float8_training`: each matmul's input, weight and output gradient cast to float8 with dynamic
scales, one per tensor or one per row (precision.fp8_recipe), the product accumulated in higher precision),
and the rest of the model under bf16 autocast (precision.py), as torchtitan does. Parameters and optimizer
state stay fp32.

Which layers: every nn.Linear whose two dimensions are multiples of 16 (what float8 tensor cores take),
but the output head: a weight shared with another module (a GPT's head tied to its token embedding) or a
layer named head, lm_head or output. torchtitan leaves the output head in bf16 too; the logits feed the
loss, and a tied weight is also an embedding table. The conversion comes first in parallel/apply.py, so
that activation checkpointing, torch.compile and FSDP2 wrap Float8Linear modules (torchtitan's order).

Where it runs: NVIDIA GPUs of compute capability 8.9 or newer (Ada 8.9, Hopper 9.0, Blackwell), torchao
installed (pip install -e '.[fp8]'). `refusal` says why not, one line, as a function of (device type,
capability, torchao installed) so that a CPU test covers every branch; the preflight asks it before any
worker starts, and the conversion again on the worker's own GPU (shoal.Session has no preflight).

With the layouts: under tensor parallelism the converted layers are split by torchao's float8 styles
(models/tp_plan.py float8_styles), which cast on the DTensor with one scale across the tp ranks; a layer is
converted there only if both its dimensions are multiples of 16 x tp, so that each rank's shard still is.
Under ZeRO 2/3, FSDP2 gathers the converted weights in float8 (precision.fp8_all_gather) and `WeightScales`
computes their scales after each step.

[Note: fp8 choices]
- Tensorwise scaling by default (precision.fp8_recipe), torchao's default recipe: in torchao's own
  measurements the fastest on an H100, and it runs on Ada. Rowwise (one scale per row of each operand) keeps
  an outlier's damage to its row, at some speed; torchao's float8 all-gather and float8 tensor-parallel styles
  take tensorwise scales only, so a rowwise run gathers ZeRO's weights in bf16 and splits its layers with
  DTensor's plain styles (each layer casts its own shard, as torchtitan does for rowwise).
- Float8 all-gather on by default under ZeRO 2/3 with tensorwise scaling, where torchtitan's
  enable_fsdp_float8_all_gather defaults off. It halves the bytes of each gather (ZeRO 3 gathers twice a
  step) and of the gathered copies, each rank casts its 1/dp shard instead of the whole weight, and the cast is
  from the fp32 shard (one rounding, as one process casts) rather than from FSDP's bf16 copy; what it adds is
  one all-reduce of a float per weight a step (torchao's precompute_float8_dynamic_scale_for_fsdp; without
  it each weight's amax is all-reduced inside FSDP's gather, as in the first step's gathers). That all-reduce
  runs in Parallelized.after_step, after the step's sync (a periodic average changes the weights too), and
  again when a checkpoint's weights are loaded (a resume, a rollback: scales of other weights would clip
  theirs), logged for the hang report like shoal's own collectives. The gain is bytes between GPUs, which
  one GPU cannot show: its speed is unmeasured.
- Float8 collectives under tensor parallelism (a sequence-parallel gather of the float8 input, the float8
  gradient's gather in backward) need NCCL; gloo has no float8 type, so over gloo a layer keeps DTensor's
  plain style wherever its float8 style would move float8 between ranks (tp_plan.float8_styles).
- Without train.compile the casts run as separate kernels: fp8 pays off with compile, on linear layers
  large enough (torchao's tables: K and N in the thousands).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys

import torch
from torch.distributed.tensor import DTensor

from shoal import hardware
from shoal.comm.collectives import Comm
from shoal.config import PrecisionConfig
from shoal.errors import UserError, install_hint, require

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
        return f'precision.dtype = "fp8" needs the torchao package; install it with: {install_hint("fp8")}'
    return None


def gpu_capability(device: torch.device | None = None) -> tuple[int, int] | None:
    """The compute capability of `device`, or the lowest of the visible GPUs (asked of NVML where it can say: the
    launcher's preflight makes no CUDA context before it forks its workers); None: no GPU."""
    if not torch.cuda.is_available():
        return None
    if device is not None:
        return torch.cuda.get_device_capability(device)
    known = hardware.gpu_capabilities()
    if known:
        return min(known)
    return min((torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())), default=None)


def check(device: str | torch.device) -> None:
    """Raise `refusal`'s line for a run of precision.dtype = "fp8" on `device`: "cuda" (the preflight:
    the lowest capability of the visible GPUs), a worker's own GPU, or "cpu"."""
    device = torch.device(device)
    capability = gpu_capability(device if device.index is not None else None) if device.type == "cuda" else None
    said = refusal(device.type, capability, torchao_installed())
    if said:
        raise UserError(said)


def float8_training(model: torch.nn.Module, precision: PrecisionConfig, device: torch.device, tp: int = 1,
                    zero: int = 0) -> torch.nn.Module:
    """`model` with its linear layers in float8 when precision.dtype is "fp8" (checked again on this worker's
    GPU), for a layout of tensor-parallel degree `tp` and ZeRO stage `zero`; otherwise `model` as it is."""
    if precision.dtype != "fp8":
        return model
    check(device)
    return convert(model, precision.fp8_recipe, all_gather=precision.gathers_float8(zero), tp=tp)


def convert(model: torch.nn.Module, recipe: str = "tensorwise", all_gather: bool = False, tp: int = 1,
            emulate: bool = False) -> torch.nn.Module:
    """Swap the linear layers that train in float8 (`converts`) for torchao's Float8Linear, in place (a
    bare nn.Linear is returned anew), scaled by torchao's `recipe` ("tensorwise" | "rowwise"); `all_gather`:
    FSDP2 gathers their weights in float8. `emulate`: torchao's high-precision stand-in for the float8
    matmul, which runs on a CPU (tests)."""
    f8 = require("torchao.float8", "fp8", 'precision.dtype = "fp8"')
    config = dataclasses.replace(f8.Float8LinearConfig.from_recipe_name(recipe),
                                 enable_fsdp_float8_all_gather=all_gather, emulate=emulate)
    shared = _shared_weights(model)
    return f8.convert_to_float8_training(model, config=config,
                                         module_filter_fn=lambda m, fqn: converts(m, fqn, shared, tp))


def converts(module: torch.nn.Module, fqn: str, shared: set[int] = frozenset(), tp: int = 1) -> bool:
    """Whether this layer trains in float8: an nn.Linear with both dimensions multiples of 16 x `tp` (float8
    matmuls take multiples of 16, on each tensor-parallel shard) that is not the output head (named in
    HEADS, or its weight among `shared`: ids of weights other modules use too)."""
    if not isinstance(module, torch.nn.Linear):
        return False
    out_features, in_features = module.weight.shape
    head = fqn.rsplit(".", 1)[-1] in HEADS or id(module.weight) in shared
    return out_features % (16 * tp) == 0 and in_features % (16 * tp) == 0 and not head


class WeightScales:
    """ZeRO 2/3 with float8 all-gather: the float8 scale of each sharded weight, computed from the weights as
    they are now by torchao's precompute_float8_dynamic_scale_for_fsdp (one all-reduce of their amaxes over
    the weights' mesh), for FSDP2's next gathers. Called after every step ([Note: fp8 choices]) and after
    the model's state is loaded."""

    def __init__(self, model: torch.nn.Module, comm: Comm):
        self.model, self.comm = model, comm
        mesh = next(m.weight.device_mesh for m in model.modules() if _gathered_in_float8(m))
        self.label = f"{' x '.join(mesh.mesh_dim_names or ('dp',))}, float8 weight scales"
        model.register_load_state_dict_post_hook(lambda module, keys: self())

    @classmethod
    def of(cls, model: torch.nn.Module, comm: Comm) -> WeightScales | None:
        """The scales of `model`'s weights that FSDP2 gathers in float8; None when it gathers none so."""
        return cls(model, comm) if any(_gathered_in_float8(m) for m in model.modules()) else None

    def __call__(self) -> None:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        with self.comm.record("all_reduce", self.label):
            precompute_float8_dynamic_scale_for_fsdp(self.model)


def _gathered_in_float8(module: torch.nn.Module) -> bool:
    """A Float8Linear whose weight FSDP2 shards and gathers in float8."""
    linear = sys.modules.get("torchao.float8.float8_linear")  # not imported: nothing converted
    return (linear is not None and isinstance(module, linear.Float8Linear)
            and module.config.enable_fsdp_float8_all_gather and isinstance(module.weight, DTensor))


def _shared_weights(model: torch.nn.Module) -> set[int]:
    """ids of the parameters that more than one module holds (tied weights)."""
    holders: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            holders[id(p)] = holders.get(id(p), 0) + 1
    return {pid for pid, n in holders.items() if n > 1}
