"""The collectives shoal issues itself, all through one object so that each is logged (for the hang
report) and timed (for the step profile), and the one way ranks agree on a value that one of them
decides.

Collectives that torch issues on shoal's behalf (FSDP2's all-gathers and reduce-scatters, DTensor's
tensor-parallel all-reduces, pipeline send/recv, DCP's planning) are not issued here; the hang report
sees them through the flight recorder and the main thread's stack (watchdog.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shoal.comm.log import CollectiveLog
from shoal.compat import all_gather_single, reduce_scatter_single


class Pending:
    """An async collective; its record is finished once waited for (a completion callback would run
    Python on the communication thread, in contention for the GIL with the training thread)."""

    def __init__(self, work, rec: dict, log: CollectiveLog, out: torch.Tensor):
        self.work, self.rec, self.log, self.out = work, rec, log, out

    def wait(self) -> torch.Tensor:
        with self.log.blocked_in(self.rec):
            self.work.wait()  # raises if it failed: the record then stays open
        self.log.done(self.rec)
        return self.out


def swap_with_peer(send: torch.Tensor, recv: torch.Tensor, group) -> dist.Work:
    """In a group of two ranks: `send` to the other rank and the other's `send` into `recv` (both
    contiguous, of one size), asynchronously. One all_to_all_single whose splits leave out this rank's
    own part, so nothing is allocated or copied on the way."""
    splits = [0, 0]
    splits[1 - dist.get_rank(group)] = send.numel()
    return dist.all_to_all_single(recv, send, splits, splits, group=group, async_op=True)


def all_gather_pair(out: torch.Tensor, shard: torch.Tensor, group) -> dist.Work:
    """In a group of two ranks: both ranks' `shard` into `out` in rank order (an all-gather into a tensor),
    asynchronously, by swapping shards; `shard` may already be this rank's part of `out` (FSDP2 gathers
    in place). gloo's all_gather_into_tensor allocates and copies a buffer of the whole output per call
    (measured with 2 processes on CPU, 14 MB shards: 12-15 ms, against 7.7 ms for the swap)."""
    r, n = dist.get_rank(group), shard.numel()
    flat = out.view(-1)
    mine, theirs = flat[r * n:(r + 1) * n], flat[(1 - r) * n:(2 - r) * n]
    if mine.data_ptr() != shard.data_ptr():
        mine.copy_(shard.reshape(-1))
    return swap_with_peer(mine, theirs, group)


class Comm:
    """This rank's door to the other ranks: collectives over process groups (None: all ranks) and a
    key-value store for small decisions."""

    def __init__(self, store=None, rank: int = 0, world_size: int = 1, log: CollectiveLog | None = None,
                 group=None):
        self.store, self.rank, self.world_size = store, rank, world_size
        # what "all ranks" means for this rank's collectives: the default group, or the training ranks'
        # group when others serve (a parameter server's ranks run a loop of their own)
        self.group = group
        self.log = log or CollectiveLog()
        self._agreed = 0
        # bytes this rank put on its links to keep the dp replicas in sync (gradients, parameter
        # averages), counted by the codecs from what each collective carries (comm/codecs.py)
        self.sync_bytes = 0

    def all_reduce(self, t: torch.Tensor, group=None, label: str = "world", op=dist.ReduceOp.SUM,
                   async_op: bool = False):
        """In place; returns `t`, or a Pending to wait for."""
        rec = self.log.enter("all_reduce", label, [t])
        pending = Pending(dist.all_reduce(t, op=op, group=self._g(group), async_op=True), rec, self.log, t)
        return pending if async_op else pending.wait()

    def all_gather(self, t: torch.Tensor, group=None, label: str = "world") -> list[torch.Tensor]:
        group = self._g(group)
        out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        rec = self.log.enter("all_gather", label, [t])
        Pending(dist.all_gather(out, t, group=group, async_op=True), rec, self.log, t).wait()
        return out

    def all_gather_flat(self, t: torch.Tensor, group=None, label: str = "world", async_op: bool = False):
        """Every rank's `t` (1-D, the same size everywhere), concatenated in rank order (or a Pending)."""
        group = self._g(group)
        out = t.new_empty(dist.get_world_size(group) * t.numel())
        rec = self.log.enter("all_gather", label, [t])
        pending = Pending(all_gather_single(out, t, group=group, async_op=True), rec, self.log, out)
        return pending if async_op else pending.wait()

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor, group=None, label: str = "world",
                   out_splits: list[int] | None = None, in_splits: list[int] | None = None) -> torch.Tensor:
        """Chunk j of `t` to rank j; chunk r of `out` from rank r: even chunks, or rows by the splits (uneven:
        each rank's sizes, what it sends and what it receives, agreed beforehand)."""
        rec = self.log.enter("all_to_all", label, [t])
        return Pending(dist.all_to_all_single(out, t, out_splits, in_splits, group=self._g(group), async_op=True),
                       rec, self.log, out).wait()

    def reduce_scatter(self, out: torch.Tensor, t: torch.Tensor, group=None, label: str = "world",
                       op=dist.ReduceOp.SUM) -> torch.Tensor:
        """Chunk r of `t` reduced over the ranks, into `out` on rank r.

        On gloo, a sum or mean goes by all-to-all, each rank adding up its own chunk: gloo's
        reduce_scatter_tensor all-reduces the whole input and keeps a chunk, moving twice the bytes a
        reduce-scatter must, through a buffer it allocates per call. Measured with 2 processes on CPU and
        28 MB of fp32: reduce_scatter_tensor 24-29 ms, the all-to-all and sum 10.7 ms, two ranks swapping
        chunks 7.7 ms. The sum is the same as gloo's for two ranks (a + b) and within rounding for more."""
        group = self._g(group)
        rec = self.log.enter("reduce_scatter", label, [t])
        w = dist.get_world_size(group)
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG) or dist.get_backend(group) != "gloo" \
                or not (t.is_contiguous() and out.is_contiguous()):
            return Pending(reduce_scatter_single(out, t, op=op, group=group, async_op=True), rec, self.log,
                           out).wait()
        chunks, flat = t.view(w, -1), out.view(-1)
        if w == 2:  # the other rank's part of our chunk straight into `out`, then ours added: no buffer
            r = dist.get_rank(group)
            Pending(swap_with_peer(chunks[1 - r], flat, group), rec, self.log, out).wait()
            flat.add_(chunks[r])
        else:
            got = torch.empty_like(t)
            Pending(dist.all_to_all_single(got, t, group=group, async_op=True), rec, self.log, got).wait()
            torch.sum(got.view(w, -1), dim=0, out=flat)
        return out.div_(w) if op == dist.ReduceOp.AVG else out

    def broadcast(self, t: torch.Tensor, src: int, label: str, group=None) -> torch.Tensor:
        """Rank `src`'s `t` on every rank, in place."""
        with self.log.record("broadcast", label, [t]):
            dist.broadcast(t, src=src, group=self._g(group))
        return t

    @torch.no_grad()
    def broadcast_module(self, module: torch.nn.Module, src: int = 0) -> None:
        """Rank `src`'s parameters and buffers on every rank, in place (over the whole world)."""
        for t in [*module.parameters(), *module.buffers()]:
            with self.log.record("broadcast", "world, initial weights"):
                dist.broadcast(t.data, src=src, group=self.group)

    def barrier(self, label: str = "world", group=None) -> None:
        with self.log.record("barrier", label):
            dist.barrier(group=self._g(group))

    def send(self, t: torch.Tensor, dst: int, label: str) -> Pending:
        """Point to point, to global rank `dst` (async: wait on the result)."""
        rec = self.log.enter("send", f"{label}, to rank {dst}", [t])
        return Pending(dist.isend(t, dst), rec, self.log, t)

    def recv(self, t: torch.Tensor, src: int, label: str) -> torch.Tensor:
        """Point to point, from global rank `src`, into `t`."""
        rec = self.log.enter("recv", f"{label}, from rank {src}", [t])
        return Pending(dist.irecv(t, src), rec, self.log, t).wait()

    def within(self, group, world_size: int) -> Comm:
        """This rank's Comm for a world made of `group` (the training ranks when others serve): the same
        store, log and sequence of agreements."""
        sub = Comm(self.store, self.rank, world_size, self.log, group=group)
        sub._agreed = self._agreed
        return sub

    def _g(self, group):
        return self.group if group is None else group

    def new_group(self, ranks: list[int] | None = None, backend: str | None = None):
        """Collective: every rank must create every group, in the same order (None: all ranks)."""
        with self.log.record("new_group", f"ranks {ranks if ranks is not None else 'all'}"):
            return dist.new_group(ranks, backend=backend)

    def record(self, op: str, label: str, tensors: list[torch.Tensor] = ()):
        """Context around a call that communicates through a library (a DCP save)."""
        return self.log.record(op, label, tensors)

    def agree(self, key: str, decide) -> str:
        """Collective: the string rank 0 gets from `decide()`, on every rank (through the store, so
        no process group is needed and nothing is pickled). Every rank must call it in the same order."""
        self._agreed += 1
        full = f"shoal/agree/{self._agreed}/{key}"
        if self.rank == 0:
            self.store.set(full, decide())
        with self.log.record("agree", key):
            return self.store.get(full).decode()
