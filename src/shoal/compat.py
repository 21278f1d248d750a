"""The torch releases shoal supports, and every API that differs between them: the one place that
looks at torch's version (tests/unit/test_compat.py checks that no other module does).

Supported: torch 2.11 and newer; CI runs the whole suite on the pinned release and the fast tier on the
oldest (docs/development.md lists every release tested, with its result). Each difference below names
the release it came in. No feature needs a newer release than the oldest: the whole suite passes on 2.11.

Two differences are bridged where they occur, the same code on every release, with no version check:
gradient clipping scales each DTensor gradient's local part (torch 2.11's foreach multiply leaves a
Partial gradient unscaled: parallel/clip.py), and pipeline inputs are made contiguous (2.11 and 2.12's
schedules compare each call's input strides with their first call's: parallel/pipeline.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shoal.errors import UserError

# the oldest release shoal runs on: DCP's DefaultStager (2.9), FSDP2's custom all-gather and
# reduce-scatter (2.9) and replicate_with_fsdp (2.10) are older; 2.11 is the oldest release tested
MINIMUM = (2, 11)


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string: '2.11.0+cu130' -> (2, 11), '2.16.0.dev20261101' -> (2, 16)."""
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except (IndexError, ValueError):
        raise UserError(f"torch's version {version!r} is not a release number shoal can read") from None


VERSION = torch.__version__  # the one place shoal reads it: `shoal env`, profiles and the checks below
TORCH = release(VERSION)


# torch._grouped_mm (a mixture of experts' products in one call: models/moe.py): private, so taken where torch has
# it (2.13 on CPU: fp32 and bf16, rows of 16-byte multiples) and the batched product where it has not
GROUPED_MM = getattr(torch, "_grouped_mm", None)


def unsupported(version: str | None = None) -> str | None:
    """Why this torch (or `version`) cannot run shoal, in one line with the fix; None when it can."""
    version = VERSION if version is None else version
    if release(version) >= MINIMUM:
        return None
    need = ".".join(map(str, MINIMUM))
    return (f"shoal needs torch >= {need}, and this environment has torch {version}; upgrade it with "
            f"pip install 'torch>={need}' (for a GPU, the CUDA build your driver supports: "
            f"https://pytorch.org/get-started/locally/)")


def require_supported_torch() -> None:
    """Raise the one-line UserError of `unsupported()`: called where a command or a Python entry starts,
    so an old torch is said there rather than as an AttributeError deep inside a worker."""
    why = unsupported()
    if why:
        raise UserError(why)


# torch 2.13 named the single-tensor collectives all_gather_single and reduce_scatter_single and
# deprecated all_gather_into_tensor and reduce_scatter_tensor (a FutureWarning per call); before
# 2.13 only the old names exist. Same arguments, same semantics.
if TORCH >= (2, 13):
    all_gather_single = dist.all_gather_single
    reduce_scatter_single = dist.reduce_scatter_single
else:
    all_gather_single = dist.all_gather_into_tensor
    reduce_scatter_single = dist.reduce_scatter_tensor

# DCP's DefaultStager in torch 2.11 and 2.12 closes its state-dict stager after every stage (its copy
# table emptied: the next save's copy fails with KeyError: <class 'type'>); from 2.13 one stager serves
# every save, and keeps the copies' storage between them.
STAGER_REUSABLE = TORCH >= (2, 13)

# torch 2.15 gives the CPU flash-attention kernel (the one shoal's planner traces on the meta device) the
# flop formulas of the GPU's: QK^T and PV in full, causal or not, and their backward; before 2.15 the
# flop registry has none for it, and its FLOPs counted 0. flop_formula() counts it as 2.15 does on every release.
_CPU_FLASH = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
              torch.ops.aten._scaled_dot_product_flash_attention,
              torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
              torch.ops.aten._scaled_dot_product_flash_attention_backward}


def flop_formula(packet):
    """torch's FLOP count for an aten operator (called as torch's FlopCounterMode calls it), or None."""
    from torch.utils.flop_counter import flop_registry

    formula = flop_registry.get(packet)
    if formula is None and TORCH < (2, 15) and packet in _CPU_FLASH:
        formula = flop_registry.get(_CPU_FLASH[packet])
    return formula


# --- torch internals the step reads (private: checked here on every supported release) ---------------


def fused_optimizer_devices() -> list[str]:
    """The device types torch's fused optimizer kernels run on (CUDA and CPU among them on 2.11+)."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    return _get_fused_kernels_supported_devices()


def scaler_found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> dict:
    """What GradScaler.unscale_() recorded for `optimizer`: device -> 1.0 where its gradients overflowed, a
    device tensor, the dict update() reads (so that entries set in it are what update() sees)."""
    return scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]


def scaler_scale(scaler: torch.amp.GradScaler) -> torch.Tensor:
    """GradScaler's loss scale as the device tensor it keeps (get_scale() reads it on the host)."""
    return scaler._scale


def release_dtensor_caches() -> None:
    """Empty DTensor's caches of what ran: their keys and plans hold DTensorSpecs and device meshes, and
    so the process groups of every mesh a run used, past its end. In a process that runs again (Session,
    the tests' persistent ranks), such a group was then freed at an unforeseeable moment of a later run,
    when a cache evicted it (the tensor-meta cache keeps 128), at a different moment on each rank: its
    sockets closed under gloo's threads, which have aborted a rank (SIGABRT). Cleared when a run's groups
    are destroyed, they end there on every rank alike. The sharding propagator's cache is per thread:
    this clears the calling thread's (the one a run computes in)."""
    from torch.distributed.tensor import DTensor, _collective_utils, _redistribute

    propagator = DTensor._op_dispatcher.sharding_propagator
    for cache in (propagator.propagate_op_sharding, getattr(propagator, "_propagate_tensor_meta_cached", None),
                  getattr(_redistribute, "_gen_transform_infos", None),
                  getattr(_collective_utils.MeshTopoInfo, "build_from_mesh", None)):
        if hasattr(cache, "cache_clear"):  # each a functools cache where the release has it
            cache.cache_clear()
    getattr(_redistribute, "clear_redistribute_planner_cache", lambda: None)()
    getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", lambda: None)()  # the C++ dispatch's (2.13)


# --- what a GPU holds, asked without making a CUDA context ---------------------------------------------


def split_mesh_axis(mesh, axis: str, sizes: tuple[int, ...], names: tuple[str, ...]):
    """The sub-mesh over `names`: `mesh`'s axis `axis` split into axes of `sizes` (row-major, the last fastest),
    sharing `mesh`'s ranks and groups (a tensor-parallel DTensor of `mesh` composes with it under FSDP2).
    DeviceMesh._unflatten is private but the one way on every supported release (2.11-2.15): flattening a
    4-D mesh's two axes back into "dp" (torchtitan's older route) warns on 2.11+ that slicing a flattened
    axis from the root is deprecated."""
    split = mesh._unflatten(mesh.mesh_dim_names.index(axis), sizes, names)
    return split[names]


def visible_gpu_memory() -> list[tuple[str, int]] | None:
    """(name, total bytes) of each GPU this process sees (visible_gpus); None where NVML cannot say."""
    gpus = visible_gpus()
    return None if gpus is None else [(name, total) for name, total, _ in gpus]


def visible_gpus() -> list[tuple[str, int, tuple[int, int]]] | None:
    """(name, total bytes, compute capability) of each GPU this process sees, in CUDA_VISIBLE_DEVICES's order,
    asked of NVML as torch.cuda.device_count() asks it: no CUDA context is made, so the launcher, which forks
    its workers afterwards, may ask (CUDA initialised before a fork fails in the children;
    get_device_properties and get_device_capability would initialise it). torch's private
    _get_nvml_device_index maps CUDA_VISIBLE_DEVICES (indices or UUIDs) to NVML's numbering, on every
    supported release. None where NVML cannot say: no NVIDIA driver, a MIG instance (whose memory is not its
    GPU's)."""
    import ctypes

    class Memory(ctypes.Structure):  # NVML's nvmlMemory_t
        _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]

    try:
        count = torch.cuda.device_count()
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if count <= 0 or nvml.nvmlInit_v2() != 0:
            return None
    except (OSError, RuntimeError, AttributeError):
        return None
    out = []
    try:
        for i in range(count):
            handle, memory, name = ctypes.c_void_p(), Memory(), ctypes.create_string_buffer(96)
            major, minor = ctypes.c_int(), ctypes.c_int()
            if (nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(torch.cuda._get_nvml_device_index(i)),
                                                   ctypes.byref(handle)) != 0
                    or nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)) != 0
                    or nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)) != 0):
                return None
            nvml.nvmlDeviceGetName(handle, name, ctypes.c_uint(len(name)))
            out.append((name.value.decode(errors="replace"), memory.total, (major.value, minor.value)))
    except (RuntimeError, AttributeError, IndexError, ValueError):
        return None
    finally:
        nvml.nvmlShutdown()
    return out

