"""A Session's data: the micro-batches sess.data() deals this rank (Loader), moved to the device as Accelerate's
prepared loader moves them, and what the Run reads of a user's data source (UserData)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import torch

from shoal.data.loader import Prefetcher, prefetch_depth
from shoal.errors import UserError
from shoal.models.spec import DataSpec
from shoal.training.feed import pinned


class Loader:
    """Iterating gives this rank's micro-batches, step after step, up to train.steps (see Session.data)."""

    def __init__(self, sess, dataset, micro: int, collate: Callable):  # sess: the Session (session.py imports this)
        self.sess, self.dataset, self.micro, self.collate = sess, dataset, micro, collate

    def batches(self, step: int) -> list:
        sess = self.sess
        dp_rank = sess.pairs[0].par.dp_rank if sess.pairs else sess.rank
        idx = sess.sampler.local_micro_batches(step, dp_rank, sess.layout.dims.dp, self.micro)
        return [on_device(self.collate([self.dataset[int(i)] for i in mb]), sess.device) for mb in idx]

    def __iter__(self) -> Iterator:
        sess = self.sess
        prefetch = Prefetcher(self.batches, sess.sampler.step, prefetch_depth(sess.cfg.data.prefetch, None))
        try:
            while sess.sampler.step < sess.cfg.train.steps:
                step = sess.sampler.step
                batches = prefetch.next()
                if sess.timer is None:
                    sess._begin_step()
                sess.timer.mark("data_wait_s")
                yield from batches
                if sess.sampler.step == step:
                    raise UserError("a step's micro-batches were used without sess.step() after each "
                                    "sess.backward(loss); call both for every batch")
        finally:
            prefetch.close()


def on_device(batch, device: torch.device):
    """A collated batch's tensors on the device the model trains on (in tuples, lists and dicts, as
    default_collate makes them), the rest as it is: Accelerate's prepared loader does the same. Bound for a
    GPU, each is pinned first, so that the copy does not wait for the device's queue."""
    return map_tensors(batch, lambda t: (pinned(t) if device.type == "cuda" else t).to(device, non_blocking=True))


def map_tensors(value, fn: Callable[[torch.Tensor], torch.Tensor]):
    """`value` with `fn` applied to every tensor in it (in tuples, namedtuples, lists and dicts), the rest as it
    is. A dict comes back as a shallow copy of its own type with its items set one by one: Hugging Face's
    ModelOutput, a dict whose items are also attributes, keeps them in step, and the caller's dict is left as
    it was."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        mapped = copy.copy(value)
        for key, item in value.items():
            mapped[key] = map_tensors(item, fn)
        return mapped
    if isinstance(value, (list, tuple)):
        mapped = [map_tensors(item, fn) for item in value]
        return type(value)(*mapped) if hasattr(value, "_fields") else type(value)(mapped)  # a namedtuple's fields
    return value


class UserData:
    """What a Run's hooks read of a run's data source: its spec (a user's data: no sizes)."""

    spec = DataSpec(kind="custom")
