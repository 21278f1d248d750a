"""`shoal probe`: measure what this machine and its network can do, and write the hardware profile
(hardware.py) that `shoal plan` and MFU read.

One worker per process of the group, started through shoal's own launcher (launch.py; `--cluster`:
one node per host of the one-machine cluster, cluster/run.py). Each worker measures
  - matmul FLOP/s per dtype over square sizes (the curve, and its best as the peak),
  - memory bandwidth (a large copy: bytes read + written per second),
  - the cost of one small operator (what a step of many small kernels pays per op),
  - its resident memory after importing the training stack (what every worker holds before a model),
and the group measures all-reduce, all-gather, reduce-scatter and point-to-point (rank pairs 2i <->
2i+1) over message sizes, issued through comm/ (each one recorded). A time is the median over the
repetitions of the slowest rank's time (a collective ends when its last rank does).
"""

from __future__ import annotations

import statistics
import time

import torch

from shoal.comm.collectives import Comm
from shoal.dist import DistEnv
from shoal.hardware import HardwareProfile
from shoal.metrics.memory import peak_memory_bytes

KIB = 1024
DEFAULT_SIZES = tuple(4 * KIB * 4 ** k for k in range(8))  # 4 KiB .. 64 MiB
MATMUL_SIZES = (128, 256, 512, 1024)
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
    """[[n, FLOP/s of an n x n x n matmul], ...]."""
    out = []
    for n in sizes:
        a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
        out.append((float(n), 2 * n ** 3 / _timed(lambda a=a, b=b: a @ b, repeats, sync)))
    return out


def memory_bandwidth(device: torch.device, nbytes: int, repeats: int, sync) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * nbytes / _timed(lambda: dst.copy_(src), repeats, sync)  # read + write


def op_overhead(device: torch.device, repeats: int, sync) -> float:
    """Seconds per operator of a training step whose tensors are too small to cost anything else: a
    stack of tiny layers, forward and backward (modules, autograd and dispatch, what every operator of
    a real step pays besides its arithmetic), over the aten operators it runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    layers = [m for _ in range(8) for m in (torch.nn.Linear(4, 4), torch.nn.GELU(), torch.nn.LayerNorm(4))]
    model = torch.nn.Sequential(*layers).to(device)
    x = torch.ones(2, 4, device=device)

    def step():
        model(x).sum().backward()

    with Count():
        step()
    return _timed(step, max(repeats, 5), sync) / Count.n


def collective_curves(comm: Comm, device: torch.device, sizes, repeats: int, sync) -> dict:
    """{op: [[message bytes, seconds], ...]} over the whole group; the message is what one rank
    contributes (all-gather: its shard; reduce-scatter: the whole input it reduces)."""
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
        for op, fn in runs.items():
            seconds = [_group_time(comm, fn, sync, device) for _ in range(repeats + 1)][1:]  # 1st warms up
            sec = statistics.median(seconds)
            curves[op].append((float(n * 4), sec / 2 if op == "send_recv" else sec))
    return {op: pts for op, pts in curves.items() if pts}


def _group_time(comm: Comm, fn, sync, device) -> float:
    """One run of `fn` started together (a barrier), timed as the slowest rank's."""
    comm.barrier(label="probe")
    t0 = time.perf_counter()
    fn()
    sync()
    took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
    comm.all_reduce(took, label="probe: slowest rank", op=torch.distributed.ReduceOp.MAX)
    return float(took.item())


def measure(env: DistEnv, sizes=DEFAULT_SIZES, repeats: int = 3, matmul_sizes=MATMUL_SIZES,
            copy_bytes: int = 64 * 1024 * KIB, nnodes: int = 1) -> HardwareProfile:
    """Collective over the default group: every rank calls it; every rank gets the profile."""
    import shoal.train.run  # noqa: F401 - the training stack, imported as a worker imports it (resident memory)

    device = env.device
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    base = peak_memory_bytes(device) if not cuda else None
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, **({"fp16": torch.float16} if cuda else {})}
    curves = {name: matmul_curve(dt, device, matmul_sizes, repeats, sync) for name, dt in dtypes.items()}
    comm = Comm(env.store, env.rank, env.world_size)
    return HardwareProfile(
        name="probe", device=device.type,
        device_name=torch.cuda.get_device_name(device) if cuda else _cpu_name(),
        nproc=env.world_size // nnodes, nnodes=nnodes,
        matmul_flops={name: max(f for _, f in c) for name, c in curves.items()},
        matmul_curve=curves,
        memory_bandwidth=memory_bandwidth(device, copy_bytes, repeats, sync),
        op_overhead_s=op_overhead(device, repeats, sync),
        process_bytes=base,
        threads=torch.get_num_threads(),
        collectives=collective_curves(comm, device, sizes, repeats, sync),
    )


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "cpu"


def sizes_up_to(max_bytes: int) -> tuple[int, ...]:
    return tuple(s for s in DEFAULT_SIZES if s <= max_bytes) or (DEFAULT_SIZES[0],)


def worker(out: str, sizes, repeats: int, nnodes: int) -> None:
    """One process of the group (started by `launch` below): measure, rank 0 writes the profile."""
    from shoal import dist
    from shoal.hardware import save_profile

    env = dist.init("nccl" if torch.cuda.is_available() else "gloo", 300.0)
    try:
        profile = measure(env, sizes, repeats, nnodes=nnodes)
        if env.rank == 0:
            save_profile(profile, out)
            print(summary_line(profile, out), flush=True)
    finally:
        dist.shutdown()


def summary_line(profile: HardwareProfile, out: str) -> str:
    flops = ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in profile.matmul_flops.items())
    ar = profile.collectives.get("all_reduce", [])
    big = f"; all-reduce of {ar[-1][0] / 2 ** 20:.2f} MiB: {ar[-1][1] * 1e3:.2f} ms" if ar else ""
    return (f"wrote {out}: {profile.nproc * profile.nnodes} process(es) on {profile.device_name}: {flops}; copy "
            f"{(profile.memory_bandwidth or 0) / 1e9:.1f} GB/s; {(profile.op_overhead_s or 0) * 1e6:.1f} us per "
            f"operator{big}")


def launch_probe(argv: list[str], nproc: int) -> int:
    """The probe's workers through shoal's launcher: this node alone, or (on a host of the one-machine
    cluster, cluster/run.py) one node of the cluster's job, as `shoal train` runs there."""
    import os

    from shoal.launch import launch

    nnodes = int(os.environ.get("SHOAL_NNODES", "1"))
    node_rank = int(os.environ.get("SHOAL_NODE_RANK", "0"))
    endpoint = os.environ.get("SHOAL_RDZV_ENDPOINT") if nnodes > 1 else None
    threads = max(1, (os.cpu_count() or 1) // nproc)
    return launch(["-m", "shoal", "probe", *argv, "--nnodes-measured", str(nnodes)], nproc, (nnodes, nnodes),
                  node_rank, endpoint, threads=threads)
