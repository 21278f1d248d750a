"""The DistributedOptimizer's gradient exchange: gradients fused into buckets, each bucket all-reduced
as soon as all of its gradients of the step are final, while backward goes on.

[Note: buckets] Horovod fuses the tensors that are ready into one buffer per all-reduce (tensor
fusion); DDP packs gradients into buckets (the first 1 MB, the others 25 MB) in reverse parameter
order, the order backward produces them. Here the buckets are DDP's, and they are sent in their order
only (a bucket completed early waits for the ones before it), so every process issues the same
all-reduces in the same order whatever order its hooks fire in. A bucket holds one dtype and device.

[Note: join flag] The first bucket carries one more entry: 1 from a process still training, 0 from
one that called hvd.join(). A joined process sends zeros for each bucket (`shadow`), as Horovod's
joined ranks contribute zeros, until that entry sums to 0: every process has joined. The entry rides
in a buffer that is sent anyway, so a job that never joins pays nothing for it. Through one of
shoal's codecs (which cannot carry it exactly) it is a one-entry all-reduce of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from shoal.comm.user_ops import UserComm
from shoal.errors import UserError
from shoal.horovod import ops

FIRST_BUCKET_BYTES = 1 << 20
BUCKET_BYTES = 25 << 20


@dataclass
class Bucket:
    index: int
    params: list[torch.nn.Parameter]
    ready: int = 0  # gradients final this step
    sent: tuple | None = None  # (pending, flat buffer, (tensor, context) per gradient, gradients), until unpacked
    joined_flag: float = 0.0  # through a codec: the flag's sum, learnt when bucket 0 is sent


def make_buckets(params: list[torch.nn.Parameter]) -> list[Bucket]:
    """DDP's buckets over `params` (registration order): reversed, one dtype and device each."""
    buckets: list[Bucket] = []
    size, cap = 0, FIRST_BUCKET_BYTES
    for p in reversed(params):
        same = buckets and (buckets[-1].params[0].dtype, buckets[-1].params[0].device) == (p.dtype, p.device)
        if not same or size >= cap:
            if buckets:
                cap = BUCKET_BYTES
            buckets.append(Bucket(len(buckets), []))
            size = 0
        buckets[-1].params.append(p)
        size += p.numel() * p.element_size()
    return buckets


class GradientExchange:
    def __init__(self, params: list[torch.nn.Parameter], names: dict, comm: UserComm, compression, op: int,
                 predivide: float, sparse_as_dense: bool):
        self.buckets = make_buckets(params)
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.names, self.comm, self.compression, self.sparse_as_dense = names, comm, compression, sparse_as_dense
        world = comm.world_size
        # Horovod's split of an average: 1/predivide before the sum, predivide/size after it
        self.pre = 1.0 / predivide if op == ops.Average else 1.0
        self.post = predivide / world if op == ops.Average else 1.0
        self.codec = compression.new_codec(comm) if hasattr(compression, "new_codec") else None
        self.codec_scale = 1.0 if op == ops.Average else float(world)  # a codec averages
        self.next = 0  # the next bucket to send

    def ready(self, p: torch.nn.Parameter) -> None:
        """`p`'s gradient is final for this step: send every complete bucket whose turn it is."""
        self.bucket_of[p].ready += 1
        while self.next < len(self.buckets) and self.buckets[self.next].ready == len(self.buckets[self.next].params):
            self._send(self.buckets[self.next], [self._grad(q) for q in self.buckets[self.next].params], 1.0)
            self.next += 1

    def finish(self) -> None:
        """Send what backward did not (a gradient never computed counts as zeros, as in Horovod), wait for
        every bucket and write the averaged gradients into .grad."""
        for b in self.buckets[self.next:]:
            self._send(b, [self._grad(p) for p in b.params], 1.0)
        for b in self.buckets:
            self._unpack(b, write=True)
            b.ready = 0
        self.next = 0

    def shadow(self) -> bool:
        """One step of a joined process: zeros for every bucket another process sends. False once every
        process has joined (nobody sent a gradient)."""
        zeros = [[torch.zeros_like(p) for p in b.params] for b in self.buckets]
        self._send(self.buckets[0], zeros[0], 0.0)
        if self._unpack(self.buckets[0], write=False) == 0:
            return False
        for b in self.buckets[1:]:
            self._send(b, zeros[b.index], 0.0)
        for b in self.buckets[1:]:
            self._unpack(b, write=False)
        return True

    def _grad(self, p: torch.nn.Parameter) -> torch.Tensor:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if p.grad.is_sparse:
            if not self.sparse_as_dense:
                raise UserError(f"parameter {self.names[p]!r} has a sparse gradient; pass sparse_as_dense=True to "
                                f"hvd.DistributedOptimizer (shoal's Horovod all-reduces gradients densely)")
            return p.grad.to_dense()
        return p.grad

    def _send(self, b: Bucket, grads: list[torch.Tensor], flag: float) -> None:
        label = f"dp, hvd gradient bucket {b.index}"
        if self.codec is not None:
            self._send_coded(b, grads, flag, label)
            return
        sent = [self.compression.compress(g) for g in grads]
        flat = torch.cat([t.reshape(-1) for t, _ in sent])
        ops.scale_(flat, self.pre)
        if b.index == 0:  # [Note: join flag]
            flat = torch.cat([flat, flat.new_full((1,), flag)])
        b.sent = (self.comm.all_reduce_async(flat, dist.ReduceOp.SUM, label), flat, sent, grads)

    def _send_coded(self, b: Bucket, grads: list[torch.Tensor], flag: float, label: str) -> None:
        """Through a codec: synchronous (it all-gathers and decodes), the flag first ([Note: join flag])."""
        if b.index == 0:
            flags = torch.tensor([flag], device=grads[0].device)  # NCCL takes no CPU tensor
            active = self.comm.all_reduce_async(flags, dist.ReduceOp.SUM, f"{label}, joined").wait()
            b.joined_flag = float(active[0])
            if flag == 0.0 and b.joined_flag == 0.0:
                b.sent = ("coded", None, None, grads)
                return
        out = [g.detach().clone() for g in grads]
        self.codec.all_reduce_mean(out, [self.names[p] for p in b.params], None, label)
        b.sent = ("coded", None, None, [o.mul_(self.codec_scale) for o in out])

    def _unpack(self, b: Bucket, write: bool) -> float:
        """Wait for bucket `b`; write its result into the gradients; returns the flag's sum (bucket 0)."""
        pending, flat, sent, grads = b.sent
        b.sent = None
        if pending == "coded":
            results, active = grads, b.joined_flag
        else:
            flat = pending.wait()
            active = float(flat[-1]) if b.index == 0 else 0.0
            results, offset = [], 0
            for t, ctx in sent:
                results.append(ops.scale_(self.compression.decompress(flat[offset:offset + t.numel()].view_as(t), ctx),
                                          self.post))
                offset += t.numel()
        if write:
            for p, r in zip(b.params, results, strict=True):
                p.grad = r.to_sparse() if p.grad.is_sparse else p.grad.copy_(r)
        return active
