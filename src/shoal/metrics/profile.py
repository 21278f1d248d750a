"""The step profile: where a step's seconds went, how much of the hardware it used, and which rank the
others waited for.

A step's time is split into parts that add up to it (step_time_s):
  time_data_wait_s     waiting for the prefetcher
  time_compute_s       forward and backward, less the waits below
  time_exposed_<axis>_s  waiting on the network, per mesh axis (dp, tp, pp, ep, world): only what was not
                       hidden under compute ([Note: exposed communication] in comm/log.py)
  time_bubble_s        a pipeline's idle share: the schedule's bubble fraction of forward/backward
  time_optimizer_s     clipping, the optimizer step and zero_grad, less their waits
MFU is the model's FLOPs per step (the model's own count, or torch's FLOP counter) over the step time
and the world's peak (a hardware profile: a preset, a `shoal probe` file, or measured at start).

A straggler: a rank whose compute is slow makes the others wait in the next synchronisation, so plain
per-rank step times come out equal; compute time before the synchronisation is not equalised. Each
rank sums its compute between logged steps, per even share of the global batch (under balance.mode a
rank computes more or fewer samples on purpose); the ranks gather these sums at logged steps only (riding
on the memory accounting's all-gather), and a rank at least metrics.straggler_ratio times the median
of the others is named.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shoal.config import MetricsConfig
from shoal.hardware import gpu_preset_for, profile_or_preset

AXES = ("dp", "tp", "pp", "ep", "cp", "world")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Profiler:
    """One rank's step profile: what is known at start, and its compute since the last logged step."""

    axes: tuple[str, ...]  # mesh axes this layout communicates over (size > 1)
    bubble_fraction: float
    world_size: int
    flops_per_step: float | None  # the model's training FLOPs of one global batch
    peak_flops: float | None  # of one worker
    straggler_ratio: float
    compute_since_log: float = 0.0
    steps_since_log: int = 0
    logged_step: int = 0  # the step the ranks last gathered their compute at

    def step(self, phases: dict[str, float], exposed: dict[str, dict[str, float]], step_time_s: float,
             share: float = 1.0) -> dict:
        """A step's profile metrics (clock arithmetic only). `share`: this rank's samples in the step
        against an even share of the global batch (balance.mode gives uneven ones on purpose): the
        compute the ranks compare is per even share, so a straggler is slow per sample, not per step."""
        m = step_breakdown(phases, exposed, self.axes, self.bubble_fraction)
        self.compute_since_log += m["time_compute_s"] / share if share > 0 else m["time_compute_s"]
        self.steps_since_log += 1
        if self.flops_per_step and self.peak_flops and step_time_s > 0:
            m.update(mfu(self.flops_per_step, step_time_s, self.world_size, self.peak_flops))
        return m

    def take_compute(self) -> float:
        """Mean compute seconds per step (of an even share of the batch) since the last logged step (then
        starts over)."""
        mean = self.compute_since_log / max(1, self.steps_since_log)
        self.compute_since_log, self.steps_since_log = 0.0, 0
        return mean

    def stragglers(self, compute_per_rank: list[float], step: int) -> dict:
        """The logged step's per-rank compute and, when one rank is slow, its name, how slow, and over
        which steps."""
        m: dict = {"compute_s_per_rank": compute_per_rank}
        named = name_straggler(compute_per_rank, self.straggler_ratio)
        if named:
            m["straggler_rank"], m["straggler_ratio"] = named
            m["straggler_steps"] = [self.logged_step + 1, step]
        self.logged_step = step
        return m


def step_breakdown(phases: dict[str, float], exposed: dict[str, dict[str, float]], axes: tuple[str, ...],
                   bubble_fraction: float) -> dict[str, float]:
    """The parts of one step (StepTimer's phases and their waits), adding up to the step time."""
    fb_wait = dict(exposed.get("forward_backward_s", {}))
    opt_wait = exposed.get("optimizer_s", {})
    # a pipeline stage idles while it waits for its neighbours: the schedule's bubble share of the
    # stage's time is bubble, only what it waited beyond that is exposed pp communication
    pp_wait = fb_wait.pop("pp", 0.0)
    active = max(0.0, phases.get("forward_backward_s", 0.0) - sum(fb_wait.values()))
    bubble = active * bubble_fraction
    fb_wait["pp"] = max(0.0, pp_wait - bubble)
    out = {"time_data_wait_s": phases.get("data_wait_s", 0.0),
           "time_compute_s": max(0.0, active - bubble - fb_wait["pp"]),
           "time_bubble_s": bubble,
           "time_optimizer_s": max(0.0, phases.get("optimizer_s", 0.0) - sum(opt_wait.values()))}
    for axis in AXES:
        waited = fb_wait.get(axis, 0.0) + opt_wait.get(axis, 0.0)
        if axis in axes or waited:
            out[f"time_exposed_{axis}_s"] = waited
    return out


def bubble_fraction(pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """The share of a pipeline step a stage idles: (pp - 1) / (v m + pp - 1) for m micro-batches and v
    stages per rank (GPipe and 1F1B: v = 1; Narayanan et al. 2021 for the interleaved schedule)."""
    if pp <= 1:
        return 0.0
    return (pp - 1) / (stages_per_rank * microbatches + pp - 1)


def mfu(flops_per_step: float, step_time_s: float, world_size: int, peak_flops: float) -> dict[str, float]:
    """Achieved FLOP/s of one worker (the model's FLOPs spread over the world) and its share of the peak."""
    achieved = flops_per_step / step_time_s / world_size
    return {"flops_per_s": achieved, "mfu": achieved / peak_flops}


def count_flops_per_sample(bundle_flops: float | None, build, batch: dict[str, torch.Tensor]) -> tuple[float, str]:
    """Training FLOPs of one sample and where the figure comes from: the model's own count, else torch's
    FlopCounterMode over forward and backward of `batch` on a meta-device build (`build()` -> (model,
    loss_fn)): shapes only, no arithmetic, so its cost is the counter's import (~0.4 s, it loads torch's
    compiler stack), paid once and only for models that do not count themselves."""
    if bundle_flops is not None:
        return bundle_flops, "model"
    from torch.utils.flop_counter import FlopCounterMode

    model, loss_fn = build()
    meta = {k: v.to("meta") for k, v in batch.items()}
    with FlopCounterMode(display=False) as counter:
        loss = loss_fn(model, meta)
        loss = loss[0] if isinstance(loss, tuple) else loss
        loss.float().sum().backward()
    samples = len(next(iter(batch.values())))
    return counter.get_total_flops() / samples, "flop_counter"


def resolve_peak(value: str, device: torch.device, dtype: str) -> tuple[float, str]:
    """metrics.peak -> (peak FLOP/s of one worker in `dtype`, what it is). fp8 runs count against the bf16
    peak, as torchtitan's MFU does: only their linear layers run in float8."""
    dtype = "bf16" if dtype == "fp8" else dtype
    if value != "auto":
        profile = profile_or_preset(value)
        return profile.peak_flops(dtype), profile.name
    if device.type == "cuda":
        sheet = gpu_preset_for(torch.cuda.get_device_name(device))
        if sheet:
            return sheet.peak_flops(dtype), sheet.name
    return measure_matmul_flops(device, dtype), f"measured {dtype} matmul"


@functools.lru_cache(maxsize=8)
def _measured(device: str, dtype: str, threads: int, seconds: float) -> float:
    """The best rate of short bursts of square matmuls at three sizes: at start-up the other workers on
    this machine are still importing and building, and one long measurement shares the cores with them
    (one 50 ms run of 512 x 512 read the peak ~20% low, so the default job's MFU showed 112%)."""
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sizes = (1024, 2048, 4096) if dev.type == "cuda" else (256, 512, 1024)
    best = 0.0
    for n in sizes:
        a = torch.randn(n, n, device=dev).to(DTYPES[dtype])
        b = torch.randn(n, n, device=dev).to(DTYPES[dtype])
        a @ b  # warm-up: the first call pays for the kernel's set-up
        sync()
        end = time.perf_counter() + seconds / len(sizes)
        while time.perf_counter() < end:  # bursts of ~5 ms: the best one ran with the cores to itself
            count, t0 = 0, time.perf_counter()
            while count == 0 or time.perf_counter() - t0 < 0.005:
                a @ b
                count += 1
            sync()
            best = max(best, 2 * n**3 * count / (time.perf_counter() - t0))
    return best


def measure_matmul_flops(device: torch.device, dtype: str, seconds: float = 0.15) -> float:
    """FLOP/s of a square matmul in `dtype` on this worker's threads, measured for `seconds` (a lower
    bound of the peak: what a well-shaped matmul gets here; `shoal probe` measures it at several sizes)."""
    return _measured(str(device), dtype, torch.get_num_threads(), seconds)


def name_straggler(compute_per_rank: list[float], ratio: float) -> tuple[int, float] | None:
    """The rank whose compute is the largest and at least `ratio` times the median of the other ranks'
    (the others: with two ranks the median of all would be their mean); None when no rank is."""
    if len(compute_per_rank) < 2:
        return None
    slow = max(range(len(compute_per_rank)), key=compute_per_rank.__getitem__)
    others = statistics.median(c for r, c in enumerate(compute_per_rank) if r != slow)
    if others <= 0:
        return None
    times = compute_per_rank[slow] / others
    return (slow, times) if times >= ratio else None


def summarize_profile(history: list[dict]) -> dict:
    """summary.json's profile: the median of each part of the step (the first step, which warms up,
    left out when there are more), the median MFU, a mixture of experts' median imbalance per MoE layer (the
    most any expert received over the mean, on the logged steps; under expert parallelism the ep ranks' too),
    and the ranks named stragglers."""
    steps = history[1:] or history
    keys = sorted({k for m in steps for k in m if k.startswith("time_") or k in ("flops_per_s", "mfu")})
    out = {f"median_{k}": statistics.median(m[k] for m in steps if k in m) for k in keys}
    for key in ("expert_imbalance", "ep_imbalance"):
        layers = [m[key] for m in steps if m.get(key)]
        if layers:
            per_layer = [[x for x in layer if x is not None] for layer in zip(*layers, strict=False)]
            out[f"median_{key}"] = [round(statistics.median(xs), 4) if xs else None for xs in per_layer]
    named: dict[int, dict] = {}
    for m in history:
        if "straggler_rank" in m:
            entry = named.setdefault(m["straggler_rank"], {"rank": m["straggler_rank"], "times_named": 0,
                                                           "worst_ratio": 0.0})
            entry["times_named"] += 1
            entry["worst_ratio"] = max(entry["worst_ratio"], m["straggler_ratio"])
    return {**out, "stragglers": sorted(named.values(), key=lambda e: -e["times_named"])} if out else {}


@dataclass(frozen=True)
class FlopSource:
    """Where a sample's training FLOPs come from: the model's own count, else torch's FLOP counter over
    `build()` (a meta-device (model, loss_fn)) on `batch` (count_flops_per_sample)."""

    per_sample: float | None
    build: Callable[[], tuple]
    batch: dict[str, torch.Tensor]


def start_profiler(metrics: MetricsConfig, dtype: str, device: torch.device, flops: FlopSource | None, *,
                   axes: tuple[str, ...], bubble: float, world_size: int, global_batch: int,
                   start_step: int) -> tuple[Profiler, str]:
    """The profiler of a run and the line that says what its MFU is measured against. `flops`: None where
    a sample's FLOPs are not known (a Session's model given without them); `axes`: the mesh axes the layout
    communicates over; `bubble`: the pipeline's idle share; `start_step`: the steps done."""
    per_sample, what = None, "MFU off: the model's FLOPs per sample are not known"
    try:
        if flops is not None:
            per_sample, source = count_flops_per_sample(flops.per_sample, flops.build, flops.batch)
    except Exception as e:  # noqa: BLE001 - an op the counter cannot run on meta tensors: no MFU, said why
        per_sample, what = None, f"MFU off: the model's FLOPs could not be counted ({str(e).splitlines()[0][:120]})"
    peak_flops, peak_name = resolve_peak(metrics.peak, device, dtype)
    if per_sample is not None:
        how = "the model's own count" if source == "model" else "torch's FLOP counter"
        what = (f"MFU against {peak_flops / 1e9:,.1f} GFLOP/s per worker ({peak_name}); "
                f"{per_sample / 1e9:,.3f} GFLOP per sample ({how})")
    total = per_sample * global_batch if per_sample is not None else None
    return Profiler(axes, bubble, world_size, total, peak_flops, metrics.straggler_ratio,
                    logged_step=start_step), what
