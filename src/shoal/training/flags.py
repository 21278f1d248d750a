"""The one collective of every step that carries the loss and every decision all ranks must take
alike: the loss sum, whether some rank was asked to stop (signals.py), whether some rank saw a
non-finite gradient norm (a bad step: skipped, rolled back or the run aborted), whether some rank's
clock says a checkpoint is due, and (a live elastic run) whether some rank wants the group to change at
the step's end: it leaves, or a joiner waits. One small all-reduce over all ranks, issued
asynchronously so that it overlaps the gradient clipping, whatever the step synchronisation does with
the gradients (under local SGD the gradient norm is a rank's own); one process has nothing to agree
with and issues none.

The vector stays on the device: the step decides its verdict from it there (step.py), and the host
learns it through the step's report (report.py), a step later unless the step is read at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shoal.comm.collectives import Comm, Pending

# a live elastic run: ranks asked to stop while others were not leave once the request is this old, and
# not at the next step's end; a job's cancel signals every node within a moment, and without the wait a
# step boundary falling in between split it into a leave of some ranks and a stop of the rest
LEAVE_GRACE_S = 2.0

# the agreed vector's entries, in order: summed over the ranks. "bad_norms" sums each rank's gradient norm times
# zero: 0 where every rank's norm was finite, NaN where one was not
AGREED = ("loss_sum", "bad_norms", "stops", "save", "regroup", "stop_age")
LOSS_SUM, BAD_NORMS = AGREED.index("loss_sum"), AGREED.index("bad_norms")  # where the device reads its two


@dataclass
class Flags:
    loss_sum: float  # summed over ranks whose loss counts
    stops: int  # ranks asked to stop
    bad_norm: bool
    save: bool
    regroup: bool = False
    stop_age: float = 0.0  # seconds since their request, summed over the ranks asked to stop

    @property
    def stop(self) -> bool:
        return self.stops > 0


class StepFlags:
    def __init__(self, comm: Comm, device: torch.device):
        self.comm, self.device = comm, device
        self._pending: Pending | None = None
        self._agreed: torch.Tensor | None = None
        self.names: tuple[str, ...] = AGREED  # result()'s entries
        self.known: dict[str, float] = {}  # the rest of AGREED's, known on the host (world size 1)
        self._own: tuple[torch.Tensor, torch.Tensor] | None = None  # world size 1: (loss sum, norm)

    def start(self, loss_sum: torch.Tensor, norm: torch.Tensor, stop: bool, save: bool, regroup: bool = False,
              stop_age: float = 0.0) -> None:
        """`loss_sum` (float32 or float64) and the gradient `norm` (float64) are device scalars (never read here);
        the rest is what this host knows, sent to the device in one copy that does not wait for it. At world
        size 1 there is nothing to agree on: the host's values stay on the host, the device's two on the device
        as they are (each operation here is a kernel launch on a GPU, and on a step the host's work bounds, its
        time)."""
        mine = {"stops": float(stop), "save": float(save), "regroup": float(regroup), "stop_age": stop_age}
        if self.comm.world_size == 1:
            self._own, self.names, self.known = (loss_sum, norm), AGREED[:1], mine
            return
        sent = host_tensor(list(mine.values()), self.device)
        t = torch.cat([loss_sum.double().reshape(1), (norm * 0).reshape(1), sent.to(self.device, non_blocking=True)])
        self._agreed = t
        self._pending = self.comm.all_reduce(t, label="world, step flags", async_op=True)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss summed over the ranks, and a value that is finite exactly when every rank's gradient norm
        was: device scalars (waiting for them makes the device wait for the collective, not the host)."""
        if self._own is not None:
            return self._own
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        return self._agreed[LOSS_SUM], self._agreed[BAD_NORMS]

    def vector(self) -> torch.Tensor:
        """`names`' entries on the device, for the step's report: the agreed float64 vector; at world size 1
        the loss sum alone, a scalar."""
        if self._own is not None:
            return self._own[0]
        self.result()
        return self._agreed


def host_tensor(values: list[float], device: torch.device) -> torch.Tensor:
    """A float64 CPU tensor of `values`, in pinned memory where it goes to a CUDA device, so that copying
    it there is asynchronous (a copy from ordinary memory waits for the device's queue). Each is a new
    tensor: torch's pinned-memory cache gives a block back only once the copy that read it has run."""
    t = torch.tensor(values, dtype=torch.float64)
    return t.pin_memory() if device.type == "cuda" else t


def agreed_flags(values: dict[str, float]) -> Flags:
    """The host's view of the agreed entries (AGREED's, by name)."""
    v = values
    norms = v["bad_norms"] if "bad_norms" in v else v["grad_norm"]  # at world size 1 the norm itself
    return Flags(v["loss_sum"], round(v["stops"]), not math.isfinite(norms), v["save"] > 0, v["regroup"] > 0,
                 v["stop_age"])


def stop_or_regroup(agreed: Flags, world: int, regroups: bool) -> tuple[bool, bool]:
    """Whether the run stops at this step's end, and whether the group changes. A run whose group can change
    (`regroups`: a live elastic run, training/generation.py's regroup_wanted) stops only when
    every rank was asked to; when some were, they leave (a regroup without them) once their request is
    LEAVE_GRACE_S old on average, a figure every rank reads alike from the flags."""
    if not regroups:
        return agreed.stops > 0, False
    if agreed.stops >= world:
        return True, False
    leave = agreed.stops > 0 and agreed.stop_age / agreed.stops >= LEAVE_GRACE_S
    return False, agreed.regroup or leave
