"""Counting the host's blocking reads of tensor values, step by step, in one training process.

On a GPU a read of a tensor's value (`.item()`, `float(t)`, `bool(t)`, `.tolist()`, `.cpu()`, `.numpy()`)
makes the host wait until the device has computed it: the device then idles while the host catches up.
On a CPU nothing waits, but the same calls are made by the same code, so counting them here tells how
the step behaves on a GPU. Counted: every `aten._local_scalar_dense` (what `.item()`, `float()`,
`int()` and `bool()` of a tensor dispatch to), seen by a dispatch mode, and every call of
`Tensor.tolist`, `Tensor.cpu` and `Tensor.numpy` (which dispatch nothing on a CPU tensor). Reads made
inside `allowed()` (the step's one lagged read of a result copied a step earlier) are not counted, and
nor are the data path's, which builds batches in host memory before they go to the device: the loader
thread's (dispatch modes are per thread) or, with no thread (data.prefetch 0), the training thread's inside
`Prefetcher.next`.

Reads are charged to the step the Phase tracker says is running (comm/phase.py's begin_step).
"""

from __future__ import annotations

import contextlib
import threading
import traceback
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

PATCHED = ("tolist", "cpu", "numpy")


class HostReads(TorchDispatchMode):
    def __init__(self, phase):
        super().__init__()
        self.phase = phase
        self.per_step: Counter[int] = Counter()  # step (1-based; 0: before the first) -> reads
        self.where: dict[int, list[str]] = {}  # step -> what read, for a failing test's message
        self._allowed = 0
        self._saved: dict[str, object] = {}
        self._thread = threading.get_ident()  # the step's thread; a patched method is seen by every thread

    def count(self, what: str) -> None:
        if self._allowed or threading.get_ident() != self._thread:
            return
        step = self.phase.step or 0
        self.per_step[step] += 1
        self.where.setdefault(step, []).append(f"{what} at {caller()}")

    @contextlib.contextmanager
    def allowed(self):
        self._allowed += 1
        try:
            yield
        finally:
            self._allowed -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count("item")
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        from shoal.data.loader import Prefetcher

        for name in PATCHED:
            original = self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._counting(name, original))
        batches = self._next = Prefetcher.next

        def host_batches(loader):
            with self.allowed():
                return batches(loader)
        Prefetcher.next = host_batches
        return super().__enter__()

    def __exit__(self, *exc):
        from shoal.data.loader import Prefetcher

        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        Prefetcher.next = self._next
        return super().__exit__(*exc)

    def _counting(self, name: str, original):
        def read(t, *args, **kwargs):
            self.count(name)
            with self.allowed():  # what it dispatches is this one read
                return original(t, *args, **kwargs)
        return read


def caller() -> str:
    """The innermost frame of shoal (else of anything but this file and torch's Python-side wrappers) that
    read: where to look when a test fails."""
    frames = [f for f in traceback.extract_stack()[:-3] if not f.filename.endswith("read_counter.py")]
    ours = [f for f in frames if "/shoal/" in f.filename]
    f = (ours or frames)[-1]
    return f"{f.filename.rsplit('/', 2)[-2]}/{f.filename.rsplit('/', 1)[-1]}:{f.lineno}"


@contextlib.contextmanager
def as_on_a_gpu(reads: HostReads):
    """The reads a GPU's step makes: the step report's one late read (training/report.py) outside the count,
    and the bad-step verdict decided on the device (on the CPU the host decides it, where that waits for
    nothing: Stepper.host_decides)."""
    from shoal.training.report import StepReport
    from shoal.training.step import Stepper

    read, post_init = StepReport.read, Stepper.__post_init__

    def allowed_read(report):
        with reads.allowed():
            return read(report)

    def on_the_device(stepper):
        stepper.host_decides = False
        post_init(stepper)

    StepReport.read, Stepper.__post_init__ = allowed_read, on_the_device
    try:
        yield
    finally:
        StepReport.read, Stepper.__post_init__ = read, post_init
