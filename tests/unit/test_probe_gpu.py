"""What `shoal probe` does differently on a GPU, tested without one: the sizes it measures there
(plan/reference.py) against a CPU's, which stay as they were; the reference steps under autocast, keyed
apart from the fp32 ones; the caching allocator's reserve, the CUDA context and NCCL's bytes worked out
from torch.cuda's counters (replaced here by a fake GPU); the barrier that runs no collective; and what the
spot measurement says it took. The probe itself runs for real on CPUs in tests/unit/test_plan.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from shoal.config import load_config
from shoal.hardware import HardwareProfile, load_profile, save_profile
from shoal.plan import probe
from shoal.plan.calibrate import reference_config, reference_layouts
from shoal.plan.probe import (
    COLLECTIVES,
    StepCosts,
    gpu_collectives,
    outside_bytes,
    reference_steps,
    step_fields,
    store_barrier,
)
from shoal.plan.probe import collectives as probe_collectives
from shoal.plan.profiles import calibration_time, measured_parts
from shoal.plan.reference import CPU_REFERENCE, GPU_REFERENCE, GPU_SIZING, matmul_calls, sizing

MIB, GIB = 2 ** 20, 2 ** 30


def test_a_cpu_measures_what_it_did_and_a_gpu_sizes_that_take_kernels_past_their_launch():
    cpu = sizing("cpu")
    assert cpu.matmul_sizes == {"fp32": (128, 256, 512, 1024), "bf16": (128, 256, 512, 1024)}
    assert cpu.copy_bytes == 64 * MIB and cpu.reference == CPU_REFERENCE
    assert (CPU_REFERENCE.widths, CPU_REFERENCE.batch, CPU_REFERENCE.seq_len, CPU_REFERENCE.vocab) == \
        ((128, 256, 512), 4, 128, 256)
    assert [CPU_REFERENCE.heads(w) for w in CPU_REFERENCE.widths] == [4, 4, 4] and CPU_REFERENCE.dtypes == ("fp32",)
    assert all(matmul_calls("cpu", n) == 1 for n in (128, 1024, 8192))
    gpu = sizing("cuda")
    assert gpu is GPU_SIZING and gpu.copy_bytes == GIB and set(gpu.matmul_sizes) == {"fp32", "bf16", "fp16"}
    assert max(gpu.matmul_sizes["bf16"]) == 8192 and max(gpu.matmul_sizes["fp32"]) == 4096
    # every timed GPU sample is at least 2^40 FLOPs of products (~1 ms of an H100), or the most calls allowed
    for n in {n for sizes in gpu.matmul_sizes.values() for n in sizes}:
        calls = matmul_calls("cuda", n)
        assert calls == 256 or calls * 2 * n ** 3 >= 2 ** 40, (n, calls)
    assert [matmul_calls("cuda", n) for n in (256, 2048, 4096, 8192)] == [256, 64, 8, 1]
    assert GPU_REFERENCE.dtypes == ("fp32", "bf16") and GPU_REFERENCE.calibration_dtype == "bf16"


def test_the_gpu_reference_gpt_spans_a_real_model_s_tensor_sizes():
    """GPT-2's head size at every width; tensors from a bias's ~1 KiB to fp32 logits of 128 MiB."""
    from shoal.models.meta import on_meta

    for width in GPU_REFERENCE.widths:
        with on_meta():
            bundle = probe._reference_bundle(width, torch.device("meta"), GPU_REFERENCE)
        attn = bundle.model.blocks[0].attn
        assert attn.head_dim == 64 and width // attn.head_dim == GPU_REFERENCE.heads(width)
        sizes = [p.numel() * 4 for p in bundle.model.parameters()]
        assert min(sizes) <= 4 * 1024 and max(sizes) >= 8 * MIB  # a bias; the embedding, 8192 x width
    assert GPU_REFERENCE.batch * GPU_REFERENCE.seq_len * GPU_REFERENCE.vocab * 4 == 128 * MIB  # the fp32 logits


def test_a_gpu_calibrates_its_own_reference_in_bf16_and_a_cpu_as_before():
    before = ['model.name="gpt"', "model.n_layer=2", "model.d_model=256", "model.n_head=4", "model.seq_len=128",
              'data.source="stdlib-text"', "data.max_bytes=400000", "train.global_batch_size=8",
              "train.micro_batch_size=2", "train.steps=10", "train.val_interval=0", "train.val_batches=1",
              "metrics.log_interval=1", "metrics.tensorboard=false", "metrics.progress=false",
              "checkpoint.enabled=false", "checkpoint.final_weights=false", "parallel.threads_per_worker=1",
              "parallel.zero=1"]
    assert reference_config(256, ["parallel.zero=1"], 2, 1) == before
    for layout in reference_layouts(2).values():
        for width in GPU_REFERENCE.widths:
            cfg = load_config(None, reference_config(width, layout, 2, 8, GPU_REFERENCE))
            assert (cfg.model.d_model, cfg.model.d_model // cfg.model.n_head) == (width, 64)
            assert (cfg.model.seq_len, cfg.model.vocab_size, cfg.precision.dtype) == (1024, 8192, "bf16")


class FakeCuda:
    """torch.cuda's memory counters of a GPU of `total` bytes, moved by the test."""

    def __init__(self, monkeypatch, total: int = 80 * GIB):
        self.total, self.used, self.reserved, self.peaks, self.restarts = total, 0, 0, {}, []
        for name in ("mem_get_info", "memory_reserved", "max_memory_reserved", "max_memory_allocated",
                     "empty_cache", "reset_peak_memory_stats"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))

    def mem_get_info(self, device=None):
        return self.total - self.used, self.total

    def memory_reserved(self, device=None):
        return self.reserved

    def max_memory_reserved(self, device=None):
        return self.peaks.get(len(self.restarts), (0, 0))[1]

    def max_memory_allocated(self, device=None):
        return self.peaks.get(len(self.restarts), (0, 0))[0]

    def empty_cache(self):
        self.restarts.append("emptied")

    def reset_peak_memory_stats(self, device=None):
        assert self.restarts and self.restarts[-1] == "emptied", "peaks restarted without the cache emptied first"
        self.restarts[-1] = "restarted"

    def allocate(self, nbytes: int, outside: int = 0):
        """The allocator reserves `nbytes` more (the device's used bytes with them), and `outside` bytes are
        taken beside it (a library's buffers, the context's kernels)."""
        self.reserved += nbytes
        self.used += nbytes + outside


def test_the_context_is_read_before_any_collective_and_nccl_is_what_the_collectives_add(monkeypatch):
    gpu = FakeCuda(monkeypatch)
    gpu.allocate(6 * GIB, outside=530 * MIB)  # the reference steps' tensors, and the context with its kernels
    cuda = torch.device("cuda")
    assert outside_bytes(cuda) == 530 * MIB
    calls = []

    def curves(comm, device, sizes, repeats, sync, ops=COLLECTIVES):
        calls.append(ops)
        if "all_reduce" in ops:  # their tensors through the allocator; NCCL's buffers beside it
            gpu.allocate(1 * GIB, outside=300 * MIB)
        else:  # a pair's communicator: not the group's
            gpu.allocate(64 * MIB, outside=70 * MIB)
        return {op: [(4096.0, 1e-5)] for op in ops}
    monkeypatch.setattr(probe_collectives, "collective_curves", curves)
    got = gpu_collectives(None, cuda, (4096,), 1, lambda: None)
    assert calls == [COLLECTIVES[:3], ("all_to_all", "send_recv")]
    assert got["context_bytes"] == 530 * MIB and got["nccl_bytes"] == 300 * MIB
    assert set(got["collectives"]) == set(COLLECTIVES)
    # a device whose used bytes fall (another process let go) counts no negative NCCL bytes
    reads = iter([900 * MIB, 400 * MIB])
    monkeypatch.setattr(probe_collectives, "collective_curves", lambda *a, **k: {})
    assert gpu_collectives(None, cuda, (4096,), 1, lambda: None, outside=lambda d: next(reads))["nccl_bytes"] == 0


def test_the_allocator_reserve_is_the_widest_reference_s_measured_alone(monkeypatch):
    """Peaks restarted (the cache emptied first) before each width is built; the ratio read after its steps,
    the widest kept. The steps themselves run on the CPU here; the counters are a fake GPU's."""
    gpu = FakeCuda(monkeypatch)
    gpu.peaks = {1: (200 * MIB, 300 * MIB), 2: (400 * MIB, 452 * MIB)}  # by restarts so far: width 32, then 64
    steps = reference_steps(torch.device("cpu"), 1, lambda: None, (32, 64), memory=False, reserve=True)
    assert gpu.restarts == ["restarted", "restarted"]
    assert steps.allocator_reserve == pytest.approx(452 / 400)
    plain = reference_steps(torch.device("cpu"), 1, lambda: None, (32,), memory=False)
    assert plain.allocator_reserve is None and len(gpu.restarts) == 2  # not asked: no counter touched


def test_reference_steps_under_autocast_time_the_kernels_it_runs():
    """bf16: the forward's casts are timed (autocast's _to_copy), and the matmuls are rated by FLOPs."""
    cpu = torch.device("cpu")
    plain = reference_steps(cpu, 1, lambda: None, (32,), memory=False)
    cast = reference_steps(cpu, 1, lambda: None, (32,), memory=False, dtype="bf16")
    assert "_to_copy" in cast.op_rates and "_to_copy" not in plain.op_rates
    assert {"mm", "addmm"} & set(cast.op_flop_rates) and cast.op_overhead_s > 0


def costs(rate: float, reserve: float | None = None) -> StepCosts:
    return StepCosts({"gelu": [(1e6, rate)]}, {"mm": [(1e9, 10 * rate)]}, 1e-5 * rate, None, None, None, reserve)


def test_other_dtypes_rates_are_kept_apart_from_fp32_s(tmp_path):
    cpu = step_fields({"fp32": costs(1.0)})
    assert cpu["op_rates"] == {"gelu": [(1e6, 1.0)]} and cpu["op_overhead_s"] == 1e-5
    assert not {"op_rates_by_dtype", "op_flop_rates_by_dtype", "op_overhead_s_by_dtype", "allocator_reserve"} & set(cpu)
    gpu = step_fields({"fp32": costs(1.0, 1.25), "bf16": costs(2.0, 1.1)})
    assert gpu["op_rates"] == {"gelu": [(1e6, 1.0)]} and gpu["op_flop_rates"] == {"mm": [(1e9, 10.0)]}
    assert gpu["op_rates_by_dtype"] == {"bf16": {"gelu": [(1e6, 2.0)]}}
    assert gpu["op_flop_rates_by_dtype"] == {"bf16": {"mm": [(1e9, 20.0)]}}
    assert gpu["op_overhead_s_by_dtype"] == {"bf16": 2e-5} and gpu["allocator_reserve"] == 1.1
    path = tmp_path / "p.json"  # what a GPU's probe writes, as plan reads it back
    save_profile(HardwareProfile(matmul_flops={"bf16": 1e15}, device="cuda", **gpu), path)
    back = load_profile(path)
    assert back.allocator_reserve == 1.1 and back.op_rates_by_dtype["bf16"]["gelu"] == [[1e6, 2.0]]


def test_the_store_barrier_holds_every_rank_until_all_arrive():
    store = dist.HashStore()
    first, second = store_barrier(store, 2), store_barrier(store, 2)
    passed = []

    def rank(wait, name):
        wait()
        passed.append(name)
    t = threading.Thread(target=rank, args=(first, "rank 0"))
    t.start()
    time.sleep(0.2)
    assert passed == []  # alone at the barrier
    rank(second, "rank 1")
    t.join(5)
    assert sorted(passed) == ["rank 0", "rank 1"]
    # the next call is a new barrier: rank 1 waits there for rank 0 again
    t = threading.Thread(target=rank, args=(second, "rank 1 again"))
    t.start()
    time.sleep(0.2)
    assert "rank 1 again" not in passed
    first()
    t.join(5)
    assert "rank 1 again" in passed


def test_the_spot_measurement_says_what_its_parts_took_and_a_gpu_s_calibration_time():
    took = {"matmul": 0.91, "reference steps": 5.24, "collectives": 1.0}
    profile = HardwareProfile(matmul_flops={"fp32": 1.0}, measured_seconds=took)
    assert measured_parts(profile) == "matmul 0.9 s, reference steps 5.2 s, collectives 1.0 s"
    assert measured_parts(HardwareProfile(matmul_flops={"fp32": 1.0})) == ""
    assert calibration_time({"gpus": 0}, 2) == "~5 min" and calibration_time({"gpus": 1}, 1) == "~1 min"
    assert calibration_time({"gpus": 8}, 8) == "a few min"


@pytest.mark.slow  # measures this machine for a few seconds
def test_a_cpu_probe_measures_in_its_order_and_keeps_what_each_part_took():
    from shoal import dist as shoal_dist

    env = shoal_dist.init("gloo", 60)
    try:
        profile = probe.measure(env, sizes=(4096,), repeats=1, matmul_sizes=(32,), copy_bytes=2 ** 20, widths=(32, 64),
                                spot=True)
    finally:
        shoal_dist.shutdown()
    # a CPU's collectives before its reference steps, as ever; nothing of a GPU's memory or of other dtypes
    assert list(profile.measured_seconds) == ["matmul", "collectives", "reference steps", "parallel wrappers", "copy"]
    assert min(profile.measured_seconds.values()) >= 0 and profile.measured_seconds["reference steps"] > 0
    assert (profile.context_bytes, profile.nccl_bytes, profile.allocator_reserve) == (None, None, None)
    assert not {"op_rates_by_dtype", "host_op_s"} & set(profile.model_dump())
    assert [n for n, _ in profile.matmul_curve["fp32"]] == [32.0] and set(profile.matmul_curve) == {"fp32", "bf16"}
    assert profile.op_rates and profile.spot and profile.heap_ratio is None


def test_a_gpu_probe_s_line_says_what_the_gpu_holds_beyond_the_tensors():
    gpu = HardwareProfile(matmul_flops={"bf16": 7.99e14}, device="cuda", device_name="NVIDIA H100 80GB HBM3",
                          memory_bandwidth=3e12, op_overhead_s=6e-6, context_bytes=530 * MIB, nccl_bytes=300 * MIB,
                          allocator_reserve=1.084)
    line = probe.summary_line(gpu, "profile.json")
    assert line.endswith("; beyond the tensors: CUDA context 530 MiB, NCCL 300 MiB, allocator reserve x1.08"), line
    cpu = gpu.model_copy(update={"context_bytes": None, "nccl_bytes": None, "allocator_reserve": None})
    assert "beyond the tensors" not in probe.summary_line(cpu, "profile.json")
