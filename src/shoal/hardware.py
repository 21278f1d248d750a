"""A hardware profile: what a machine and its network can do, measured by `shoal probe` or taken from a
named preset. MFU (achieved / peak FLOP/s) and `shoal plan` read it.

The JSON file (`shoal probe --out profile.json`):
  {"name": "...", "device": "cpu" | "cuda", "device_name": "...", "nproc": N, "nnodes": M,
   "matmul_flops": {"fp32": F, "bf16": F, ...},          # peak dense matmul FLOP/s of ONE worker
   "memory_bandwidth": B,                                 # bytes/s of one worker (a large copy)
   "collectives": {"all_reduce": [[bytes, seconds], ...], # per message size, over the group of nproc x nnodes
                   "all_gather": [...], "reduce_scatter": [...], "send_recv": [...]}}
A preset holds the vendor's dense peaks and, instead of measured curves, the name of its cluster's
network, whose collectives plan/network.py prices (NCCL's model with nccl-tests' bus bandwidths).
"""

from __future__ import annotations

import json
import math
import os
import platform
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from shoal.errors import UserError

# dense (no 2:4 sparsity) tensor-core peaks from the vendors' data sheets, FLOP/s per GPU
PRESETS = {
    "h100": {"device": "cuda", "device_name": "NVIDIA H100 SXM (data sheet)",
             "matmul_flops": {"fp32": 67e12, "tf32": 494.5e12, "bf16": 989.4e12, "fp16": 989.4e12},
             "memory_bandwidth": 3.35e12, "multiprocessors": 132, "network": "nvlink4-ndr400"},
    "h200": {"device": "cuda", "device_name": "NVIDIA H200 SXM (data sheet)",
             "matmul_flops": {"fp32": 67e12, "tf32": 494.5e12, "bf16": 989.4e12, "fp16": 989.4e12},
             "memory_bandwidth": 4.8e12, "multiprocessors": 132, "network": "nvlink4-ndr400"},
    "a100": {"device": "cuda", "device_name": "NVIDIA A100 SXM (data sheet)",
             "matmul_flops": {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
             "memory_bandwidth": 2.04e12, "multiprocessors": 108, "network": "nvlink3-hdr200"},
}
# a GPU preset's memory beyond tensors (HardwareProfile.context_bytes, nccl_bytes) until `shoal probe` measures
# them on the GPU: the CUDA context under lazy module loading (CUDA >= 11.7) is 300-430 MiB before a kernel
# runs (426 MiB with torch 2.10 + CUDA 13.0), and the kernels a training step loads add to it; NCCL's buffers
# outside torch's allocator were reported at 1.06 GB a GPU on 8 x H100 after a communicator's setup
# (NVIDIA/nccl issue 1685) and 544-688 MB a communicator on 4 x A100 (NVIDIA/nccl issue 964); they grow with
# its channels (NVLink4 runs up to 32 of them)
GPU_MEMORY = {"context_bytes": 512 * 2 ** 20, "nccl_bytes": 2 ** 30}
for _gpu in ("h100", "h200", "a100"):
    PRESETS[_gpu] |= GPU_MEMORY
# named clusters: a GPU's preset with its network (plan/network.py); the bare name takes the first
CLUSTERS = {"h100-ib400": ("h100", "nvlink4-ndr400"), "h100-roce400": ("h100", "nvlink4-roce400"),
            "h100-eth100": ("h100", "nvlink4-eth100"), "h200-ib400": ("h200", "nvlink4-ndr400"),
            "a100-ib200": ("a100", "nvlink3-hdr200"), "a100-efa400": ("a100", "nvlink3-efa400"),
            "a100-opa400": ("a100", "nvlink3-opa400")}
PRESETS |= {name: {**PRESETS[gpu], "network": net} for name, (gpu, net) in CLUSTERS.items()}


# the probe's parallel_overheads: stacks of this many 8 x 8 linear layers, whose collectives' messages are
# the smaller stack's parameters (DDP, FSDP2) or a layer's activations of 2 x 8 (tensor parallelism)
PROBE_LAYERS = (4, 32)
OVERHEAD_MESSAGE_BYTES = {"stack": PROBE_LAYERS[0] * 8 * 9 * 4, "tp": 2 * 8 * 4}
SCALAR_BYTES = 64  # an operator's rate measured at no more than this many bytes is its call's cost (op_rate)


class HardwareProfile(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)
    name: str = "probe"
    device: str = "cpu"
    device_name: str = ""
    nproc: int = 1
    nnodes: int = 1
    matmul_flops: dict[str, float]
    memory_bandwidth: float | None = None
    collectives: dict[str, list[tuple[float, float]]] = {}
    matmul_curve: dict[str, list[tuple[float, float]]] = {}  # per dtype: [[n, FLOP/s of n x n x n], ...]
    op_overhead_s: float | None = None  # what a training step pays per operator besides its arithmetic
    fresh_memory_s_per_byte: float | None = None  # CPU, ZeRO 2/3's mmap threshold: faulting in new pages
    heap_fixed_bytes: float | None = None  # CPU: a worker's resident set grows by this fixed amount in training
    heap_ratio: float | None = None  # ... and by this many bytes per byte of tensors the planner counts
    parallel_overheads: dict[str, float] = {}  # DTensor per operator, FSDP2 per call and parameter (probe/wrappers.py)
    op_rates: dict[str, list[tuple[float, float]]] = {}  # per aten operator without FLOPs: [[bytes, bytes/s]]
    op_flop_rates: dict[str, list[tuple[float, float]]] = {}  # per aten operator with FLOPs: [[FLOPs, FLOP/s]]
    # per strategy (dp, zero1..3, tp, pp): [a, b] of measured step = a x predicted + b, the reference GPT
    # trained by shoal against the formulas' prediction for it (plan/calibrate.py)
    calibration: dict[str, tuple[float, float]] = {}
    process_bytes: int | None = None  # resident memory of a worker after importing the training stack (CPU)
    threads: int | None = None  # compute threads of one worker when measured
    network: str | None = None  # a preset's cluster network (plan/network.py): collectives priced by group
    # the fraction of the peak (and of the memory bandwidth) that a training step's kernels reach: every
    # compute second the planner prices is divided by it (None: 1, the data sheet's figures as they are)
    compute_efficiency: float | None = None
    # a GPU's memory beyond the tensors (plan/predict.py's device peak): what a worker holds outside torch's
    # caching allocator after training steps (the CUDA context with the kernels it loaded, library handles);
    # what one NCCL communicator adds to that once it has run collectives (its channels' buffers); and the
    # caching allocator's reserved peak over its allocated peak in training (blocks rounded up, cached
    # free blocks, fragmentation). Measured by `shoal probe` on the GPU; a preset's are public figures.
    multiprocessors: int | None = None  # a GPU's streaming multiprocessors: a matmul's tiles run in waves of them
    context_bytes: int | None = None
    nccl_bytes: int | None = None
    allocator_reserve: float | None = None
    # what makes the machine it was measured on (this_machine()): a profile of another one is not used
    # unless asked for (--hardware); when it was measured (seconds since the epoch); `spot`: measured by
    # `shoal plan` in seconds (no calibration, no heap measurement) rather than by `shoal probe`
    machine: dict[str, str | int] = {}
    measured_at: float | None = None
    spot: bool = False

    def collective_time(self, op: str, nbytes: float) -> float | None:
        """Seconds of collective `op` for a message of `nbytes`, interpolated log-log between the
        measured sizes (linear in bytes beyond the largest); None: the profile has no curve for it."""
        return interpolate(self.collectives.get(op, []), nbytes, extrapolate_linear=True)

    def matmul_rate(self, dtype: str, n: float) -> float:
        """FLOP/s of a matmul of effective size n (the cube root of m k n), from the measured curve
        (flat beyond its ends); the peak without one."""
        rate = interpolate(self.matmul_curve.get(dtype, []), n, extrapolate_linear=False)
        return rate if rate is not None else self.peak_flops(dtype)

    def op_rate(self, name: str, nbytes: float) -> float:
        """Bytes per second of aten operator `name` moving `nbytes`, from the measured rates (log-log
        between sizes, flat beyond them); an operator never measured moves at the copy bandwidth, and so does
        one measured only on a few scalars' bytes, asked about more: such a rate is its call's cost, not its
        speed (the reference GPT multiplies only scalars, at 0.8 MB/s here; flat, it priced a mixture of
        experts' SwiGLU products, megabytes each, at seconds, and its step at 132 s against 0.34 measured)."""
        points = self.op_rates.get(name, [])
        if points and nbytes > SCALAR_BYTES >= max(size for size, _ in points):
            points = []
        rate = interpolate(points, nbytes, extrapolate_linear=False)
        return rate if rate is not None else (self.memory_bandwidth or 1e11)

    def op_flop_rate(self, name: str, dtype: str, flops: float) -> float:
        """FLOP/s of aten operator `name` doing `flops` in fp32, measured in the probe's reference steps;
        otherwise (another dtype, an operator never measured) the matmul curve at the same size."""
        rate = interpolate(self.op_flop_rates.get(name, []), flops, extrapolate_linear=False) \
            if dtype == "fp32" else None
        return rate if rate is not None else self.matmul_rate(dtype, (flops / 2) ** (1 / 3))

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s of one worker for compute in `dtype` (fp32 on a GPU means TF32 tensor cores when the
        profile has them only if measured so; a preset's fp32 is the plain fp32 peak)."""
        if dtype in self.matmul_flops:
            return self.matmul_flops[dtype]
        raise UserError(f"the hardware profile {self.name!r} has no peak for {dtype}; it has "
                        f"{', '.join(self.matmul_flops)} (run `shoal probe` on this machine)")


def line_through(first: tuple[float, float], last: tuple[float, float], min_slope: float = -math.inf,
                 max_slope: float = math.inf) -> tuple[float, float]:
    """(slope, intercept) of the line through two measured (x, y) points, its slope kept within
    [min_slope, max_slope] (one noisy point must not turn a cost over) and the line through `first`
    either way; x equal at both: the slope of y / x at `last`, clamped likewise."""
    (x0, y0), (x1, y1) = first, last
    slope = (y1 - y0) / (x1 - x0) if x1 != x0 else y1 / x1
    slope = min(max(slope, min_slope), max_slope)
    return slope, y0 - slope * x0


def interpolate(points, x: float, extrapolate_linear: bool) -> float | None:
    """y at x on a log-log polyline through (x, y) points; beyond the largest x: proportional to x
    (`extrapolate_linear`, a message's time grows with its bytes) or the last y; below the smallest: its y."""
    pts = sorted((float(a), float(b)) for a, b in points)
    if not pts:
        return None
    if x <= pts[0][0]:
        return pts[0][1]
    if x >= pts[-1][0]:
        return pts[-1][1] * (x / pts[-1][0] if extrapolate_linear else 1.0)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if x0 <= x <= x1:
            f = math.log(x / x0) / math.log(x1 / x0)
            return math.exp(math.log(y0) + f * (math.log(y1) - math.log(y0)))
    return pts[-1][1]


def preset(name: str) -> HardwareProfile:
    key = name.lower()
    if key not in PRESETS:
        raise UserError(f"unknown hardware preset {name!r}; use one of {', '.join(PRESETS)} (or a profile from "
                        f"`shoal probe --out profile.json` with --hardware)")
    return HardwareProfile(name=key, **PRESETS[key])


def gpu_preset_for(device_name: str) -> HardwareProfile | None:
    """The data-sheet preset of a GPU by the name CUDA gives it ("NVIDIA H100 80GB HBM3" -> h100); None
    for a GPU without one (the presets are the SXM parts: a PCIe card's peaks are lower)."""
    name = device_name.lower()
    if "pcie" in name:
        return None
    key = next((k for k in ("h100", "h200", "a100") if k in name), None)
    return preset(key) if key else None


def load_profile(path: str | Path) -> HardwareProfile:
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"hardware profile {str(path)!r} does not exist; write one with `shoal probe --out {path}` "
                        f"or name a preset ({', '.join(PRESETS)})")
    try:
        return HardwareProfile.model_validate(json.loads(p.read_text()))
    except (json.JSONDecodeError, ValidationError) as e:
        raise UserError(f"hardware profile {str(path)!r} is not a shoal probe file ({str(e).splitlines()[0]}); "
                        f"write it again with `shoal probe`") from None


def profile_or_preset(value: str) -> HardwareProfile:
    """A preset's name (h100, h100-ib400, a100, ...: PRESETS) or the path of a probe file."""
    return preset(value) if value.lower() in PRESETS else load_profile(value)


def save_profile(profile: HardwareProfile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(profile.model_dump(), indent=1) + "\n")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def this_machine() -> dict[str, str | int]:
    """What a profile's figures depend on besides the job: the CPU and how many cores this process may
    use, the GPUs, torch's version (its kernels and collectives change between releases) and the backend
    its workers would use. Profiles are cached and checked under it (plan/profiles.py)."""
    import torch

    from shoal.compat import VERSION

    cuda = torch.cuda.is_available()
    # the GPU's name as NVML gives it where it can: the plan that measures this machine on the spot then holds
    # no CUDA state of its own on the GPU its probe measures (torch.cuda.get_device_name initialises CUDA)
    named = gpu_memory() if cuda else None
    return {"cpu": cpu_name(), "cores": len(os.sched_getaffinity(0)),
            "gpu": (named[0][0] if named else torch.cuda.get_device_name(0)) if cuda else "none",
            "gpus": torch.cuda.device_count() if cuda else 0,
            "torch": VERSION, "backend": "nccl" if cuda else "gloo"}


def machine_differences(measured: dict, here: dict) -> list[str]:
    """What differs between the machine a profile was measured on and this one, in words: 'torch 2.12.0
    (here 2.13.0)'; a profile that did not record its machine differs in nothing that can be told."""
    return [f"{key} {measured[key]} (here {here[key]})" for key in here
            if key in measured and measured[key] != here[key]]


def gpu_capabilities() -> list[tuple[int, int]] | None:
    """The compute capability of each GPU this process sees, without making a CUDA context
    (compat.visible_gpus); None where that cannot be told. A probe a test replaces."""
    from shoal.compat import visible_gpus

    gpus = visible_gpus()
    return None if gpus is None else [capability for _, _, capability in gpus]


def gpu_memory() -> list[tuple[str, int]] | None:
    """(name, total bytes) of each GPU this process sees, without making a CUDA context
    (compat.visible_gpu_memory); None where that cannot be told. A probe a test replaces."""
    from shoal.compat import visible_gpu_memory

    return visible_gpu_memory()


def available_memory() -> int | None:
    """Bytes this machine can still give to new processes: /proc/meminfo's MemAvailable (free memory and the
    caches the kernel can drop), at most a cgroup's limit (a container's: the host's MemAvailable shows the
    whole machine); None where neither can be read. A probe a test replaces."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):  # cgroup v2, v1
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2 ** 60:  # v1 writes "no limit" as a huge number, v2 as "max"
            found.append(int(text))
    return min(found) if found else None
