"""Compressed DDP buckets overlap backward (comm/codecs.py ddp_hook): each bucket's collective is issued
when DDP hands the bucket over, and none is waited for until the last bucket's, in bucket order. Checked
with a one-rank gloo group and a Comm that records what is issued and waited for."""

import pytest
import torch
import torch.distributed as dist

from shoal.comm.codecs import DDPState, make_codec
from shoal.comm.collectives import Comm


class Recorded(Comm):
    def __init__(self):
        super().__init__()
        self.events: list[str] = []

    def _async(self, name, pending, label):
        self.events.append(f"issue {label}")
        wait = pending.wait

        def waited():
            self.events.append(f"wait {label}")
            return wait()
        pending.wait = waited
        return pending

    def all_reduce(self, t, group=None, label="world", op=dist.ReduceOp.SUM, async_op=False):
        return self._async("all_reduce", super().all_reduce(t, group, label, op, async_op=True), label)

    def all_gather_flat(self, t, group=None, label="world", async_op=False):
        return self._async("all_gather", super().all_gather_flat(t, group, label, async_op=True), label)


class Bucket:  # what a DDP comm hook reads of its GradBucket
    def __init__(self, index, last, grads):
        self._index, self._last, self.buf = index, last, torch.cat([g.reshape(-1) for g in grads])
        self.params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
        self.grads, offset = [], 0
        for g in grads:  # views into the buffer, as DDP's
            self.grads.append(self.buf[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def index(self):
        return self._index

    def is_last(self):
        return self._last

    def buffer(self):
        return self.buf

    def gradients(self):
        return self.grads

    def parameters(self):
        return self.params



# the tolerance as a fraction of a tensor's largest entry: half a quantisation step for int8 / int4
@pytest.mark.parametrize("codec,tol", [("fp16", 1e-3), ("int8", 1 / 254), ("int4", 1 / 14), ("topk", 0.0),
                                       ("powersgd", 1e-5)])
def test_every_bucket_is_sent_before_any_is_waited_for(one_rank, codec, tol):
    comm = Recorded()
    c = make_codec(codec, comm, topk_ratio=1.0, powersgd_rank=4)
    torch.manual_seed(0)
    low_rank = [torch.randn(32, 2) @ torch.randn(2, 16) for _ in range(2)]  # PowerSGD rank 4 is exact on them
    grads = [[low_rank[0], torch.randn(8)], [low_rank[1]], [torch.randn(8)]]
    buckets = [Bucket(i, i == 2, g) for i, g in enumerate(grads)]
    state = DDPState(None, {id(p): f"b{b.index()}.{j}" for b in buckets for j, p in enumerate(b.params)})
    futures = [c.ddp_hook(state, buckets[0])]
    assert comm.events and all(e.startswith("issue") for e in comm.events)  # sent, not waited for
    futures.append(c.ddp_hook(state, buckets[1]))
    waited = [e for e in comm.events if e.startswith("wait")]
    # in flight while backward goes on; PowerSGD's second round trip for bucket 0 starts with bucket 1
    assert waited == (["wait dp, gradient bucket 0, PowerSGD P"] if codec == "powersgd" else [])
    assert not any(f.done() for f in futures)
    futures.append(c.ddp_hook(state, buckets[2]))  # the last: every round finished, in bucket order
    assert all(f.done() for f in futures)
    # (PowerSGD's P is waited for as each next bucket comes, to send its Q: the finishing waits are in order)
    order = [int(e.split("bucket ")[1][0]) for e in comm.events if e.startswith("wait") and "PowerSGD P" not in e]
    assert order == sorted(order)
    for b, g, f in zip(buckets, grads, futures, strict=True):  # one rank: the mean is the gradient itself
        assert f.value() is b.buf
        for got, want in zip(b.gradients(), g, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=tol * want.abs().max().item() + 1e-6)
