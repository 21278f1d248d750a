"""`shoal run --cpu`: a script written for CUDA GPUs runs unchanged on CPU worker processes.

Most distributed training scripts are written for GPUs (the DDP tutorials: `torch.cuda.set_device(
LOCAL_RANK)`, `init_process_group("nccl")`, `model.to(local_rank)`, `DDP(model, device_ids=[local_rank])`,
a snapshot loaded with `map_location=f"cuda:{local_rank}"`). To try one on a laptop or a CPU cluster before
paying for GPUs, `--cpu` makes, in each worker before the script starts: the NCCL backend gloo, a CUDA
device the CPU wherever a tensor or module is moved or made (a torch function mode over the whole
script), `torch.cuda.set_device` a no-op, DDP's device_ids dropped for a module on the CPU, and CUDA
map locations the CPU. `torch.cuda.is_available()` still says False: a script that checks it takes
its own CPU path; Accelerate is told to use the CPU (ACCELERATE_USE_CPU, as `accelerate launch --cpu`
does). Nothing else of the script changes; what it computes is the same math on the CPU.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.overrides import TorchFunctionMode

CPU = torch.device("cpu")


def on_cpu(device):
    """`device` (an index, a string or a torch.device) with CUDA made the CPU; anything else as given."""
    if isinstance(device, int) and not isinstance(device, bool):  # an index: a CUDA device
        return CPU
    if isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda":
        return CPU
    return device


class CudaOnCpu(TorchFunctionMode):
    """Every torch call with a CUDA device (keyword `device`, or the device given to `Tensor.to`) gets
    the CPU instead; `Tensor.cuda()` returns the tensor."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs:
            kwargs["device"] = on_cpu(kwargs["device"])
        at = {torch.Tensor.to: 1, torch._C._nn._parse_to: 0}.get(func)  # Module.to parses its arguments so
        if at is not None and len(args) > at:
            args = (*args[:at], on_cpu(args[at]), *args[at + 1:])
        return func(*args, **kwargs)


def install() -> None:
    """Set the stand-ins up in this process (a worker of `shoal run --cpu`, before the script runs)."""
    # Accelerate runs distributed on CPUs only when told (`accelerate launch --cpu` sets this): without it,
    # under torchrun or shoal run on a machine without GPUs, each worker trained alone (measured with
    # accelerate 1.15: "Distributed environment: DistributedType.NO, Num processes: 1" on every worker)
    os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    torch.cuda.set_device = lambda device: None

    init = dist.init_process_group

    @functools.wraps(init)
    def init_process_group(backend=None, *args, **kwargs):
        if isinstance(backend, str) and "nccl" in backend:
            backend = "gloo"
        return init(backend, *args, **kwargs)

    dist.init_process_group = dist.distributed_c10d.init_process_group = init_process_group

    ddp_init = DistributedDataParallel.__init__

    @functools.wraps(ddp_init)
    def ddp_on_cpu(self, module, device_ids=None, output_device=None, *args, **kwargs):
        if all(p.device.type == "cpu" for p in module.parameters()):
            device_ids = output_device = None  # DDP refuses device ids for a module on the CPU
        ddp_init(self, module, device_ids, output_device, *args, **kwargs)

    DistributedDataParallel.__init__ = ddp_on_cpu

    load = torch.load

    @functools.wraps(load)
    def load_on_cpu(f, map_location=None, *args, **kwargs):
        # only the location changes: weights_only stays the script's choice, by default torch's (True)
        if map_location is not None and not callable(map_location) and not isinstance(map_location, dict):
            map_location = on_cpu(map_location)
        return load(f, map_location, *args, **kwargs)

    torch.load = load_on_cpu
    CudaOnCpu().__enter__()  # for the rest of the process: the script runs inside it
