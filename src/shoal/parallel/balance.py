"""Load balancing across uneven workers (balance.mode = "throughput"): each dp rank takes a share of
the global batch proportional to its measured throughput, so a rank with half the speed gets half the
samples and nobody waits at the gradient all-reduce.

The gradient does not depend on the split: the global batch's samples are the same (a contiguous cut of
the sampler's batch, rank by rank) and every micro-batch's backward is scaled by dp / items in the whole
global batch ([Note: loss contract] in models/spec.py), whatever each rank's share. Ranks may run
different numbers of micro-batches: each reduces gradients in the backward of its own last one only
(sync.py EveryStep.reduces), so DDP's all-reduce still runs exactly once per step on every rank.

Measuring: a rank's compute time per step runs from the start of its forward/backward to the moment its
last gradient is accumulated (a post-accumulate-grad hook on every parameter), before it waits for the
other ranks in the gradient all-reduce; naive step times cannot show a straggler because that wait
equalises them. Each rank keeps an exponential moving average of its samples per second; every
`interval` steps one small all-gather over dp agrees them, and all ranks compute the same split from the
same numbers. The prefetch thread (data/loader.py) builds a step's micro-batches up to `prefetch` steps
ahead, so an agreement after step k takes effect from step k + prefetch + 1: a batch already built never
changes its split. The decided splits and the agreed throughputs are checkpointed (TrainState part
"balance"); a resumed run replays the splits already decided and re-measures from the agreed numbers.
"""

from __future__ import annotations

import contextlib
import math
import time

import torch

from shoal.comm.collectives import Comm

EMA_WEIGHT = 0.3  # weight of the newest step's throughput: a few steps of memory, quick to follow a change


def split_batch(batch: int, throughputs: list[float]) -> list[int]:
    """Samples per rank: proportional to `throughputs`, summing to `batch`, at least 1 each (largest
    remainder rounding; ties go to the lower rank, so the split is a pure function of its inputs)."""
    n = len(throughputs)
    if batch < n:
        raise ValueError(f"a global batch of {batch} cannot give each of {n} dp ranks a sample")
    if any(not math.isfinite(x) or x <= 0 for x in throughputs):
        raise ValueError(f"throughputs must be positive and finite, got {throughputs}")
    # a rank too slow for one sample in proportion still gets one (a rank without work would have no
    # gradient to all-reduce); the others share the rest in proportion
    floor_one: set[int] = set()
    while True:
        rest = [r for r in range(n) if r not in floor_one]
        left, total = batch - len(floor_one), sum(throughputs[r] for r in rest)
        ideal = {r: left * throughputs[r] / total for r in rest}
        short = {r for r in rest if ideal[r] < 1}
        if not short:
            break
        floor_one |= short
    counts = [1 if r in floor_one else math.floor(ideal[r]) for r in range(n)]
    by_remainder = sorted(rest, key=lambda r: (-(ideal[r] - math.floor(ideal[r])), r))
    for r in by_remainder[:batch - sum(counts)]:
        counts[r] += 1
    return counts


class ComputeClock:
    """Times one rank's compute of a step: from start() to its last accumulated gradient, which on DDP
    comes before the wait for the gradient all-reduce (the all-reduce completes in the backward's final
    callback, after every parameter's gradient is in). On CUDA the hooks record events on the stream,
    so the time is the device's, not the time the kernels were queued."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.cuda = device.type == "cuda"
        self._start = self._last = None
        self._handles = [p.register_post_accumulate_grad_hook(self._mark)
                         for p in model.parameters() if p.requires_grad]

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _mark(self, _param: torch.Tensor) -> None:
        self._last = self._now()

    def start(self) -> None:
        self._start, self._last = self._now(), None

    def seconds(self) -> float | None:
        """Compute seconds since start(); None when no gradient was accumulated."""
        if self._last is None:
            return None
        if self.cuda:
            self._last.synchronize()
            return self._start.elapsed_time(self._last) / 1000
        return self._last - self._start

    def close(self) -> None:
        for h in self._handles:
            h.remove()


class ThroughputBalance:
    """The split of every step's global batch over the dp ranks, and the measurements that decide it."""

    def __init__(self, batch: int, dp: int, dp_rank: int, *, interval: int, lag: int, comm: Comm, dp_group,
                 clock: ComputeClock | None, device: torch.device | str = "cpu"):
        self.batch, self.dp, self.dp_rank, self.interval, self.lag = batch, dp, dp_rank, interval, lag
        self.comm, self.dp_group, self.clock, self.device = comm, dp_group, clock, device  # nccl: a CUDA tensor
        # (first step, samples per rank) in step order: each split holds until the next one's first step
        self.splits: list[tuple[int, list[int]]] = [(0, split_batch(batch, [1.0] * dp))]
        self.agreed: list[float] | None = None  # every rank's samples/s at the last agreement
        self.mine: float | None = None  # this rank's moving average since
        self.last_s: float | None = None  # this rank's compute seconds in the last step

    def split_for(self, step: int) -> list[int]:
        """Samples per dp rank in training step `step` (0-based); read by the prefetch thread."""
        splits = self.splits  # replaced, never mutated in place: the prefetch thread reads a whole list
        return next(counts for first, counts in reversed(splits) if first <= step)

    @contextlib.contextmanager
    def measuring(self, step: int):
        """Around step `step`'s forward/backward on this rank: its compute time is measured."""
        self.start()
        yield
        self.measured(step)

    def start(self) -> None:
        if self.clock:
            self.clock.start()

    def measured(self, step: int) -> None:
        """Step `step` (0-based)'s forward/backward is done on this rank."""
        seconds = self.clock.seconds() if self.clock else None
        self.last_s = seconds
        if step == 0 or not seconds or seconds <= 0:  # the first step pays for warm-up, not for samples
            return
        rate = self.split_for(step)[self.dp_rank] / seconds
        self.mine = rate if self.mine is None else (1 - EMA_WEIGHT) * self.mine + EMA_WEIGHT * rate

    def after_step(self, done: int) -> dict:
        """Collective over dp every `interval` steps: agree the throughputs and decide the split from
        step done + lag on. Returns what the step's metrics record."""
        m = {"batch_share": self.split_for(done - 1)}
        if self.last_s is not None:
            m["compute_s"] = self.last_s
        if done % self.interval or self.dp == 1:
            return m
        mine = torch.tensor([self.mine if self.mine else math.nan], dtype=torch.float64, device=self.device)
        rates = self.comm.all_gather_flat(mine, group=self.dp_group, label="dp, throughputs for the split").tolist()
        if all(math.isfinite(x) and x > 0 for x in rates):  # every rank has measured at least one step
            self.agreed = rates
            # splits of steps before `done` are spent: keep the one in force now and those still to come
            now = max(i for i, (first, _) in enumerate(self.splits) if first <= done)
            self.splits = [*self.splits[now:], (done + self.lag, split_batch(self.batch, rates))]
            m["rank_samples_per_s"] = rates
        return m

    def state_dict(self) -> dict:
        return {"dp": self.dp, "batch": self.batch, "splits": [[f, c] for f, c in self.splits], "agreed": self.agreed}

    def load_state_dict(self, state: dict) -> None:
        if state.get("dp") != self.dp or state.get("batch") != self.batch:  # another layout: measure afresh
            return
        self.splits = [(int(f), [int(x) for x in c]) for f, c in state["splits"]]
        self.agreed = state.get("agreed")
        self.mine = self.agreed[self.dp_rank] if self.agreed else None
