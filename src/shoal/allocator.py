"""The memory allocator of ZeRO 2/3 workers on CPU: freed shards must leave the peak RSS, at no step-time cost.

On CPU, glibc's malloc serves a large request from the heap once the same size was freed before: its
mmap threshold starts at 128 KiB and rises to the size of every mmapped block freed (up to 32 MiB), so
after the first step ZeRO 2/3's per-layer all-gather and reduce-scatter buffers (28 MB per layer of a
100M GPT) are carved from the heap, and the heap keeps its high-water mark when they are freed. Peak
RSS then shows none of the sharding: measured on the 99.5M GPT at dp 2 (ZeRO 3, 6 steps), ZeRO 0 1,995
MiB, ZeRO 3 2,633. Fixing the threshold at 64 KiB keeps such buffers in mmapped blocks that go back to the
system when freed (ZeRO 3 1,165 MiB), but then every tensor over 64 KiB is mapped afresh and faulted in
page by page: 1.17 M minor faults per rank and step against 0.16 M for ZeRO 0, and ZeRO 3 took 3,745
ms per step against ZeRO 0's 1,472.

So ZeRO 2/3 workers on CPU start with gperftools' tcmalloc preloaded (Debian's libtcmalloc-minimal4; the
launcher sets LD_PRELOAD, which only counts when a process starts): it keeps freed spans in its page heap
and reuses them for the next layer's buffer of the same size, and gives free spans back to the system
over time. Measured the same way: ZeRO 3 1,965 ms per step, 68 K minor faults per rank and step, peak
RSS 1,233-1,250 MiB; ZeRO 2 1,713 ms (64 KiB threshold: 2,921), peak 1,430 MiB (1,393). jemalloc 5.3
(Debian's libjemalloc2) lost: with its default decay 3,351 ms and 1,230 MiB (its arena for requests
of 8 MiB and more purges at once); never purging, 1,825 ms but 1,466 MiB. Releasing tcmalloc's free
spans at step boundaries or after each block's backward (MallocExtension_ReleaseFreeMemory) did not
lower its peak (1,233-1,294 MiB), nor at the start of the backward (1,212-1,238 against 1,210-1,211,
and 60-100 ms per step slower): what it keeps at the peak is free spans split by the gradient shards
allocated between the transient buffers, which a release hands back only for the next allocation to
fault in again.

What was left of ZeRO 2/3's extra time was not the allocator's but gloo's collectives', and most of the
free spans at the peak came from their buffers: gloo's reduce_scatter_tensor all-reduces the whole input
and its all_gather_into_tensor copies through a buffer of its own, each allocated per call. Two ranks now
swap chunks instead (comm/collectives.py), the all-gather outputs and reduce-scatter inputs borrow one
buffer in turn (comm/lent_buffer.py) and FSDP2's backward prefetch is off on CPU (parallel/zero.py):
tcmalloc's heap is then 17 MiB over what is allocated at ZeRO 3's peak, where it was ~100.

In benchmarks/memory_sharding.py (medians of 3, beside DeepSpeed 0.19.8), before those changes: ZeRO 2
1,695 ms and ZeRO 3 1,877 (ZeRO 0 1,405), 0.76 and 0.71 of DeepSpeed's step time, where the 64 KiB
threshold gave 1.10 and 1.11; ZeRO 3's peak RSS 0.63 of ZeRO 0's (the threshold: 0.58-0.59). After:
ZeRO 2 1,421 ms and ZeRO 3 1,569 (ZeRO 0 1,332), 0.63 and 0.61 of DeepSpeed's; ZeRO 3's peak RSS 0.586 of
ZeRO 0's (medians of three invocations; benchmarks/README.md).

Context parallelism (parallel.cp) frees the same way: each attention gathers the group's keys and values and its
backward their gradients, buffers of the whole sequence freed layer by layer. Under glibc the split barely showed:
shoal's GPT (8 layers of d_model 128) on sequences of 8,192 bytes, 2 workers, one step, peak RSS 950 MiB at cp 1
(dp 2) and 909 at cp 2; with both under tcmalloc, 868 and 655. As launched now (cp 1 under glibc, as ZeRO 0; cp 2
under tcmalloc), 940 and 609.

Where tcmalloc is not installed, the workers fall back to the 64 KiB threshold (slower steps, the same
memory) and the launcher says so in one line. ZeRO 0/1 keep glibc's default: they free little. An
allocator you preload yourself (LD_PRELOAD naming a malloc) or a MALLOC_MMAP_THRESHOLD_ you set wins.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Mapping

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
THRESHOLD = 64 * 1024  # the fallback's fixed mmap threshold
TCMALLOC = "libtcmalloc_minimal.so.4"
INSTALL = "apt-get install libtcmalloc-minimal4"
# where Debian/Ubuntu (multiarch), Fedora and source builds put shared libraries
LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")
MALLOCS = ("tcmalloc", "jemalloc", "mimalloc")  # an LD_PRELOAD naming one of these is the user's allocator


def tcmalloc_path(dirs: tuple[str, ...] = LIB_DIRS) -> str | None:
    """The installed libtcmalloc_minimal, or None."""
    return next((p for p in (os.path.join(d, TCMALLOC) for d in dirs) if os.path.exists(p)), None)


def frees_layer_buffers(zero: int, cp: int) -> str | None:
    """Why workers allocate and free large buffers layer by layer (what the module doc says glibc keeps in the
    RSS): ZeRO 2/3's gathers and reduce-scatters, context parallelism's gathered keys and values; None."""
    return f"ZeRO {zero}" if zero >= 2 else f"parallel.cp = {cp}" if cp > 1 else None


def worker_env(zero: int, cuda: bool, env: Mapping[str, str] = os.environ,
               dirs: tuple[str, ...] = LIB_DIRS, cp: int = 1) -> tuple[dict[str, str], str | None]:
    """What the launcher adds to the workers' environment (LD_PRELOAD of tcmalloc for ZeRO 2/3 or parallel.cp on
    CPU), and the line it prints when tcmalloc is missing (the workers then fall back: release_freed_memory)."""
    preload, why = env.get("LD_PRELOAD", ""), frees_layer_buffers(zero, cp)
    if why is None or cuda or not sys.platform.startswith("linux") or any(m in preload for m in MALLOCS) \
            or "MALLOC_MMAP_THRESHOLD_" in env:
        return {}, None
    path = tcmalloc_path(dirs)
    if path is None:
        return {}, (f"shoal: {why} on CPU: {TCMALLOC} not found, so the workers use glibc's malloc with a "
                    f"{THRESHOLD // 1024} KiB mmap threshold (the same memory, slower steps); {INSTALL}")
    return {"LD_PRELOAD": f"{path} {preload}".strip()}, None


def preload_for_workers(zero: int, cuda: bool, cp: int = 1) -> None:
    """Set worker_env's variables in this process's environment, which the workers it starts inherit."""
    add, note = worker_env(zero, cuda, cp=cp)
    os.environ.update(add)
    if note:
        print(note, file=sys.stderr, flush=True)


def loaded_malloc() -> str:
    """The malloc serving this process: "tcmalloc" when it was preloaded, else "glibc" (or the C library's)."""
    return "tcmalloc" if hasattr(ctypes.CDLL(None), "MallocExtension_ReleaseFreeMemory") else "glibc"


def release_freed_memory() -> str:
    """In a ZeRO 2/3 or parallel.cp worker on CPU: make freed memory leave the RSS (see the module doc). Returns how:
    "tcmalloc" (preloaded at start: nothing more to do), "mmap threshold" (glibc's fixed at 64 KiB), or ""
    (neither: another C library, or MALLOC_MMAP_THRESHOLD_ set by the user, whose value wins)."""
    if not sys.platform.startswith("linux"):
        return ""
    if loaded_malloc() == "tcmalloc":
        return "tcmalloc"
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return ""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return "mmap threshold" if libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD) else ""
    except (OSError, AttributeError):  # musl and others have no mallopt
        return ""
