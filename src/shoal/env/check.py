"""`shoal env --check`: a few seconds that say whether this machine trains, one line per check.

1. what stops training outright (facts.problems: an unsupported torch, no GPU visible, no NCCL, a small
   /dev/shm), said before anything starts;
2. `--nproc` workers through shoal's launcher, one per GPU under NCCL (the CPU under gloo): an all-reduce
   and an all-gather whose results are known, a 64 MiB all-reduce's bus bandwidth, and each worker's
   matmul rate (bf16 on a GPU, against its data sheet where shoal has one);
3. one training step of a tiny GPT by `shoal train` on the same workers, as a user's run would go.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shoal.env.facts import Facts, problems

# a worker's error, by what NCCL or CUDA says, and what fixes it
HINTS = {
    "creating shared memory segment": "/dev/shm is too small for NCCL: docker run --shm-size=1g or --ipc=host",
    "invalid usage": "NCCL refuses two ranks on one GPU: one worker per GPU (--nproc at most the GPUs)",
    "CUDA out of memory": "another process holds the GPU's memory: see nvidia-smi",
    "busy or unavailable": "the GPU is in exclusive mode and taken by another process: see nvidia-smi",
}
# a matmul below this share of the data sheet's peak means throttled clocks or a shared GPU (an H100 SXM
# reaches 0.81 in bf16 at 8192^3: 799 of 989 TFLOP/s, torch 2.11)
SLOW_SHARE = 0.4
ALL_REDUCE_BYTES = 64 << 20
# the tiny GPT of the training step: seconds on a CPU
TINY = ["model.n_layer=1", "model.n_head=2", "model.d_model=32", "model.seq_len=32", "train.steps=1",
        "train.micro_batch_size=2", "train.warmup_steps=0", "data.max_bytes=100000", "checkpoint.enabled=false",
        "metrics.profile=false"]


def run(facts: Facts, nproc: int) -> int:
    """Every check, printed as it ends; 0 when all pass, 1 otherwise."""
    on = f"{nproc} worker(s), one per GPU (nccl)" if facts.gpus else f"{nproc} worker(s) on the CPU (gloo)"
    print(f"shoal env --check: {on}", flush=True)
    blocking = problems(facts)
    for line in blocking:
        say(False, "machine", line)
    if blocking:
        return 1
    results = [*workers(facts, nproc), training(facts, nproc)]
    return 0 if all(ok for ok, _, _ in results) else 1


def say(ok: bool, name: str, text: str) -> tuple[bool, str, str]:
    print(f"{'ok  ' if ok else 'FAIL'}  {name:10s}  {text}", flush=True)
    return ok, name, text


def workers(facts: Facts, nproc: int) -> list[tuple[bool, str, str]]:
    """The collective and matmul checks, measured by `nproc` launched workers (worker() below)."""
    from shoal.launch.restart import launch

    with tempfile.TemporaryDirectory(prefix="shoal-env-") as tmp:
        out = Path(tmp) / "result"
        code = launch(["-m", "shoal", "env", "--check", "--nproc", str(nproc), "--out", str(out)], nproc,
                      threads=max(1, facts.cores // nproc))
        found = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("result.rank*.json"))]
    errors = [f"rank {r['rank']}: {r['error']}" for r in found if "error" in r]
    if code != 0 or errors or len(found) < nproc:
        why = errors[0] if errors else f"the workers exited with code {code}; their output is above"
        hint = next((fix for key, fix in HINTS.items() if key in why), None)
        return [say(False, "collective", why + (f"; {hint}" if hint else ""))]
    backend = found[0]["backend"]
    first = found[0]
    lines = [say(first["sums_ok"], "collective",
                 f"all-reduce and all-gather across {nproc} worker(s) over {backend} "
                 f"{'gave the expected values' if first['sums_ok'] else 'gave WRONG values'}; a 64 MiB "
                 f"all-reduce at {first['busbw'] / 1e9:.2f} GB/s bus bandwidth")]
    for r in found:
        lines.append(matmul_line(r))
    return lines


def matmul_line(r: dict) -> tuple[bool, str, str]:
    rate, peak = r["matmul_flops"], r["peak"]
    speed = f"{rate / 1e12:.0f} TFLOP/s" if rate >= 1e12 else f"{rate / 1e9:.1f} GFLOP/s"
    what = f"rank {r['rank']} on {r['device_name']}: {r['dtype']} {r['n']}^3 at {speed}"
    if peak is None:
        return say(True, "matmul", f"{what} (no data sheet for this device)")
    share = rate / peak
    ok = share >= SLOW_SHARE
    text = f"{what}, {share:.0%} of the data sheet's {peak / 1e12:.0f} TFLOP/s"
    return say(ok, "matmul", text if ok else f"{text}: throttled clocks or a shared GPU? see nvidia-smi -q -d "
                                               f"PERFORMANCE and the processes on it")


def training(facts: Facts, nproc: int) -> tuple[bool, str, str]:
    """One step of a tiny GPT by `shoal train` on `nproc` workers, in a run dir of its own."""
    sets = [*TINY, f"train.global_batch_size={2 * nproc}", f"precision.dtype={'bf16' if facts.gpus else 'fp32'}"]
    with tempfile.TemporaryDirectory(prefix="shoal-env-run-") as tmp:
        cmd = [sys.executable, "-m", "shoal", "train", "--nproc", str(nproc), "--run-dir", tmp, "--resume", "never",
               *[a for s in sets for a in ("--set", s)]]
        t0 = time.monotonic()
        done = subprocess.run(cmd, capture_output=True, text=True)
        took = time.monotonic() - t0
        summary = Path(tmp) / "summary.json"
        loss = json.loads(summary.read_text()).get("final_loss") if summary.exists() else None
    if done.returncode != 0 or loss is None or not math.isfinite(loss):
        said = [ln for ln in (done.stderr + done.stdout).splitlines() if ln.strip()]
        why = next((ln for ln in said if ln.startswith("shoal: error")), said[-1] if said else "no output")
        return say(False, "training", f"one step of a tiny GPT on {nproc} worker(s) failed (exit code "
                                      f"{done.returncode}): {why.strip()[:300]}")
    return say(True, "training", f"one step of a tiny GPT on {nproc} worker(s): loss {loss:.4f}, {took:.1f} s with "
                                 f"the start")


def worker(out: str) -> None:
    """One launched worker: the collectives with known results, a timed all-reduce, a matmul; its own
    JSON file either way (an error as one line)."""
    from shoal import dist as shoal_dist
    from shoal.errors import first_line
    from shoal.layout import choose_backend, choose_device

    rank = int(os.environ["RANK"])
    path = Path(f"{out}.rank{rank}.json")
    try:
        device = choose_device("auto", torch.cuda.is_available())
        result = measure(shoal_dist.init(choose_backend("auto", device), 60.0, device=device))
    except Exception as e:  # said as the check's one line, in the parent
        result = {"rank": rank, "error": f"{type(e).__name__}: {first_line(e)}"}
    path.write_text(json.dumps(result))
    shoal_dist.shutdown()


def measure(env) -> dict:
    from shoal.comm.collectives import Comm

    comm, dev, n = Comm(env.store, env.rank, env.world_size), env.device, env.world_size
    total = comm.all_reduce(torch.full((1024,), float(env.rank + 1), device=dev), label="env check")
    gathered = comm.all_gather_flat(torch.full((4,), float(env.rank), device=dev), label="env check")
    sums_ok = bool((total == n * (n + 1) / 2).all()) and gathered.tolist() == [float(r) for r in range(n)
                                                                               for _ in range(4)]
    big = torch.ones(ALL_REDUCE_BYTES // 4, device=dev)
    comm.all_reduce(big, label="env check")  # warm-up: NCCL builds its rings on the first call
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(3):
        comm.all_reduce(big, label="env check")
    sync(dev)
    seconds = (time.perf_counter() - t0) / 3
    busbw = ALL_REDUCE_BYTES * 2 * (n - 1) / n / seconds if n > 1 else 0.0  # nccl-tests' bus bandwidth
    return {"rank": env.rank, "backend": dist.get_backend(), "sums_ok": sums_ok,
            "busbw": busbw, **matmul(dev)}


def matmul(dev: torch.device) -> dict:
    """A square matmul's rate: bf16 8192^3 on a GPU, fp32 512^3 on a CPU (a second or less either way)."""
    from shoal.hardware import gpu_preset_for

    gpu = dev.type == "cuda"
    n, dtype, reps = (8192, torch.bfloat16, 20) if gpu else (512, torch.float32, 5)
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    a @ b
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(dev)
    rate = 2 * n ** 3 * reps / (time.perf_counter() - t0)
    name = torch.cuda.get_device_name(dev) if gpu else "the CPU"
    preset = gpu_preset_for(name) if gpu else None
    return {"device_name": name, "dtype": "bf16" if gpu else "fp32", "n": n, "matmul_flops": rate,
            "peak": preset.peak_flops("bf16") if preset else None}


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
