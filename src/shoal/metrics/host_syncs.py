"""metrics.host_syncs: how many times a step made the host wait for the device, step by step.

On a GPU a read of a tensor's value (`.item()`, `float(t)`, `.tolist()`, `.cpu()`, a copy to the host, a
stream's synchronize) blocks the host until the device has computed it, and the device then idles while the
host catches up. torch reports each such operation when its sync debug mode is "warn"; the warnings of the
training thread are counted here and not shown (those of other threads, such as an asynchronous checkpoint's
copy to the host or the data thread's, are shown as usual). Explicit waits on a CUDA event are not reported
by torch: shoal's own (the one late read of a step's report, the step timer on a logged step) are the
designed ones. On the CPU, where the host is the device and nothing waits, the reads of a value a GPU would
wait for are counted instead: every `aten._local_scalar_dense` (what `.item()`, `float()`, `int()` and
`bool()` of a tensor dispatch to) on the training thread, seen by a dispatch mode, which slows each operator
of the step by a Python call (the option is for looking, not for timing). The CPU's step also reads its
bad-step verdict on the host each step (free there; a GPU's optimizer takes it on the device).

Each sync is charged to the step the Phase tracker says is running (comm/phase.py), and reported in the first
step's metrics computed after it (`take`); where it was made (the innermost frame outside torch) is counted too,
for summary.json.
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_WARNING = "called a synchronizing CUDA operation"  # the start of torch's sync debug mode warnings


class HostSyncs:
    """Counts the training thread's host syncs while open; `step()` says which step is running."""

    def __init__(self, device: torch.device, step):
        self.device, self.step = device, step
        self.per_step: Counter[int] = Counter()
        self.sites: Counter[str] = Counter()  # "file:line" -> syncs made there
        self._thread = threading.get_ident()
        self._undo = None

    def count(self, site: str) -> None:
        if threading.get_ident() == self._thread:
            self.per_step[self.step() or 0] += 1
            self.sites[site] += 1

    def take(self, done: int) -> int:
        """The syncs charged to step `done` (1-based) and to any step before it not reported yet."""
        steps = [s for s in self.per_step if s <= done]
        return sum(self.per_step.pop(s) for s in steps)

    def open(self) -> HostSyncs:
        self._thread = threading.get_ident()
        self._undo = self._warnings() if self.device.type == "cuda" else self._value_reads()
        return self

    def close(self) -> None:
        if self._undo is not None:
            self._undo()
            self._undo = None

    def _warnings(self):
        shown, before = warnings.showwarning, torch.cuda.get_sync_debug_mode()

        def showwarning(message, category, filename, lineno, file=None, line=None):
            if str(message).startswith(SYNC_WARNING) and threading.get_ident() == self._thread:
                self.count(warned_at(filename, lineno))
            else:
                shown(message, category, filename, lineno, file, line)

        catching = warnings.catch_warnings()  # the filters as they were come back at close
        catching.__enter__()
        warnings.filterwarnings("always", message=SYNC_WARNING)  # every one, not once per place
        warnings.showwarning = showwarning
        torch.cuda.set_sync_debug_mode("warn")

        def undo():
            torch.cuda.set_sync_debug_mode(before)
            catching.__exit__(None, None, None)  # showwarning too

        return undo

    def _value_reads(self):
        mode = _ValueReads(self)
        mode.__enter__()
        return lambda: mode.__exit__(None, None, None)


class _ValueReads(TorchDispatchMode):
    """The CPU's count: a read of one value (modes are per thread: the training thread's alone)."""

    def __init__(self, syncs: HostSyncs):
        super().__init__()
        self.syncs = syncs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.syncs.count(caller())
        return func(*args, **(kwargs or {}))


def caller() -> str:
    """The innermost frame outside torch (and this file) on the stack: the code that read."""
    return outside_torch(sys._getframe(2))


def warned_at(filename: str, lineno: int) -> str:
    """Where a sync warning's code was: torch names the innermost Python frame, often torch's own (a collective's
    wrapper, a compiled kernel's launcher), so the stack is walked out from that frame as caller() does."""
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_filename == filename and frame.f_lineno == lineno):
        frame = frame.f_back
    return outside_torch(frame) if frame is not None else f"{short(filename)}:{lineno}"


def outside_torch(frame) -> str:
    while frame.f_back is not None and ("/torch/" in frame.f_code.co_filename
                                        or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    return f"{short(frame.f_code.co_filename)}:{frame.f_lineno}"


def short(path: str) -> str:
    """A file's path from its package on (.../site-packages/shoal/training/step.py -> shoal/training/step.py)."""
    for package in ("/shoal/", "/torch/"):
        if package in path:
            return package[1:] + path.rsplit(package, 1)[1]
    return path
