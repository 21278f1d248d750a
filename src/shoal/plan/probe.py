"""`shoal probe`: measure what this machine and its network can do, and write the hardware profile
(hardware.py) that `shoal plan` and MFU read.

One worker per process of the group, started through shoal's own launcher (launch/restart.py; `--cluster`:
one node per host of the one-machine cluster, testbed/run.py). Each worker measures
  - matmul FLOP/s per dtype over square sizes (the curve, and its best as the peak),
  - memory bandwidth (a large copy: bytes read + written per second),
  - reference training steps of the built-in GPT (reference_steps): each operator timed by operator
    and size, what a step pays per operator besides its arithmetic, and (CPU) what freshly mapped
    memory costs per byte under ZeRO 2/3's allocator setting,
  - what DTensor, DDP, a tensor-parallel layer and FSDP2 cost per operator, call, parameter tensor,
    layer or byte (parallel_overheads),
  - its resident memory after importing the training stack (what every worker holds before a model),
  - on a GPU, its memory beyond the tensors: the caching allocator's reserve over its allocated peak in the
    reference steps, the CUDA context's bytes before any collective and what NCCL's communicator adds,
and the group measures all-reduce, all-gather, reduce-scatter and point-to-point (rank pairs 2i <->
2i+1) over message sizes, issued through comm/ (each one recorded). A time is the median over the
repetitions of the slowest rank's time (a collective ends when its last rank does). How much of each it
measures depends on the device (plan/reference.py: a GPU's matmuls, copy and reference GPT are larger).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten

from shoal.allocator import THRESHOLD
from shoal.comm.collectives import Comm
from shoal.dist import DistEnv
from shoal.hardware import PROBE_LAYERS, HardwareProfile, cpu_name, line_through, this_machine
from shoal.metrics.memory import device_memory_bytes, peak_memory_bytes, status_bytes
from shoal.plan.reference import CPU_REFERENCE, Reference, Sizing, matmul_calls, reference_for, sizing

KIB = 1024
DEFAULT_SIZES = tuple(4 * KIB * 4 ** k for k in range(8))  # 4 KiB .. 64 MiB
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")


def _timed(fn, repeats: int, sync) -> float:
    """Median seconds of `fn()` over `repeats` runs after one warm-up."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_curve(dtype: torch.dtype, device: torch.device, sizes, repeats: int, sync) -> list[tuple[float, float]]:
    """[[n, FLOP/s of an n x n x n matmul], ...]: each timed sample matmul_calls(n) products in a row."""
    out = []
    for n in sizes:
        a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
        calls = matmul_calls(device.type, n)

        def products(a=a, b=b, calls=calls):
            for _ in range(calls):
                a @ b
        out.append((float(n), 2 * n ** 3 * calls / _timed(products, repeats, sync)))
    return out


def memory_bandwidth(device: torch.device, nbytes: int, repeats: int, sync) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * nbytes / _timed(lambda: dst.copy_(src), repeats, sync)  # read + write


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
    """`call` (an expression over shoal.plan.probe) evaluated in a new Python process with `env` added."""
    import json
    import subprocess
    import sys

    code = f"import json, torch; torch.set_num_threads({torch.get_num_threads()}); " \
           f"from shoal.plan.probe import *; print(json.dumps({call}))"
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


def restart_peaks(device: torch.device) -> None:
    """A GPU: the caching allocator's cached blocks freed and its peak counters restarted, so that what
    follows is measured alone."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)


def reserve_ratio(device: torch.device) -> float | None:
    """A GPU: the caching allocator's reserved peak over its allocated peak since restart_peaks (blocks
    rounded up, freed blocks kept cached, fragmentation); None where nothing was allocated."""
    allocated = torch.cuda.max_memory_allocated(device)
    return torch.cuda.max_memory_reserved(device) / allocated if allocated else None


def outside_bytes(device: torch.device) -> int:
    """A GPU: what this process holds now outside the caching allocator (metrics/memory.py)."""
    return device_memory_bytes(device)["outside"]


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


def parallel_overheads(comm: Comm, device: torch.device, repeats: int, sync, widths=REFERENCE_WIDTHS,
                       least: tuple[int, int] = (40, 8), reference: Reference = CPU_REFERENCE) -> dict[str, float]:
    """What torch's parallel wrappers cost on top of their arithmetic, over the probe's group: stacks of 4
    and 32 tiny linear layers (8 and 64 parameter tensors, messages of ~1 KiB), forward and backward,
    wrapped against bare, fitted as a cost per call and per parameter tensor. A call's cost includes its
    tiny collective as it runs between layers (~1 ms here where the same collective alone takes 0.2-0.4):
    the planner adds only what a larger message costs beyond it (hardware.py's OVERHEAD_MESSAGE_BYTES).
      dtensor_op_s        one operator on a DTensor beyond the same operator on a plain tensor (Python
                          dispatch, sharding propagation): what the optimizer of a sharded layout pays
                          per operator;
      tp_layer_s          one linear layer split by tensor parallelism (column- and row-wise in turn):
                          DTensor's wrapping, sharding propagation and redistribution around it, and
                          its all-reduce (a row-wise layer's output in forward, a column-wise layer's
                          input gradient in backward);
      ddp_sync_s, ddp_local_s, ddp_param_s
                          DistributedDataParallel per micro-batch that all-reduces, per micro-batch that
                          only accumulates (no_sync), and per parameter tensor (its autograd hook);
      fsdp_call_s, fsdp_byte_s
                          FSDP2 per collective call and per byte it moves (fsdp_costs)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel

    mesh = init_device_mesh(device.type, (comm.world_size,))
    plain = torch.ones(64, device=device)
    replicated = distribute_tensor(plain.clone(), mesh, [Replicate()])
    n = 200
    dtensor = (_timed(lambda: [replicated.mul_(1.0) for _ in range(n)], repeats, sync)
               - _timed(lambda: [plain.mul_(1.0) for _ in range(n)], repeats, sync)) / n
    x = torch.ones(2, 8, device=device)

    def stacks(wrap, quiet: bool = False) -> list[float]:
        """Per PROBE_LAYERS: seconds a wrapped stack's forward and backward takes beyond the bare
        stack's (`quiet`: inside DDP's no_sync)."""
        out = []
        for layers in PROBE_LAYERS:
            torch.manual_seed(0)
            unit, bare = (torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(layers)]).to(device)
                          for _ in range(2))
            unit = wrap(unit)

            def step(u=unit):
                with u.no_sync() if quiet else contextlib.nullcontext():
                    u(x).sum().backward()
            out.append(_extra(step, lambda b=bare: b(x).sum().backward(), comm, max(repeats, least[0]), sync))
        return out

    tensors = [2 * layers for layers in PROBE_LAYERS]  # a weight and a bias per layer
    out = {"dtensor_op_s": max(dtensor, 0.0)}
    if comm.world_size > 1:
        (sync_s, per_param), (local_s, _) = (_fit(stacks(DistributedDataParallel, quiet), tensors)
                                             for quiet in (False, True))
        out.update(ddp_sync_s=sync_s, ddp_local_s=local_s, ddp_param_s=per_param)
    split = stacks(lambda m: parallelize_module(m, mesh, {str(i): ColwiseParallel() if i % 2 == 0
                                                          else RowwiseParallel() for i in range(len(m))}))
    out["tp_layer_s"] = _fit(split, list(PROBE_LAYERS))[1]
    out.update(fsdp_costs(comm, device, max(repeats, least[1]), sync, mesh, (widths[0], widths[-1]), reference))
    return out


def _extra(wrapped, bare, comm: Comm, repeats: int, sync) -> float:
    """Seconds `wrapped()` takes beyond `bare()`: the two in turn, the median of the differences (the
    machine's drift cancels), started together on every rank."""
    comm.barrier(label="probe")
    return statistics.median(_timed(wrapped, 1, sync) - _timed(bare, 1, sync) for _ in range(repeats))


def _fit(costs: list[float], amounts: list[float], calls: int = 1) -> tuple[float, float]:
    """(seconds per call, per unit of `amount`) of a cost measured at two amounts, the first of them
    made of `calls` calls."""
    per_unit, fixed = line_through((amounts[0], costs[0]), (amounts[1], costs[1]), min_slope=0.0)
    return max(fixed, 0.0) / calls, per_unit


def fsdp_costs(comm: Comm, device: torch.device, repeats: int, sync, mesh,
               widths=(REFERENCE_WIDTHS[0], REFERENCE_WIDTHS[-1]), reference: Reference = CPU_REFERENCE
               ) -> dict[str, float]:
    """FSDP2 (ZeRO 3: every block and the root sharded, resharded after forward) on the reference GPT at
    two `widths` (the reference's narrowest and widest), forward and backward against the same model
    unsharded: the extra seconds fitted as a cost per collective call (2 blocks and the root: 5
    all-gathers, 3 reduce-scatters) and per byte gathered or reduced (copy-in, copy-out, the network).
    Stacks of tiny layers cannot show the second: on a GPT's blocks most of FSDP2's cost is per byte
    (~1.4 ns per byte here, 4-5 ms for a 3 MiB block, against ~1 ms per call)."""
    from torch.distributed.fsdp import fully_shard

    from shoal.models.gpt import Block

    x = torch.randint(0, reference.vocab, (reference.batch, reference.seq_len), device=device)

    def fwd_bwd(bundle):
        bundle.loss_fn(bundle.model, {"input": x, "target": x}).sum().backward()
        bundle.model.zero_grad(set_to_none=True)
    extra, moved = [], []
    for width in widths:
        torch.manual_seed(0)
        plain = _reference_bundle(width, device, reference)
        torch.manual_seed(0)
        sharded = _reference_bundle(width, device, reference)
        blocks = [m for m in sharded.model.modules() if isinstance(m, Block)]
        for i, block in enumerate(blocks):
            fully_shard(block, mesh=mesh, reshard_after_forward=i < len(blocks) - 1)
        fully_shard(sharded.model, mesh=mesh)
        extra.append(_extra(lambda s=sharded: fwd_bwd(s), lambda p=plain: fwd_bwd(p), comm, repeats, sync))
        block = sum(p.numel() * p.element_size() for p in plain.model.blocks[0].parameters())
        rest = sum(p.numel() * p.element_size() for p in plain.model.parameters()) - len(blocks) * block
        # gathered: each block in forward, again in backward but the last; the root twice; reduced once each
        moved.append(block * (2 * len(blocks) - 1) + 2 * rest + block * len(blocks) + rest)
    calls = (2 * len(blocks) - 1) + 2 + (len(blocks) + 1)  # the same at both widths
    call, per_byte = _fit(extra, moved, calls)
    return {"fsdp_call_s": call, "fsdp_byte_s": per_byte}


def collective_curves(comm: Comm, device: torch.device, sizes, repeats: int, sync, ops=COLLECTIVES) -> dict:
    """{op: [[message bytes, seconds], ...]} over the whole group for each of `ops`; the message is what one
    rank contributes (all-gather: its shard; reduce-scatter: the whole input it reduces)."""
    world, rank = comm.world_size, comm.rank
    curves: dict[str, list[tuple[float, float]]] = {op: [] for op in COLLECTIVES}
    for size in sizes:
        n = max(size // 4, world)
        n -= n % world  # reduce-scatter splits the input evenly
        t = torch.ones(n, device=device)
        shard = torch.ones(n // world, device=device)
        peer = rank ^ 1  # pairs 0-1, 2-3, ...
        runs = {
            "all_reduce": lambda t=t: comm.all_reduce(t, label="probe"),
            "all_gather": lambda s=shard: comm.all_gather_flat(s, label="probe"),
            "reduce_scatter": lambda t=t, s=shard: comm.reduce_scatter(s, t, label="probe"),
        }
        if world > 1 and world % 2 == 0:
            def send_recv(t=t, peer=peer):
                if rank % 2 == 0:
                    comm.send(t, peer, "probe").wait()
                    comm.recv(t, peer, "probe")
                else:
                    comm.recv(t, peer, "probe")
                    comm.send(t, peer, "probe").wait()
            runs["send_recv"] = send_recv  # a round trip: half of it is one message's time
        # small messages take 0.2 ms or, now and then, 3-4 (a peer's thread not yet scheduled): a median
        # needs more than a few of them
        times = repeats if size > 256 * KIB else max(repeats, 15)
        for op, fn in ((op, fn) for op, fn in runs.items() if op in ops):
            seconds = [_group_time(comm, fn, sync, device) for _ in range(times + 1)][1:]  # 1st warms up
            sec = statistics.median(seconds)
            # keyed by what one rank contributes, as predict.py asks: an all-gather's shard
            message = n // world * 4 if op == "all_gather" else n * 4
            curves[op].append((float(message), sec / 2 if op == "send_recv" else sec))
    return {op: envelope(pts) for op, pts in curves.items() if pts}


def envelope(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Each size's time at most any larger size's: a message's time never falls as it grows, so a small
    one measured slower than a larger one met the slow mode (here 2.5-3.7 ms against 0.3-0.7 for 16 KiB to
    1 MiB, now at one size, now at another, probe to probe) in most of its repetitions."""
    out, least = [], float("inf")
    for size, seconds in sorted(points, reverse=True):
        least = min(least, seconds)
        out.append((size, least))
    return out[::-1]


def _group_time(comm: Comm, fn, sync, device) -> float:
    """One run of `fn` started together (a barrier), timed as the slowest rank's."""
    comm.barrier(label="probe")
    t0 = time.perf_counter()
    fn()
    sync()
    took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
    comm.all_reduce(took, label="probe: slowest rank", op=torch.distributed.ReduceOp.MAX)
    return float(took.item())


def measure(env: DistEnv, sizes=DEFAULT_SIZES, repeats: int = 3, matmul_sizes=None, copy_bytes: int | None = None,
            nnodes: int = 1, widths=None, spot: bool = False) -> HardwareProfile:
    """Collective over the default group: every rank calls it; every rank gets the profile. Sized for the device
    (plan/reference.py); `matmul_sizes` (every dtype's), `copy_bytes` and `widths` replace its sizes. `spot`: what
    `shoal plan` measures when it has no profile, on a CPU in about 11 s for 2 processes here (their start
    included) instead of ~40: the reference steps' operators but not the resident memory they take (three new
    processes, ~18 s), the parallel wrappers' costs as medians of 15 repetitions (not 40), and FSDP2's of 4 (not
    8) on the two narrowest references (the widest alone took ~6 s). A GPU's collectives run after the reference
    steps (gpu_collectives). What each part took is kept as the profile's `measured_seconds`."""
    import shoal.training.train  # noqa: F401 - the training stack, imported as a worker imports it (resident memory)

    device, cuda = env.device, env.device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    base = peak_memory_bytes(device) if not cuda else None
    size, took, fields = _sizing(device.type, matmul_sizes, copy_bytes, widths), {}, {}
    ref = size.reference
    with _took(took, "matmul"):
        curves = {name: matmul_curve(DTYPES[name], device, ns, repeats, sync) for name, ns in size.matmul_sizes.items()}
    comm = Comm(env.store, env.rank, env.world_size)
    if not cuda:
        with _took(took, "collectives"):
            fields["collectives"] = collective_curves(comm, device, sizes, repeats, sync)
    # every worker measures at once, as every worker trains at once: side by side, two processes on two
    # cores ran the reference operators 5-15% slower than one alone (memory bandwidth, caches)
    together = store_barrier(env.store, env.world_size) if cuda else lambda: comm.barrier(label="probe")
    with _took(took, "reference steps"):
        fields |= _reference_fields(device, repeats, sync, ref, together, spot)
    if cuda:
        with _took(took, "collectives"):
            fields |= gpu_collectives(comm, device, sizes, repeats, sync)
    with _took(took, "parallel wrappers"):
        overheads = parallel_overheads(comm, device, repeats, sync, *((ref.widths[:2], (15, 4)) if spot
                                                                      else (ref.widths,)), reference=ref)
    with _took(took, "copy"):
        bandwidth = memory_bandwidth(device, size.copy_bytes, repeats, sync)
    return HardwareProfile(name="probe", device=device.type, nproc=env.world_size // nnodes, nnodes=nnodes,
                           matmul_flops={name: max(f for _, f in c) for name, c in curves.items()},
                           matmul_curve=curves, memory_bandwidth=bandwidth, parallel_overheads=overheads,
                           process_bytes=base, threads=torch.get_num_threads(), machine=this_machine(),
                           measured_at=time.time(), spot=spot, measured_seconds=took, **_device_fields(device),
                           **fields)


def _sizing(device_type: str, matmul_sizes=None, copy_bytes: int | None = None, widths=None) -> Sizing:
    """The device's sizing (plan/reference.py) with the sizes a caller gives in place of its own."""
    size = sizing(device_type)
    return dataclasses.replace(
        size, matmul_sizes={d: tuple(matmul_sizes) for d in size.matmul_sizes} if matmul_sizes else size.matmul_sizes,
        copy_bytes=copy_bytes or size.copy_bytes,
        reference=dataclasses.replace(size.reference, widths=tuple(widths)) if widths else size.reference)


@contextlib.contextmanager
def _took(took: dict[str, float], part: str):
    """Seconds the block took, as took[part] (added to what the part took before)."""
    t0 = time.perf_counter()
    yield
    took[part] = round(took.get(part, 0.0) + time.perf_counter() - t0, 3)


def _device_fields(device: torch.device) -> dict:
    """The device's name, and a GPU's streaming multiprocessors."""
    if device.type != "cuda":
        return {"device_name": cpu_name()}
    return {"device_name": torch.cuda.get_device_name(device),
            "multiprocessors": torch.cuda.get_device_properties(device).multi_processor_count}


def _reference_fields(device: torch.device, repeats: int, sync, reference: Reference, together,
                      spot: bool) -> dict:
    """The reference steps (reference_steps) in each of the reference's dtypes, as the profile's fields
    (step_fields); on a GPU the allocator's reserve measured with them and the host's time per operator
    where kernels are small (host_op_seconds) besides."""
    cuda = device.type == "cuda"
    steps = {dtype: reference_steps(device, repeats, sync, reference.widths, together, memory=not spot,
                                    reference=reference, dtype=dtype, reserve=cuda) for dtype in reference.dtypes}
    return step_fields(steps) | ({"host_op_s": host_op_seconds(device, repeats, sync)} if cuda else {})


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


def gpu_collectives(comm: Comm, device: torch.device, sizes, repeats: int, sync, outside=outside_bytes) -> dict:
    """A GPU's collective curves, with what the process holds outside the caching allocator before them (the
    CUDA context with the kernels loaded so far: context_bytes) and what that grew by across the all-reduces,
    all-gathers and reduce-scatters of the default group at every size (its NCCL communicator's buffers, which
    NCCL sets up at the first collective and as each new algorithm first runs: nccl_bytes). Point-to-point
    runs after them: torch's NCCL backend may make a communicator of its own for a pair of ranks."""
    context = outside(device)
    curves = collective_curves(comm, device, sizes, repeats, sync, ops=COLLECTIVES[:3])
    nccl = max(outside(device) - context, 0)
    curves |= collective_curves(comm, device, sizes, repeats, sync, ops=COLLECTIVES[3:])
    return {"collectives": curves, "context_bytes": context, "nccl_bytes": nccl}


def store_barrier(store, world: int, name: str = "probe/together"):
    """A barrier over the key-value store alone, as a callable (each call a new one): no collective runs, so
    on a GPU NCCL has made no communicator when the probe reads what the CUDA context holds."""
    count = itertools.count()

    def wait() -> None:
        key = f"{name}/{next(count)}"
        if store.add(key, 1) == world:
            store.set(f"{key}/all", "1")
        store.wait([f"{key}/all"])
    return wait


def sizes_up_to(max_bytes: int) -> tuple[int, ...]:
    return tuple(s for s in DEFAULT_SIZES if s <= max_bytes) or (DEFAULT_SIZES[0],)


def worker(out: str, sizes, repeats: int, nnodes: int, spot: bool = False) -> None:
    """One process of the group (started by `launch` below): measure, rank 0 writes the profile."""
    from shoal import dist
    from shoal.hardware import save_profile

    env = dist.init("nccl" if torch.cuda.is_available() else "gloo", 300.0)
    try:
        profile = measure(env, sizes, repeats, nnodes=nnodes, spot=spot)
        if env.rank == 0:
            save_profile(profile, out)
            if not spot:  # plan says what it measured in its own words
                print(summary_line(profile, out), flush=True)
    finally:
        dist.shutdown()


def summary_line(profile: HardwareProfile, out: str) -> str:
    flops = ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in profile.matmul_flops.items())
    ar = profile.collectives.get("all_reduce", [])
    big = f"; all-reduce of {ar[-1][0] / 2 ** 20:.2f} MiB: {ar[-1][1] * 1e3:.2f} ms" if ar else ""
    gpu = "" if profile.context_bytes is None else (
        f"; beyond the tensors: CUDA context {profile.context_bytes / 2 ** 20:.0f} MiB, NCCL "
        f"{(profile.nccl_bytes or 0) / 2 ** 20:.0f} MiB, allocator reserve x{profile.allocator_reserve or 1:.2f}")
    return (f"wrote {out}: {profile.nproc * profile.nnodes} process(es) on {profile.device_name}: {flops}; copy "
            f"{(profile.memory_bandwidth or 0) / 1e9:.1f} GB/s; {(profile.op_overhead_s or 0) * 1e6:.1f} us per "
            f"operator{big}{gpu}")


def calibrate_profile(out: str, nproc: int, busy_measuring: float | None = None, force: bool = False) -> None:
    """Add the planner's calibration to the profile at `out` (plan/calibrate.py), on this node alone, with
    the record of its checks; none where the machine was busy (`busy_measuring`: calibrate.OtherCpu's
    share over the measuring) unless `force`. A probe over a cluster's nodes (SHOAL_NNODES > 1) is not
    calibrated."""
    import os

    from shoal.hardware import load_profile, save_profile
    from shoal.plan.calibrate import CHECKS_KEY, calibrate

    if int(os.environ.get("SHOAL_NNODES", "1")) > 1:
        return
    profile = load_profile(out)
    cal = calibrate(profile, nproc, profile.threads or 1, reference_for(profile.device).widths, busy_measuring, force)
    save_profile(profile.model_copy(update={"calibration": cal.lines, CHECKS_KEY: cal.record}), out)
    print(f"wrote {out}: the planner's calibration for {', '.join(cal.lines) or 'no strategy'}", flush=True)


def launch_probe(argv: list[str], nproc: int) -> int:
    """The probe's workers through shoal's launcher: this node alone, or (on a host of the one-machine
    cluster, testbed/run.py) one node of the cluster's job, as `shoal train` runs there."""
    import os

    from shoal.launch.restart import launch

    nnodes = int(os.environ.get("SHOAL_NNODES", "1"))
    node_rank = int(os.environ.get("SHOAL_NODE_RANK", "0"))
    endpoint = os.environ.get("SHOAL_RDZV_ENDPOINT") if nnodes > 1 else None
    threads = max(1, (os.cpu_count() or 1) // nproc)
    return launch(["-m", "shoal", "probe", *argv, "--nnodes-measured", str(nnodes)], nproc, (nnodes, nnodes),
                  node_rank, endpoint, threads=threads)
