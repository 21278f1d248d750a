"""The waits torch's own collectives make inside the model, timed as exposed communication ([Note: exposed
communication] in comm/log.py): the training thread blocked until a message it needs has arrived.

  - FSDP2's parameter all-gathers (ZeRO 2/3): FSDPModule.set_custom_all_gather takes an all-gather that
    issues the same collective (two ranks on gloo: a swap of shards, the same result), records it in
    the collective log (so a hang report names it) and hands FSDP2 a Work whose wait() is timed: dp.
    (Its gradient reduce-scatters already go through shoal's own, parallel/sync.py.)
  - DTensor's collectives (tensor parallelism's all-reduces, a sharded gradient's norm): they return a
    tensor that waits on first use, in torch.distributed._functional_collectives.wait_tensor; that
    function is wrapped to time the wait: tp, or dp in a layout without tp (ZeRO's shards).
  - a pipeline schedule's sends and receives wait in torch.distributed.pipelining.schedules.
    _wait_batch_p2p, wrapped the same way: pp (the profile counts the schedule's bubble out of it,
    metrics/profile.py).
torch has no hook for the last two: the wrapped names are private ones of the pinned torch
(tests/unit/test_model_waits.py fails if they move). On a GPU a wait that only orders streams returns
at once and counts ~0; the step's marks synchronise, so the time shows as compute there.
"""

from __future__ import annotations

import functools
import threading
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

from shoal.comm.collectives import all_gather_pair
from shoal.comm.lent_buffer import LentBuffer
from shoal.comm.log import CollectiveLog
from shoal.compat import all_gather_single

_state: dict = {}  # the log and the axis DTensor's waits count on, set by time_model_waits


def _timed(fn, axis_of):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        log: CollectiveLog | None = _state.get("log")
        if log is None or log.waiting is not None or threading.get_ident() != threading.main_thread().ident:
            return fn(*args, **kwargs)  # not profiled, nested in a wait already counted, or another thread
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            log.add_exposed(axis_of(), time.perf_counter() - t0)
    wrapper.__wrapped_by_shoal__ = True
    return wrapper


def time_model_waits(log: CollectiveLog, dtensor_axis: str, pipeline: bool) -> None:
    """Time DTensor's waits (as `dtensor_axis`) and, with `pipeline`, the schedule's point-to-point waits,
    into `log` for the rest of this process (a worker trains one run)."""
    import torch.distributed._functional_collectives as funcol

    _state.update(log=log, dtensor_axis=dtensor_axis)
    if not getattr(funcol.wait_tensor, "__wrapped_by_shoal__", False):
        funcol.wait_tensor = _timed(funcol.wait_tensor, lambda: _state["dtensor_axis"])
    if pipeline:
        from torch.distributed.pipelining import schedules

        if not getattr(schedules._wait_batch_p2p, "__wrapped_by_shoal__", False):
            schedules._wait_batch_p2p = _timed(schedules._wait_batch_p2p, lambda: "pp")


def log_fsdp_all_gathers(module: torch.nn.Module, log: CollectiveLog, buffer: LentBuffer | None = None) -> None:
    """Every FSDP2 module under `module` all-gathers its parameters through LoggedAllGather (into `buffer`
    when it is free, on CPU)."""
    for name, m in module.named_modules():
        if isinstance(m, FSDPModule):
            m.set_custom_all_gather(LoggedAllGather(log, name or "root", buffer))


class LoggedAllGather(AllGather):
    """FSDP2's parameter all-gather for one module: the collective FSDP2 would issue (asynchronous when
    it prefetches the next block), in the collective log, its wait timed as exposed dp. Two ranks on gloo
    swap their shards instead (collectives.all_gather_pair: gloo's own allocates a buffer per call)."""

    def __init__(self, log: CollectiveLog, key: str, buffer: LentBuffer | None = None):
        self.log, self.key, self.buffer = log, key, buffer

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        lent = self.buffer.lend(size, dtype, device) if self.buffer is not None else None
        return lent if lent is not None else torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        rec = self.log.enter("all_gather", f"dp, parameters of {self.key}", [input_tensor])
        if dist.get_world_size(group) == 2 and dist.get_backend(group) == "gloo" and output_tensor.is_contiguous():
            work = all_gather_pair(output_tensor, input_tensor, group)
        else:
            work = all_gather_single(output_tensor, input_tensor, group=group, async_op=True)
        logged = LoggedWork(work, self.log, rec)
        if self.buffer is not None and self.buffer.holds(output_tensor):
            # FSDP2 waits for the Work it is handed right before it copies the output out into the
            # parameters, so a lent output is back then (a prefetch's copy-out may come a block later)
            self.buffer.back_when(lambda: rec["done"])
            return logged
        if async_op:
            return logged
        logged.wait()
        return None


class LoggedWork(dist.Work):
    """A collective's Work whose wait is timed in the log (once: FSDP2 may wait on it again)."""

    def __init__(self, work: dist.Work, log: CollectiveLog, rec: dict):
        super().__init__()
        self.work, self.log, self.rec = work, log, rec

    def wait(self, timeout=None) -> bool:
        if self.rec["done"]:
            return True
        with self.log.blocked_in(self.rec):
            ok = self.work.wait() if timeout is None else self.work.wait(timeout)
        self.log.done(self.rec)
        return ok

    def is_completed(self) -> bool:
        return self.work.is_completed()
