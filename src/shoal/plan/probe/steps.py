"""The reference GPT's training steps (plan/reference.py) timed operator by operator (OpTimer): each
operator's rate by size, what a step pays per operator besides its arithmetic, and on a CPU what its memory
costs (the resident set's growth, freshly mapped pages); as the profile's fields (step_fields)."""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten

from shoal.allocator import THRESHOLD
from shoal.hardware import line_through
from shoal.metrics.memory import status_bytes
from shoal.plan.probe.compute import DTYPES, _timed
from shoal.plan.probe.gpu_memory import reserve_ratio, restart_peaks
from shoal.plan.reference import CPU_REFERENCE, Reference

REFERENCE_WIDTHS = CPU_REFERENCE.widths  # d_model of the CPU's reference GPT: tensors from ~64 KiB to ~4 MiB


@dataclass
class StepCosts:
    """What the reference training steps measured (see reference_steps)."""

    op_rates: dict[str, list[tuple[float, float]]]
    op_flop_rates: dict[str, list[tuple[float, float]]]
    op_overhead_s: float
    fresh_memory_s_per_byte: float | None
    heap_fixed_bytes: float | None  # CPU: the resident set's growth in training = fixed + ratio x tensors
    heap_ratio: float | None
    allocator_reserve: float | None = None  # a GPU: the caching allocator's reserved peak / allocated peak


def _reference_bundle(width: int, device: torch.device, reference: Reference = CPU_REFERENCE):
    """The reference GPT (plan/reference.py): 2 blocks of `width`; on a CPU 4 heads, 128 tokens, byte vocabulary."""
    from shoal.models.gpt import GPTConfig, build
    from shoal.models.spec import DataSpec

    bundle = build(GPTConfig(n_layer=2, n_head=reference.heads(width), d_model=width, seq_len=reference.seq_len),
                   DataSpec(kind="tokens", vocab_size=reference.vocab))
    bundle.model.to(device)
    return bundle


def _autocast(device: torch.device, dtype: str):
    """The context the forward and loss run in: none for fp32, autocast to `dtype` otherwise."""
    if dtype == "fp32":
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=DTYPES[dtype])


def _reference_step(width: int, device: torch.device, repeats: int, reference: Reference = CPU_REFERENCE,
                    dtype: str = "fp32"):
    """One training step of the reference GPT at `width` as a callable of the step's index; `dtype` bf16 or
    fp16: its forward and loss under autocast, as a GPU user trains."""
    torch.manual_seed(0)
    bundle = _reference_bundle(width, device, reference)
    model = bundle.model
    # on a GPU, torch's fused AdamW, as shoal trains there (training/optim.py): one kernel for every tensor
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if device.type == "cuda" else {}))
    data = torch.randint(0, reference.vocab, (repeats + 3, reference.batch, reference.seq_len), device=device)
    cast = _autocast(device, dtype)

    def step(i: int) -> None:
        x = data[i % len(data)]
        with cast():
            loss = bundle.loss_fn(model, {"input": x, "target": x}).sum()
        loss.backward()
        # clipped as parallel/clip.py clips, one tensor at a time as the planner's meta trace sees it
        # (a CPU's foreach kernels loop over the same per-tensor kernels)
        grads = [p.grad for p in model.parameters()]
        norm = torch.nn.utils.get_total_norm(grads, foreach=False)
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), 1.0, norm, foreach=False)
        opt.step()
        opt.zero_grad(set_to_none=True)
    step(0)  # makes the optimizer's state
    return step


def _wall(step, repeats: int, sync) -> float:
    steps = iter(range(1, 10 ** 9))
    return _timed(lambda: step(next(steps)), max(repeats, 5), sync)


def reference_walls(repeats: int, widths=REFERENCE_WIDTHS) -> list[float]:
    """Median seconds of a CPU reference step at each width, in this process."""
    return [_wall(_reference_step(w, torch.device("cpu"), repeats), repeats, lambda: None) for w in widths]


def reference_heap(repeats: int, width: int) -> int:
    """Bytes the resident set grows by (its high-water mark) from before building the reference GPT at
    `width` through its training steps, in this process: what the model state and activations cost on
    CPU with the C library's heap as a worker has it. From after importing the training stack, where
    the profile's process_bytes is measured."""
    import shoal.training.train  # noqa: F401 - as measure() imports it before reading process_bytes

    before = status_bytes("VmRSS")
    _wall(_reference_step(width, torch.device("cpu"), repeats), repeats, lambda: None)
    return status_bytes("VmHWM") - before


def reference_live_bytes(width: int) -> int:
    """What the planner counts of the reference GPT at `width` in training (plan/predict.py): parameters,
    gradients and AdamW's two moments in fp32, the activations autograd saves for a batch of 4 x 128 and
    the largest tensor, traced on the meta device."""
    from shoal.models.meta import on_meta
    from shoal.plan.cost import trace_micro_batch

    with on_meta():
        bundle = _reference_bundle(width, torch.device("meta"))
    x = torch.zeros(4, 128, dtype=torch.long, device="meta")
    cost = trace_micro_batch(bundle, {"input": x, "target": x}, bundle.block_types)
    return 4 * 4 * sum(p.numel() for p in bundle.model.parameters()) + cost.activation_bytes(False) + cost.largest


def _in_new_process(call: str, env: dict):
    """`call` (an expression over shoal.plan.probe.steps) evaluated in a new Python process with `env` added."""
    import json
    import subprocess
    import sys

    code = f"import json, torch; torch.set_num_threads({torch.get_num_threads()}); " \
           f"from shoal.plan.probe.steps import *; print(json.dumps({call}))"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.splitlines()[-1])


def reference_steps(device: torch.device, repeats: int, sync, widths=REFERENCE_WIDTHS, together=lambda: None,
                    memory: bool = True, reference: Reference = CPU_REFERENCE, dtype: str = "fp32",
                    reserve: bool = False) -> StepCosts:
    """Training steps of the built-in GPT (`reference`: on a CPU 2 blocks, 4 sequences of 128 tokens; a new
    batch each step: forward, backward, gradient clipping, AdamW, zero_grad) at each of `widths`, the
    forward and loss in `dtype` (_reference_step), measured four ways:
      - every operator timed one call at a time: those with FLOPs (matmuls) as {aten name: [[FLOPs,
        FLOP/s], ...]}: the model's rectangular and transposed matmuls run ~10% below the square ones of
        the matmul curve; the others (element-wise, norms, softmax, attention, the optimizer's updates)
        as {aten name: [[bytes moved, bytes per second], ...]}: a large copy's bandwidth alone
        mispredicts them both ways: gelu's backward evaluates erf and exp per element (~1.5x slower than
        a copy of its bytes here) while the updates of tensors that fit in cache run faster.
      - the whole step's wall time against the sum of its operators' times: what a step pays per
        operator besides its arithmetic (Python, modules, the autograd engine, allocation, launches);
      - on CPU, how far the resident set grows in a new process training each width, against the bytes
        the planner counts for it (reference_live_bytes): a fixed part and a ratio;
      - on CPU, the step in a new process with glibc's mmap threshold fixed from its start, as ZeRO 2/3
        workers fix it (allocator.py), against a new process without: every tensor over 64 KiB is then
        freshly mapped and its pages faulted in; the extra seconds per byte so allocated. (Set in a
        process that has already grown its heap, the threshold changes little: malloc serves requests
        from the freed heap first. Measured here: +3% against +39% from the start.)
    `reserve` (a GPU): the caching allocator's peaks restarted before each width, and at the widest its
    reserved peak over its allocated peak (reserve_ratio) kept as StepCosts.allocator_reserve."""
    by_op: dict[str, list] = defaultdict(list)
    by_flops: dict[str, list] = defaultdict(list)
    overheads, allocs, reserves = [], [], []
    for width in widths:
        if reserve:
            restart_peaks(device)
        timer, overhead, floor = _time_width(width, device, repeats, sync, together, reference, dtype)
        reserves.append(reserve_ratio(device) if reserve else None)
        allocs.append(timer.allocated)
        overheads.append(overhead)
        _add_rates(timer, floor, by_op, by_flops)
    fresh, heap_fit = _memory_costs(repeats, widths, allocs, together) if memory and device.type == "cpu" \
        else (None, (None, None))
    # the narrowest reference's: its operators are too small for cache misses to add to their time
    return StepCosts({name: _merge(points) for name, points in sorted(by_op.items())},
                     {name: _merge(points) for name, points in sorted(by_flops.items())}, overheads[0], fresh,
                     *heap_fit, allocator_reserve=reserves[-1])


def _add_rates(timer: OpTimer, floor: float, by_op: dict[str, list], by_flops: dict[str, list]) -> None:
    """Each operator's calls timed by `timer` as (amount, rate) points: FLOPs and FLOP/s for those with FLOPs,
    bytes and bytes per second for the others; `floor` (what any call pays) taken off each call's time."""
    for (name, amount, flops, _), times in timer.kernel.items():
        if amount > 0:
            (by_flops if flops else by_op)[name].append((amount, amount / max(statistics.median(times) - floor, 1e-9)))


def _time_width(width: int, device: torch.device, repeats: int, sync, together, reference: Reference,
                dtype: str) -> tuple[OpTimer, float, float]:
    """The reference GPT at `width` built, every rank ready (`together`), `repeats` steps timed operator by
    operator, then the steps' wall time: the OpTimer, and OpTimer.overhead's per-operator cost and floor."""
    step = _reference_step(width, device, repeats, reference, dtype)
    together()
    timer = OpTimer(sync)
    for i in range(repeats):
        with timer.step():
            step(i + 1)
    return timer, *timer.overhead(_wall(step, repeats, sync))


def host_op_seconds(device: torch.device, repeats: int, sync, dtype: str = "bf16") -> float:
    """A GPU's host time per operator where kernels are small: the CPU's narrowest reference GPT (2 blocks of
    128, 4 sequences of 128 tokens) stepped on the GPU in `dtype`, whose kernels take microseconds, so that
    the step's wall time is the host's (Python, dispatch, the autograd engine, launches) while the GPU waits;
    over the operators the planner counts (views cost host time too, but run no kernel and are not counted)."""
    step = _reference_step(CPU_REFERENCE.widths[0], device, repeats, CPU_REFERENCE, dtype)
    timer = OpTimer(sync)
    with timer.step():
        step(1)
    return _wall(step, repeats, sync) / len(timer.kernel)


class OpTimer:
    """Times every operator of a step one call at a time (a dispatch mode; `sync` waits for the device):
    call i of every step together, by FLOPs (matmuls, attention) or bytes moved, and the bytes of outputs
    over the mmap threshold (those ZeRO 2/3's allocator setting maps freshly)."""

    def __init__(self, sync):
        self.sync = sync
        self.kernel: dict[tuple[str, float, bool, int], list[float]] = defaultdict(list)
        self.allocated = 0  # in the last step timed

    @contextlib.contextmanager
    def step(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        from shoal.plan.cost import describe_op

        timer, call = self, [0]
        self.allocated = 0

        class Timed(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                timer.sync()
                t0 = time.perf_counter()
                out = func(*args, **kwargs)
                timer.sync()
                took = time.perf_counter() - t0
                op = describe_op(func, args, kwargs, out)
                if op is not None:
                    timer.kernel[(op[0], op[1] or op[2], bool(op[1]), call[0])].append(took)
                    timer.allocated += sum(t.numel() * t.element_size() for t in tree_flatten(out)[0]
                                           if isinstance(t, torch.Tensor) and t.numel() * t.element_size() > THRESHOLD)
                call[0] += 1
                return out

        with Timed():
            yield

    def overhead(self, wall: float) -> tuple[float, float]:
        """What a step of `wall` seconds pays per operator besides its arithmetic, and the smallest call's
        time (what any call pays with nothing to move: counted in the overhead, taken off each rate so that a
        rate is of the bytes alone). Per operator the planner counts: views run no kernel and are not in its
        trace, so what their dispatch costs is spread over the rest (here ~540 of ~750 calls a step)."""
        medians = [statistics.median(t) for t in self.kernel.values()]
        floor = min(medians)
        return max(wall - sum(medians), 0.0) / len(self.kernel) + floor, floor


def _memory_costs(repeats: int, widths, allocs: list[int], together) -> tuple[float, tuple[float, float]]:
    """CPU: the seconds per byte freshly mapped under ZeRO 2/3's allocator setting (the reference steps in a
    new process with the mmap threshold fixed from its start, against one without), and how the resident
    set grows against the bytes the planner counts (a fixed part and a ratio)."""
    together()
    plain = _in_new_process(f"reference_walls({repeats}, {tuple(widths)})", {})
    together()
    mapped = _in_new_process(f"reference_walls({repeats}, {tuple(widths)})", {"MALLOC_MMAP_THRESHOLD_": str(THRESHOLD)})
    together()
    heap = [(_in_new_process(f"reference_heap({repeats}, {w})", {}), reference_live_bytes(w))
            for w in (widths[0], widths[-1])]
    fresh = max(statistics.median((m - p) / max(a, 1) for m, p, a in zip(mapped, plain, allocs, strict=True)), 0.0)
    # the resident set grows by a fixed amount (the first step's one-time allocations) and by more than the
    # tensors themselves (the heap keeps what it freed in pieces): fitted over the widths
    ratio, fixed = line_through(heap[0][::-1], heap[-1][::-1], 0.5, 3.0)  # ratio measured ~0.9 here
    return fresh, (max(fixed, 0.0), ratio)


def _merge(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """One point per size: the calls of that size together (their harmonic mean rate, the amount over the
    summed time), since the planner adds up every call's time. Calls of one size differ: a matmul's
    forward and its two backward products have the same FLOPs and different layouts; a median rate
    would price all three as the middle one."""
    sizes: dict[float, list[float]] = {}
    for nbytes, rate in points:
        sizes.setdefault(nbytes, []).append(rate)
    return [(b, len(r) / sum(1 / x for x in r)) for b, r in sorted(sizes.items())]


def step_fields(steps: dict[str, StepCosts]) -> dict:
    """The profile's fields from the reference steps by dtype: fp32's (a plain step) as op_rates,
    op_flop_rates and op_overhead_s, with a CPU's heap and fresh-memory costs; every other dtype's (the forward
    and loss under autocast) under op_rates_by_dtype, op_flop_rates_by_dtype and op_overhead_s_by_dtype,
    keyed by its name ("bf16"), each as its fp32 counterpart is (the bytes those kernels move, in the dtype
    they ran in); the allocator's reserve of the last dtype that measured one."""
    plain = steps["fp32"]
    out = {"op_rates": plain.op_rates, "op_flop_rates": plain.op_flop_rates, "op_overhead_s": plain.op_overhead_s,
           "fresh_memory_s_per_byte": plain.fresh_memory_s_per_byte, "heap_fixed_bytes": plain.heap_fixed_bytes,
           "heap_ratio": plain.heap_ratio}
    cast = {dtype: s for dtype, s in steps.items() if dtype != "fp32"}
    if cast:
        out |= {"op_rates_by_dtype": {d: s.op_rates for d, s in cast.items()},
                "op_flop_rates_by_dtype": {d: s.op_flop_rates for d, s in cast.items()},
                "op_overhead_s_by_dtype": {d: s.op_overhead_s for d, s in cast.items()}}
    reserves = [s.allocator_reserve for s in steps.values() if s.allocator_reserve is not None]
    return out | ({"allocator_reserve": reserves[-1]} if reserves else {})
