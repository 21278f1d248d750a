"""The plain loop that benchmarks/gpu_step.py measures `shoal train` against, and the run's facts.

`train`: a GPT training loop for one GPU written the way a user writes it (nanoGPT's train.py): bf16 autocast,
torch.optim.AdamW(fused=True) with weight decay on matrices only, the warmup + cosine learning rate set on the
groups each step, gradient clipping, F.scaled_dot_product_attention (inside the model), the next batch gathered
from the token file and copied from pinned memory with non_blocking while the GPU works, the loss read back only at
logged steps; with --compile, torch.compile of the model and its loss together (nanoGPT's forward returns the
loss). Its model is the very one `shoal train` trains: built by shoal's own builder
(shoal.models.registry.build_model) from the same config file, seeded with train.seed on the device, as shoal
builds it. Timed as gpu_step.py times shoal: the wall time from the end of logged step W (the warm-up: compilation,
the allocator, first touches) to the end of logged step W + N, each after a torch.cuda.synchronize, over N. Then one
more log interval counts the host syncs with shoal's own counter (shoal.metrics.host_syncs, what metrics.host_syncs
counts in `shoal train`).

`prepare`: the device (name, compute capability, memory, driver, torch), a bf16 matmul timed (best of several),
the card's data-sheet peak (shoal.hardware.gpu_preset_for), whether this shoal takes precision.dtype = "fp8" and the
tuned runs' settings, whether torchao imports; writes the token file both runs read (uniform random token ids, a
fixed seed).

    python -m benchmarks.gpu_step_loop train CONFIG --micro 16 [--compile] [--warmup 10] [--timed 30]
    python -m benchmarks.gpu_step_loop prepare --tokens FILE --count N --vocab V --matmul 8192

Each prints one JSON line, its last; an out-of-memory `train` prints {"oom": ...} and exits 3.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

from shoal.config import load_config
from shoal.metrics.host_syncs import HostSyncs
from shoal.models.registry import build_model
from shoal.models.spec import DataSpec


def get_lr(it: int, lr: float, warmup: int, decay_steps: int, min_ratio: float) -> float:
    """nanoGPT's schedule: linear warmup, then cosine down to min_ratio x lr."""
    if it < warmup:
        return lr * (it + 1) / warmup
    progress = min((it - warmup) / max(decay_steps - warmup - 1, 1), 1.0)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class Traced:
    """torch.profiler over steps [first, last] (1-based) of the loop, as shoal's metrics.trace_steps traces its
    own: CPU activity, and CUDA kernels on a GPU; the Chrome trace written to `folder`/loop.pt.trace.json."""

    def __init__(self, folder: str | None, steps: list[int] | None, cuda: bool):
        self.folder, (self.first, self.last) = folder, steps or (0, -1)
        self.cuda, self.prof = cuda, None

    def before(self, step: int) -> None:
        if self.folder and step == self.first:
            from torch.profiler import ProfilerActivity, profile

            self.prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else []),
                                record_shapes=True)
            self.prof.start()

    def after(self, step: int) -> None:
        if self.prof is not None and step == self.last:
            if self.cuda:
                torch.cuda.synchronize()  # the last step's kernels in the trace
            self.prof.stop()
            os.makedirs(self.folder, exist_ok=True)
            self.prof.export_chrome_trace(os.path.join(self.folder, "loop.pt.trace.json"))
            self.prof = None


def train(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = load_config(args.config, [f"train.micro_batch_size={args.micro}", f"train.global_batch_size={args.micro}"])
    t, m = cfg.train, cfg.model
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = device == "cuda"
    ctx = torch.autocast(device, dtype=torch.bfloat16, enabled=cfg.precision.dtype == "bf16")
    # TF32 as shoal leaves it (torch's default: off for matmuls), so that both sides multiply alike; nanoGPT turns it
    # on, which under bf16 autocast changes nothing here (every matmul of the model runs in bf16)
    data = np.memmap(cfg.data.path, dtype=cfg.data.token_dtype, mode="r")
    spec = DataSpec(kind="tokens", vocab_size=int(data.max()) + 1)

    torch.manual_seed(t.seed)
    with torch.device(device):
        bundle = build_model(m, spec)
    model = bundle.model
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    # fused where torch has the kernel (CUDA, and the CPU since 2.4), as shoal's optimizer is
    from shoal.compat import fused_optimizer_devices

    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay,
                            "weight_decay": 0.0}], lr=t.lr, betas=(t.beta1, t.beta2),
                            fused=device in fused_optimizer_devices())

    def forward_loss(x, y):  # as nanoGPT's model(x, y): the loss inside what torch.compile compiles
        logits = model(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))

    step_loss = torch.compile(forward_loss) if args.compile else forward_loss
    n_matmul = sum(p.numel() for p in model.parameters()) - model.pos_emb.weight.numel()

    B, T = args.micro, m.seq_len
    g = torch.Generator().manual_seed(t.seed)

    def get_batch():
        ix = torch.randint(len(data) - T - 1, (B,), generator=g)
        x = torch.stack([torch.from_numpy(data[i:i + T].astype(np.int64)) for i in ix.tolist()])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + T].astype(np.int64)) for i in ix.tolist()])
        if cuda:
            return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x, y

    total = args.warmup + args.timed
    stamps, losses = {}, {}

    def step(it: int, x, y):
        lr = get_lr(it, t.lr, t.warmup_steps, t.steps, t.min_lr_ratio)
        for group in opt.param_groups:
            group["lr"] = lr
        with ctx:
            loss = step_loss(x, y)
        x, y = get_batch()  # the next batch, while the GPU runs this one
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (it + 1) % args.log_interval == 0:
            losses[it + 1] = loss.item()  # the only read of the GPU's results: at logged steps
        return x, y

    x, y = get_batch()
    traced = Traced(args.trace_dir, args.trace_steps, cuda)
    for it in range(total):
        traced.before(it + 1)
        x, y = step(it, x, y)
        traced.after(it + 1)
        if it + 1 in (args.warmup, total):
            if cuda:
                torch.cuda.synchronize()
            stamps[it + 1] = time.perf_counter()
        elif (it + 1) % args.log_interval == 0 and it + 1 > args.warmup:
            stamps[it + 1] = time.perf_counter()  # after the loss's read: on a GPU, the step's end
    out = {"step_s": (stamps[total] - stamps[args.warmup]) / args.timed, "steps_timed": args.timed, "stamps": stamps,
           "peak_bytes": torch.cuda.max_memory_allocated() if cuda
           else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "peak_kind": "CUDA allocated" if cuda else "process RSS",
           "losses": losses, "matmul_params": n_matmul,
           "flops_per_token": 6 * n_matmul + 12 * m.n_layer * m.seq_len * m.d_model,
           "bundle_flops_per_token": bundle.flops_per_sample / m.seq_len if bundle.flops_per_sample else None}
    if args.sync_steps:  # counted as shoal counts its own (metrics.host_syncs), after the timed steps
        at = [total]
        syncs = HostSyncs(torch.device(device), lambda: at[0]).open()
        try:
            for it in range(total, total + args.sync_steps):
                at[0] = it + 1
                x, y = step(it, x, y)
        finally:
            syncs.close()
        out["syncs"] = {"steps": args.sync_steps, "per_step": sum(syncs.per_step.values()) / args.sync_steps,
                        "sites": dict(syncs.sites.most_common(5))}
    return out


def loss_costs(args) -> dict:
    """The head and its loss alone, forward and backward, at the benchmark's shape: the plain loop's (F.cross_entropy
    of the logits under bf16 autocast, which runs it in fp32) against shoal's losses: the plain one (an explicit
    fp32 upcast, summed), the fused one (model.fused_loss: that loss under torch.compile, the default of an eager
    GPT on CUDA) and the chunked one (model.loss_chunks = 8). Each: the median time of `reps` after a warm-up
    (compiles included there), the peak memory above what its inputs hold, and the loss's error against the same
    logits' loss in float64 (tokens summed; the loop's mean times the tokens)."""
    from shoal.models.cross_entropy import chunked_cross_entropy, cross_entropy_sum, fused_cross_entropy_sum

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = device == "cuda"
    g = torch.Generator(device=device).manual_seed(0)
    n = args.micro * args.seq
    hidden = torch.randn(n, args.d_model, device=device, generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(args.vocab, args.d_model, device=device, generator=g) * 0.02).requires_grad_()
    target = torch.randint(args.vocab, (n,), device=device, generator=g)
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
        exact = F.cross_entropy(F.linear(hidden, weight).double(), target, reduction="sum").item()
    sides = {
        "loop F.cross_entropy": lambda: F.cross_entropy(F.linear(hidden, weight), target) * n,
        "shoal plain": lambda: cross_entropy_sum(F.linear(hidden, weight), target),
        "shoal fused": lambda: fused_cross_entropy_sum(F.linear(hidden, weight), target),
        "shoal chunked 8": lambda: chunked_cross_entropy(hidden, weight, target, 8),
    }
    out = {"shape": {"tokens": n, "d_model": args.d_model, "vocab": args.vocab}, "device": device, "sides": {}}

    def sync():
        if cuda:
            torch.cuda.synchronize()

    for name, fn in sides.items():
        times = []
        for _ in range(3 + args.reps):
            hidden.grad = weight.grad = None
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() if cuda else 0
            t0 = time.perf_counter()
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = fn()
            loss.backward()
            sync()
            times.append(time.perf_counter() - t0)
        out["sides"][name] = {"ms": 1e3 * sorted(times[3:])[len(times[3:]) // 2],
                              "peak_above_inputs_bytes": torch.cuda.max_memory_allocated() - base if cuda else None,
                              "loss_rel_error": abs(loss.item() - exact) / abs(exact)}
    return out


def driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.split()
        return out[0] if out else "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def matmul_rate(n: int, device: str, dtype: torch.dtype, rounds: int = 5, reps: int = 10) -> float:
    """FLOP/s of an n x n x n matmul in `dtype`: the best of `rounds` timings of `reps` back-to-back products."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    cuda = device == "cuda"
    times = []
    for _ in range(rounds + 1):  # the first round warms up (cuBLAS's choice of kernel, clocks)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    best = min(times[1:])
    return 2 * n ** 3 * reps / best


def shoal_takes(overrides: list[str]) -> bool:
    """Whether this shoal's config takes these --set overrides (a key or value a newer shoal has)."""
    from shoal.errors import UserError

    try:
        load_config(None, overrides)
        return True
    except (UserError, ValueError):
        return False


def prepare(args) -> dict:
    rng = np.random.default_rng(20_240_611)
    rng.integers(0, args.vocab, args.count, dtype=np.uint16).tofile(args.tokens)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    facts = {"torch": torch.__version__, "cuda": cuda, "cuda_version": torch.version.cuda}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        facts.update(name=props.name, capability=list(torch.cuda.get_device_capability(0)),
                     memory_bytes=props.total_memory, driver=driver_version())
        from shoal.hardware import gpu_preset_for

        preset = gpu_preset_for(props.name)
        facts["sheet_flops"] = preset.peak_flops("bf16") if preset else None
        facts["sheet_name"] = preset.device_name if preset else None
    facts["matmul_n"] = args.matmul
    facts["matmul_flops"] = matmul_rate(args.matmul, device, torch.bfloat16)
    try:
        import importlib.util

        facts["torchao"] = importlib.util.find_spec("torchao") is not None
    except (ImportError, ValueError):
        facts["torchao"] = False
    facts["shoal_fp8"] = shoal_takes(["precision.dtype=fp8"])
    facts["shoal_tuned"] = shoal_takes(args.tuned) if args.tuned else False
    return facts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    tr = sub.add_parser("train")
    tr.add_argument("config")
    tr.add_argument("--micro", type=int, required=True)
    tr.add_argument("--compile", action="store_true")
    tr.add_argument("--warmup", type=int, default=10)
    tr.add_argument("--timed", type=int, default=30)
    tr.add_argument("--log-interval", type=int, default=10)
    tr.add_argument("--sync-steps", type=int, default=10)
    tr.add_argument("--threads", type=int, default=0, help="torch's intra-op threads (0: torch's default)")
    tr.add_argument("--trace-dir", help="write a torch.profiler trace of --trace-steps here")
    tr.add_argument("--trace-steps", type=int, nargs=2, metavar=("FIRST", "LAST"))
    lo = sub.add_parser("loss")
    lo.add_argument("--micro", type=int, default=16)
    lo.add_argument("--seq", type=int, default=1024)
    lo.add_argument("--d-model", type=int, default=768)
    lo.add_argument("--vocab", type=int, default=50304)
    lo.add_argument("--reps", type=int, default=20)
    pr = sub.add_parser("prepare")
    pr.add_argument("--tokens", required=True)
    pr.add_argument("--count", type=int, required=True)
    pr.add_argument("--vocab", type=int, required=True)
    pr.add_argument("--matmul", type=int, default=8192)
    pr.add_argument("--tuned", nargs="*", default=[], help="--set overrides of gpu_step.py's tuned runs, to check")
    args = ap.parse_args()
    if args.cmd in ("prepare", "loss"):
        print(json.dumps(prepare(args) if args.cmd == "prepare" else loss_costs(args)), flush=True)
        return
    try:
        out = train(args)
    except torch.cuda.OutOfMemoryError as e:
        print(json.dumps({"oom": " ".join(str(e).split())[:300]}), flush=True)
        sys.exit(3)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
