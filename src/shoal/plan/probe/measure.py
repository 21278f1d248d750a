"""`shoal probe`'s worker: every part measured in order over the group (measure), the profile written by
rank 0 with its summary line; the calibration added after, and the launcher that starts the workers."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time

import torch

from shoal.comm.collectives import Comm
from shoal.dist import DistEnv
from shoal.hardware import HardwareProfile, cpu_name, this_machine
from shoal.metrics.memory import peak_memory_bytes
from shoal.plan.probe.collectives import COLLECTIVES, DEFAULT_SIZES, collective_curves, gpu_collectives
from shoal.plan.probe.compute import DTYPES, matmul_curve, memory_bandwidth
from shoal.plan.probe.steps import host_op_seconds, reference_steps, step_fields
from shoal.plan.probe.wrappers import parallel_overheads
from shoal.plan.reference import Reference, Sizing, reference_for, sizing


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
            fields["collectives"] = collective_curves(comm, device, sizes, repeats, sync,
                                                      ops=[op for op in COLLECTIVES if op != "all_to_all" or not spot])
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
    cluster, testbed/nodes.py) one node of the cluster's job, as `shoal train` runs there."""
    import os

    from shoal.launch.restart import launch

    nnodes = int(os.environ.get("SHOAL_NNODES", "1"))
    node_rank = int(os.environ.get("SHOAL_NODE_RANK", "0"))
    endpoint = os.environ.get("SHOAL_RDZV_ENDPOINT") if nnodes > 1 else None
    threads = max(1, (os.cpu_count() or 1) // nproc)
    return launch(["-m", "shoal", "probe", *argv, "--nnodes-measured", str(nnodes)], nproc, (nnodes, nnodes),
                  node_rank, endpoint, threads=threads)
