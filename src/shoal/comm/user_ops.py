"""Collectives a user's own call asks for (Horovod's API, shoal/horovod/): any op, any shape torch
takes, started without waiting. Each is one torch.distributed collective, logged in the CollectiveLog
as shoal's own are (the hang report names the one a rank waits in), and returned as a Pending.

Comm's methods are the collectives shoal's loop needs (blocking, equal chunks); these add what an
API that hands handles to its caller needs: a broadcast, an all-to-all with uneven splits, an
all-gather and a reduce-scatter into a given output, and the pickled-object forms (peers of one job
exchange Python objects that way, as Horovod's broadcast_object does).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shoal.comm.collectives import Comm, Pending
from shoal.compat import all_gather_single, reduce_scatter_single


class UserComm(Comm):
    def start(self, op: str, label: str, t: torch.Tensor, out: torch.Tensor, issue) -> Pending:
        """Log `op`, issue it (`issue()` returns torch's work handle), and return it unwaited."""
        rec = self.log.enter(op, label, [t])
        return Pending(issue(), rec, self.log, out)

    def all_reduce_async(self, t: torch.Tensor, op, label: str) -> Pending:
        return self.start("all_reduce", label, t, t,
                          lambda: dist.all_reduce(t, op=op, group=self.group, async_op=True))

    def broadcast_async(self, t: torch.Tensor, root: int, label: str) -> Pending:
        return self.start("broadcast", label, t, t,
                          lambda: dist.broadcast(t, root, group=self.group, async_op=True))

    def all_gather_into(self, out: torch.Tensor, t: torch.Tensor, label: str) -> Pending:
        """Every rank's `t` (the same shape everywhere) concatenated along dim 0 into `out`."""
        return self.start("all_gather", label, t, out,
                          lambda: all_gather_single(out, t, group=self.group, async_op=True))

    def reduce_scatter_into(self, out: torch.Tensor, t: torch.Tensor, op, label: str) -> Pending:
        """Chunk r of `t` (dim 0 split in equal chunks) reduced over the ranks, into `out` on rank r."""
        return self.start("reduce_scatter", label, t, out,
                          lambda: reduce_scatter_single(out, t, op=op, group=self.group, async_op=True))

    def all_to_all_async(self, out: torch.Tensor, t: torch.Tensor, out_splits: list[int] | None,
                         in_splits: list[int] | None, label: str) -> Pending:
        """Rows in_splits[j] of `t` (in order) to rank j; out_splits[r] rows of `out` from rank r."""
        return self.start("all_to_all", label, t, out,
                          lambda: dist.all_to_all_single(out, t, out_splits, in_splits, group=self.group,
                                                         async_op=True))

    def all_gather_objects(self, obj, label: str) -> list:
        """Every rank's `obj`, in rank order (pickled: the job's own processes, as torch's API does)."""
        got = [None] * dist.get_world_size(self.group)
        with self.log.record("all_gather_object", label):
            dist.all_gather_object(got, obj, group=self.group)
        return got

    def broadcast_objects(self, obj, root: int, label: str):
        """`obj` as rank `root` has it, on every rank (pickled, as above)."""
        box = [obj]
        with self.log.record("broadcast_object", label):
            dist.broadcast_object_list(box, root, group=self.group)
        return box[0]
