"""What this machine and its Python environment have, as a bug report or a GPU user needs it: shoal,
torch, CUDA, cuDNN, NCCL and Python versions, the NVIDIA driver, the GPUs, the backend and device a run
would take, the extras installed, tcmalloc, /dev/shm, and the planner's cached profiles. `problems()`
turns what stops training into one line each, naming the cause and the fix.

Every probe of the system is a small function of its own, so that a test can simulate a cause (no GPU
visible, a torch without NCCL, a small /dev/shm, an old driver) by replacing it.
"""

from __future__ import annotations

import ctypes
import importlib.metadata as metadata
import os
import platform
import re
import shutil
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from shoal import __version__, compat
from shoal.compat import unsupported
from shoal.config import choose_dtype
from shoal.errors import install_hint
from shoal.layout import choose_backend, choose_device
from shoal.parallel import float8

# NCCL keeps its intra-node buffers in /dev/shm; Docker's default of 64 MB makes NCCL fail at its first
# collective ("Error while creating shared memory segment"). NCCL's documentation asks for --shm-size=1g.
SHM_NEEDED = 1 << 30
# the oldest Linux driver of each CUDA major release (NVIDIA's CUDA toolkit release notes, minor-version
# compatibility): a torch built for CUDA 13 does not start on a driver made for CUDA 12
DRIVER_FOR_CUDA = {12: "525.60.13", 13: "580.65.06"}


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    memory: int  # bytes
    capability: tuple[int, int]


@dataclass
class Facts:
    python: str
    platform: str
    cpu: str
    cores: int
    torch: str
    torch_unsupported: str | None  # why this torch cannot run shoal (compat.py); None: it can
    cuda: str | None  # the CUDA torch was built for (None: a CPU build)
    cudnn: str | None
    nccl: str | None  # NCCL's version in this torch (None: no NCCL)
    driver: str | None  # the NVIDIA kernel module's version (None: no NVIDIA driver)
    driver_cuda: tuple[int, int] | None  # the newest CUDA the driver runs
    gpus: list[Gpu]
    cuda_warning: str | None  # what torch said when asked whether CUDA is available
    visible_devices: str | None  # CUDA_VISIBLE_DEVICES as set
    shm_bytes: int | None
    tcmalloc: str | None
    extras: dict[str, list[tuple[str, str | None]]] = field(default_factory=dict)  # extra -> [(package, version)]
    profiles: list[str] = field(default_factory=list)

    @property
    def device(self) -> str:
        """Where `parallel.device = "auto"` trains (the layout's own rule)."""
        return choose_device("auto", bool(self.gpus))

    @property
    def backend(self) -> str:
        """What `parallel.backend = "auto"` chooses on that device."""
        return choose_backend("auto", self.device)


def gather() -> Facts:
    from shoal.allocator import tcmalloc_path
    from shoal.hardware import cpu_name

    warning, gpus = visible_gpus()
    return Facts(python=platform.python_version(), platform=platform.platform(), cpu=cpu_name(),
                 cores=len(os.sched_getaffinity(0)), torch=compat.VERSION, torch_unsupported=unsupported(),
                 cuda=torch.version.cuda, cudnn=cudnn_version(), nccl=nccl_version(), driver=driver_version(),
                 driver_cuda=driver_cuda(), gpus=gpus, cuda_warning=warning,
                 visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"), shm_bytes=shm_bytes(),
                 tcmalloc=tcmalloc_path(), extras=extras(), profiles=cached_profiles())


def visible_gpus() -> tuple[str | None, list[Gpu]]:
    """(torch's warning when CUDA is not usable, or None; the GPUs torch sees)."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    warning = next((str(w.message).strip().splitlines()[0] for w in said), None)
    if not available:
        return warning, []
    gpus = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        gpus.append(Gpu(i, p.name, p.total_memory, (p.major, p.minor)))
    return warning, gpus


def nccl_version() -> str | None:
    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        return None
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def cudnn_version() -> str | None:
    if not torch.backends.cudnn.is_available():
        return None
    v = torch.backends.cudnn.version() or 0  # e.g. 91002
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}"


def driver_version() -> str | None:
    """The NVIDIA kernel module's version, as /proc says ("580.95.05"); None: no NVIDIA driver loaded."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return None
    found = re.search(r"Kernel Module(?: for [\w-]+)?\s+([\d.]+)", text)
    return found.group(1) if found else text.split()[0]


def driver_cuda() -> tuple[int, int] | None:
    """The newest CUDA release the installed driver runs (cuDriverGetVersion); None: no driver library."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    v = ctypes.c_int()
    if lib.cuDriverGetVersion(ctypes.byref(v)) != 0:
        return None
    return v.value // 1000, v.value % 1000 // 10


def nvidia_present() -> bool:
    """Whether this machine shows an NVIDIA GPU to the system, whatever torch sees."""
    return Path("/dev/nvidia0").exists() or Path("/proc/driver/nvidia/version").exists()


def shm_bytes() -> int | None:
    try:
        return shutil.disk_usage("/dev/shm").total
    except OSError:
        return None


def extras() -> dict[str, list[tuple[str, str | None]]]:
    """Each optional extra of shoal (pyproject's [project.optional-dependencies], but `test`) with its
    packages and their installed versions (None: missing)."""
    found: dict[str, list[tuple[str, str | None]]] = {}
    for extra, requirement in _extra_requirements():
        name = re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0]
        if extra == "test" or name == "shoal":
            continue
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            version = None
        found.setdefault(extra, []).append((name, version))
    return found


def _extra_requirements() -> list[tuple[str, str]]:
    """(extra, requirement) pairs from the installed package's metadata, or from pyproject.toml beside the
    source when shoal runs from a checkout on PYTHONPATH."""
    try:
        pairs = []
        for req in metadata.requires("shoal") or []:
            m = re.search(r"""extra\s*==\s*["']([\w-]+)["']""", req)
            if m:
                pairs.append((m.group(1), req.split(";")[0].strip()))
        return pairs
    except metadata.PackageNotFoundError:
        from shoal.config import tomllib

        pyproject = Path(__file__).resolve().parents[3] / "pyproject.toml"
        if not pyproject.is_file():
            return []
        table = tomllib.loads(pyproject.read_text())["project"].get("optional-dependencies", {})
        return [(extra, req) for extra, reqs in table.items() for req in reqs]


def cached_profiles() -> list[str]:
    """The planner's cached profiles of any machine (plan/profiles.py), one line each."""
    from shoal.errors import UserError
    from shoal.hardware import load_profile
    from shoal.plan.profiles import cache_dir, describe

    lines = []
    for path in sorted(cache_dir().glob("*/*.json")):
        try:
            lines.append(describe(load_profile(path), str(path)).removeprefix("profile: "))
        except UserError:
            lines.append(f"{path}: not readable by this shoal")
    return lines


def problems(facts: Facts) -> list[str]:
    """What stops this machine from training with shoal, one line each: the cause, then the fix."""
    out = [facts.torch_unsupported] if facts.torch_unsupported else []
    if not facts.gpus and (nvidia_present() or facts.driver):
        out.append(no_gpu_cause(facts))
    elif facts.gpus and not facts.nccl:
        out.append(f"no NCCL: torch {facts.torch} was built without it, so workers cannot train across GPUs; "
                   f"install PyPI's CUDA build of torch (pip install torch), which ships NCCL")
    if facts.gpus and facts.shm_bytes is not None and facts.shm_bytes < SHM_NEEDED:
        out.append(f"/dev/shm is {human(facts.shm_bytes)}: NCCL keeps its buffers between the GPUs of a node there "
                   f"and fails at the first collective when it runs out; give it 1 GiB or more (docker run "
                   f"--shm-size=1g or --ipc=host; Kubernetes: an emptyDir with medium: Memory on /dev/shm)")
    return out


def no_gpu_cause(facts: Facts) -> str:
    """Why torch sees no GPU on a machine that has one, in one line with the fix."""
    if facts.cuda is None:
        return (f"no GPU visible to torch: torch {facts.torch} is a CPU build; install a CUDA build beside your "
                f"driver (pip install torch --index-url https://download.pytorch.org/whl/cu128, or plain pip "
                f"install torch for PyPI's)")
    if facts.visible_devices is not None and facts.visible_devices.strip() in ("", "-1", "none", "NoDevFiles"):
        return (f"no GPU visible to torch: CUDA_VISIBLE_DEVICES={facts.visible_devices!r} hides every GPU; unset "
                f"it, or name the GPUs to use (CUDA_VISIBLE_DEVICES=0,1)")
    built = int(facts.cuda.split(".")[0])
    if facts.driver_cuda is not None and facts.driver_cuda[0] < built:
        need = DRIVER_FOR_CUDA.get(built, f"one made for CUDA {built}")
        return (f"no GPU visible to torch: the NVIDIA driver {facts.driver or ''} runs CUDA up to "
                f"{facts.driver_cuda[0]}.{facts.driver_cuda[1]}, and torch {facts.torch} is built for CUDA "
                f"{facts.cuda}; update the driver to {need} or newer, or install a torch built for CUDA "
                f"{facts.driver_cuda[0]} (https://pytorch.org/get-started/locally/)")
    said = f" (torch says: {facts.cuda_warning})" if facts.cuda_warning else ""
    return (f"no GPU visible to torch although this machine has an NVIDIA device{said}; check `nvidia-smi`, and "
            f"that the container was started with the GPUs (docker run --gpus all)")


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


NO_TCMALLOC = "not installed (ZeRO 2/3 on a CPU fall back to glibc's malloc: apt-get install libtcmalloc-minimal4)"


def render(facts: Facts) -> list[str]:
    """The report, one fact per line."""
    on = (f"{len(facts.gpus)} GPU(s), one worker per GPU" if facts.gpus else "the CPU")
    lines = [f"shoal       {__version__} ({Path(__file__).resolve().parents[1]})",
             f"python      {facts.python} on {facts.platform}",
             f"torch       {facts.torch}" + (f" (UNSUPPORTED: {facts.torch_unsupported})" if facts.torch_unsupported
                                             else ""),
             f"cuda        {facts.cuda or 'none (a CPU build of torch)'}; cuDNN {facts.cudnn or 'none'}; "
             f"NCCL {facts.nccl or 'none'}",
             f"driver      {facts.driver or 'none'}" + (f" (runs CUDA up to {facts.driver_cuda[0]}."
                                                        f"{facts.driver_cuda[1]})" if facts.driver_cuda else ""),
             f"cpu         {facts.cpu}, {facts.cores} core(s) for this process"]
    for g in facts.gpus:
        lines.append(f"gpu {g.index:<7} {g.name}, {human(g.memory)}, compute capability {g.capability[0]}."
                     f"{g.capability[1]}")
    if not facts.gpus:
        lines.append("gpus        none visible" + (f" (CUDA_VISIBLE_DEVICES={facts.visible_devices!r})"
                                                   if facts.visible_devices is not None else ""))
    dtype, why = choose_dtype(facts.device == "cuda", [g.capability for g in facts.gpus])
    workers = f"{len(facts.gpus)} (one per GPU)" if facts.gpus else "1"
    lines += [f"auto        parallel.device = {facts.device}, parallel.backend = {facts.backend} ({on}); "
              f"precision.dtype = {dtype} ({why}); shoal train --nproc {workers}",
              "fp8         " + (float8.refusal(facts.device, min((g.capability for g in facts.gpus), default=None),
                                              float8.torchao_installed()) or 'supported (precision.dtype = "fp8")'),
              f"/dev/shm    {human(facts.shm_bytes) if facts.shm_bytes is not None else 'none'}",
              f"tcmalloc    {facts.tcmalloc or NO_TCMALLOC}"]
    for extra, packages in facts.extras.items():
        missing = [name for name, version in packages if version is None]
        have = ", ".join(f"{name} {version}" for name, version in packages if version)
        state = f"installed ({have})" if not missing else (
            f"missing {', '.join(missing)}: {install_hint(extra)}" + (f" (has {have})" if have else ""))
        lines.append(f"extra       {extra}: {state}")
    lines += [f"profile     {p}" for p in facts.profiles] or ["profile     none cached (shoal plan measures one on "
                                                               "the spot; shoal probe calibrates one)"]
    lines.append(f"executable  {sys.executable}")
    return lines
