"""Pipeline parallelism on torch.distributed.pipelining: the model's layers split into contiguous
stages, one per pp rank (or several, interleaved), micro-batches flowing through by a schedule.

  gpipe             all forwards, then all backwards (Huang et al. 2019): simplest, most activations
  1f1b              one forward one backward once the pipeline is full (Narayanan et al. 2019): the
                    same bubble, at most pp micro-batches of activations held
  interleaved-1f1b  each rank holds v stages (virtual stages, round-robin): the bubble shrinks by v,
                    at the price of v times the point-to-point traffic (Narayanan et al. 2021)

Idle ("bubble") fraction with p ranks, m micro-batches, v stages per rank: (p-1) / (v m + p - 1).
The split balances a per-layer cost, the model's declared forward FLOPs or each layer's forward and
backward time measured at start (parallel.pp_balance), unless parallel.pp_split gives the number of
layers of each stage.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import time
from copy import deepcopy
from dataclasses import dataclass

import torch

from shoal.errors import UserError

# parallel.pp_schedule -> torch.distributed.pipelining's class (imported when a pipeline is built: the
# checks before launch need only the split, and the import costs about 0.4 s)
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B"}


def balanced_split(costs: list[float], stages: int) -> list[int]:
    """Layers per stage: the contiguous split of `costs` into `stages` non-empty runs whose largest
    total is smallest (the classic linear-partition dynamic programme); ties go to earlier stages."""
    return list(_balanced_split(tuple(costs), stages))


@functools.lru_cache(maxsize=1024)  # shoal plan asks the same split for every ZeRO stage, micro-batch, ...
def _balanced_split(costs: tuple[float, ...], stages: int) -> tuple[int, ...]:
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot split {n} layers into {stages} stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: smallest largest-stage cost splitting the first i layers into s stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], prefix[i] - prefix[j])
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    sizes, i = [], n
    for s in range(stages, 0, -1):
        sizes.append(i - cut[s][i])
        i = cut[s][i]
    return tuple(sizes[::-1])


def measure_layer_times(build_stage, n_layers: int, batch: dict, output_loss, device: torch.device,
                        context=contextlib.nullcontext, repeats: int = 3) -> list[float]:
    """Seconds of forward + backward of each layer on one micro-batch: the fastest of `repeats` passes
    after a warm-up pass (being descheduled only adds time: on a loaded machine a 0.5 ms layer was timed
    at 25 ms in 2 of 3 passes, so their median made it look 50 times its cost). Layers run one at a time,
    each on the previous one's output (detached), so only one layer and its activations are alive (a model
    laid out on the meta device is timed on a real copy of each layer in turn); the last layer's backward
    starts from its loss. `context` wraps each layer's forward and backward (a tensor-parallel loss needs its
    own). Gradients are dropped and buffers (a norm's running statistics) restored afterwards: timing trains
    nothing."""
    times: list[float] = []
    x = batch["input"].to(device)
    for i in range(n_layers):
        layer = build_stage(i, i + 1)
        if any(t.is_meta for t in itertools.chain(layer.parameters(), layer.buffers())):
            layer = _scratch_copy(layer, device)
        buffers = [(b, b.detach().clone()) for b in layer.buffers()]
        passes = []
        for rep in range(repeats + 1):
            inp = x.detach().requires_grad_() if x.is_floating_point() else x
            _synchronize(device)
            start = time.perf_counter()
            with context():
                out = layer(inp)
                if i == n_layers - 1:
                    output_loss(out, batch["target"].to(device)).backward()
                else:
                    out.backward(torch.ones_like(out))
            _synchronize(device)
            if rep:
                passes.append(time.perf_counter() - start)
        times.append(min(passes))
        x = out.detach()
        for param in layer.parameters():
            param.grad = None
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
    return times


def _scratch_copy(layer: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """A real copy of a meta layer with arbitrary weights of the usual scale, for timing only (the time of
    its arithmetic does not depend on the values; a generator of its own leaves the run's untouched)."""
    from shoal.models.meta import materialize

    copy = materialize(deepcopy(layer), device)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for t in copy.parameters():
            local = t.to_local() if hasattr(t, "to_local") else t
            local.normal_(0.0, 0.02, generator=generator)
    return copy


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bubble_fraction(pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    return (pp - 1) / (stages_per_rank * microbatches + pp - 1)


@dataclass
class StageSplit:
    sizes: list[int]  # layers per stage, over all stages (pp x stages per rank)
    names: list[str]
    costs: list[float]
    stages_per_rank: int
    basis: str = "forward FLOPs"  # what the costs are; "time": seconds per micro-batch, measured

    def bounds(self, stage: int) -> tuple[int, int]:
        first = sum(self.sizes[:stage])
        return first, first + self.sizes[stage]

    def describe(self, pp: int, microbatches: int, schedule: str) -> str:
        lines = [f"pipeline: {len(self.sizes)} stages on {pp} ranks ({schedule}, {microbatches} micro-batches); "
                 f"expected bubble {bubble_fraction(pp, microbatches, self.stages_per_rank):.0%}"]
        total = sum(self.costs) or 1.0
        for s in range(len(self.sizes)):
            first, last = self.bounds(s)
            names = self.names[first] if last - first == 1 else f"{self.names[first]} .. {self.names[last - 1]}"
            cost = sum(self.costs[first:last])
            what = f"{cost * 1e3:.1f} ms forward + backward" if self.basis == "time" else self.basis
            lines.append(f"  stage {s} (pp rank {s % pp}): {names}; {cost / total:.0%} of the cost ({what})")
        return "\n".join(lines)


def split_stages(names: list[str], costs: list[float], pp: int, schedule: str, stages_per_rank: int,
                split: list[int], basis: str = "forward FLOPs") -> StageSplit:
    """Check and decide the split; every error names the key and the numbers."""
    v = stages_per_rank if schedule == "interleaved-1f1b" else 1
    stages = pp * v
    if stages > len(names):
        raise UserError(f"parallel.pp ({pp}){f' x parallel.pp_stages_per_rank ({v})' if v > 1 else ''} = {stages} "
                        f"stages, but the model has only {len(names)} layers to split ({', '.join(names)})")
    if split:
        if len(split) != stages or sum(split) != len(names) or min(split) < 1:
            raise UserError(f"parallel.pp_split = {split} must give {stages} stages of at least one layer each, "
                            f"adding up to the model's {len(names)} layers")
        sizes = list(split)
    else:
        sizes = balanced_split(costs, stages)
    return StageSplit(sizes, names, costs, v, basis)


def build_schedule(stage_modules: list[torch.nn.Module], stage_ids: list[int], num_stages: int, device,
                   group, schedule: str, microbatches: int, loss_fn):
    """The torch pipelining schedule over this rank's stage modules. Gradients are not rescaled by the
    schedule: loss_fn already returns the loss scaled for the global batch ([Note: loss contract])."""
    from torch.distributed import pipelining

    stages = [pipelining.PipelineStage(m, i, num_stages, device, group=group)
              for m, i in zip(stage_modules, stage_ids, strict=True)]
    cls = getattr(pipelining, SCHEDULES[schedule])
    if schedule == "interleaved-1f1b":
        return cls(stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False), stages
    return cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False), stages


class StageUnion(torch.nn.Module):
    """This rank's stage modules as one module carrying the whole model's parameter names, for the
    optimizer, checkpoints and memory accounting (interleaving gives a rank several stages). Children of
    the same name that are ModuleDicts (a GPT's blocks) are merged."""

    def __init__(self, stages: list[torch.nn.Module]):
        super().__init__()
        for stage in stages:
            for name, child in stage.named_children():
                mine = getattr(self, name, None)
                if isinstance(mine, torch.nn.ModuleDict) and isinstance(child, torch.nn.ModuleDict):
                    mine.update(child)
                elif mine is None:
                    self.add_module(name, torch.nn.ModuleDict(dict(child.items())) if isinstance(
                        child, torch.nn.ModuleDict) else child)


class Pipeline:
    """One rank's part of the pipeline: its stages, the schedule, and the loss of the last stage."""

    def __init__(self, modules: list[torch.nn.Module], stage_ids: list[int], split: StageSplit, device, group,
                 schedule: str, microbatches: int, output_loss, carried=None):
        self.modules, self.output_loss, self.microbatches = modules, output_loss, microbatches
        self.carried = carried  # PipelineLayers.carried: losses the layers add on every stage
        self.split = split
        num_stages = len(split.sizes)
        self.first, self.last = 0 in stage_ids, num_stages - 1 in stage_ids
        self.scale = 1.0
        self.losses: list[torch.Tensor] = []  # unscaled loss sums of the micro-batches of one call
        self.schedule, self.stages = build_schedule(modules, stage_ids, num_stages, device, group, schedule,
                                                    microbatches, self._loss)

    def _loss(self, output, target):
        loss = self.output_loss(output, target)
        self.losses.append(loss.detach())
        return loss * self.scale

    def run(self, batch: dict, scale: float | torch.Tensor | None) -> torch.Tensor:
        """Forward and backward of the per-rank batch (or forward only, scale None); returns the sum of
        the unscaled losses on the last stage (zero elsewhere)."""
        self.losses = []
        self.scale = 1.0 if scale is None else scale
        # contiguous: a batch's input and target are often views of one (B, T + 1) token tensor, and the
        # schedules of torch 2.11 and 2.12 check each call's input strides against their first call's
        args = (batch["input"].contiguous(),) if self.first else ()
        if self.first and "positions" in batch:  # parallel.cp: each sample's positions, split with it
            args += (batch["positions"].contiguous(),)
        target = batch["target"].contiguous() if self.last else None
        if scale is None:
            with torch.no_grad():
                self.schedule.eval(*args, target=target)
        else:
            if self.carried is not None:
                self.carried.start(self.scale)
            self.schedule.step(*args, target=target)
        # the schedule's first call (and its first after switching between step and eval) also runs
        # the loss once on its shape-inference pass, on meaningless values: the real ones come last
        real = self.losses[-self.microbatches:]
        return torch.stack(real).sum() if real else torch.zeros(())
