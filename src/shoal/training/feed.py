"""Where each step's micro-batches come from, and when training ends.

The loop (loop.py) asks a Feed, before each step, whether one follows (`more`), then for its
micro-batches (`next`: the wait for them is the step's data wait), and after it whether it was the
last (`last`: the step that validates, saves and ends the run). `Steps` is the usual feed: the
sampler's global batch of each step up to train.steps, this rank's share cut into micro-batches and
prepared ahead by a thread. A way of training that is fed otherwise brings its own (an asynchronous
parameter server's workers train the units of data its servers deal: ps/strategies.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from shoal.data.loader import Prefetcher
from shoal.data.sampler import GlobalBatchSampler
from shoal.models.spec import Batch


class Feed(Protocol):
    def more(self) -> bool:
        """Whether another step follows."""

    def next(self) -> list[Batch]:
        """That step's micro-batches (this rank's share)."""

    def release(self) -> None:
        """The step's last backward began: the host is free to prepare a batch ahead (Prefetcher.release)."""

    def last(self) -> bool:
        """Asked after a step: whether it was the last one."""

    def restart(self, step: int) -> None:
        """Go on from step `step` (a rollback moved the sampler back)."""

    def close(self) -> None: ...


class Steps:
    """The sampler's steps from its position up to `steps`; `make(step)` builds a step's micro-batches,
    `depth` steps ahead on a thread (data.prefetch)."""

    def __init__(self, sampler: GlobalBatchSampler, steps: int, make: Callable[[int], list[Batch]], depth: int):
        self.sampler, self.steps, self.make, self.depth = sampler, steps, make, depth
        self.loader: Prefetcher | None = None  # started by the first next()

    def more(self) -> bool:
        return self.sampler.step < self.steps

    def next(self) -> list[Batch]:
        if self.loader is None:
            self.loader = Prefetcher(self.make, self.sampler.step, self.depth)
        return self.loader.next()

    def release(self) -> None:
        if self.loader is not None:
            self.loader.release()

    def last(self) -> bool:
        return self.sampler.step == self.steps

    def restart(self, step: int) -> None:
        self.close()
        self.loader = Prefetcher(self.make, step, self.depth)

    def close(self) -> None:
        if self.loader is not None:
            self.loader.close()


@dataclass
class Prepared:
    """A step's micro-batches ready for the device, and the items (tokens or samples) in them."""

    batches: list[Batch]
    items: int


def prepare(micro_batches: list[Batch], count_fn: Callable[[Batch], torch.Tensor], device: torch.device) -> Prepared:
    """Counted on the host, before the device sees them (so the step never asks the device how many items it
    trained on), made contiguous, and pinned where they go to a GPU, so that copying them there does not wait
    for the device. Run by the data thread (data.prefetch), ahead of the step."""
    items = sum(int(count_fn(b)) for b in micro_batches)
    pin = device.type == "cuda"
    batches = [{k: pinned(v.contiguous()) if pin else v.contiguous() for k, v in b.items()} for b in micro_batches]
    return Prepared(batches, items)


def pinned(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_pinned() else t.pin_memory()
