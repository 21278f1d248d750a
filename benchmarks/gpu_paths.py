"""Every shoal path that runs only on CUDA, run on a real GPU by one command, each checked by its numbers.

Each path runs the real CLI (`python -m shoal ...`) or a user's script under `shoal run`, in a subprocess with a
timeout, in a folder of its own under --out (default: a temporary folder, removed when nothing failed); every
command's output is kept in <out>/logs/ (or --logs); a failing path does not stop the others. The runs train a
small GPT (2 blocks x 128, 128 bytes per sample, global batch 32 in micro-batches of 8) at a constant learning rate
for 24 steps, fp32 unless said:
  train-fp32           shoal train on CUDA (NCCL, world 1): every loss finite, falling; the reference of the runs below
  train-bf16           precision.dtype = bf16: every step's loss within 2e-2 of fp32 (shoal parity's bf16 tolerance)
  train-fp16           fp16 with loss scaling, step 5's gradients overflowing on purpose (gpu_paths_model.py): that
                       update is skipped (the weights step 6 starts from are step 5's; its gradient norm null in
                       metrics.jsonl, which says overflow and the new loss_scale; summary.json's bad_steps 0), the
                       loss scale halves once (65536 -> 32768 in the checkpoint), every other step updates; steps 1-5
                       within 1e-2 of fp32 (shoal parity's fp16 tolerance)
  train-compile        train.compile = true: within 1e-3 of fp32 (inductor's fused kernels sum in another order)
  train-fp8            precision.dtype = fp8 (float8 matmuls: compute capability 8.9 or newer): within 2e-2 of fp32
  train-checkpointing  precision.activation_checkpointing = true: within 1e-5 of fp32 (the same kernels, run twice),
                       a lower CUDA peak than fp32's
  host-syncs           metrics.host_syncs = true, metrics.log_interval = 8 (torch's sync debug mode): the logged steps'
                       metrics and summary.json carry the count, the median step (one not logged) syncs none; losses
                       within 1e-6 of fp32's
  cuda-memory          train-fp32's metrics.jsonl and summary.json carry CUDA's peak allocated bytes: at least the
                       model state (parameters, gradients, AdamW moments), below the GPU's memory
  start-memory         train-fp32's summary.json: its start (the model built on the meta device, the seeded init
                       replayed on the CPU and copied to the GPU tensor by tensor) allocated on the GPU its
                       parameters and at most 1 MiB more
  probe                shoal probe --no-calibrate --nproc 1: a profile of this device (matmul rates, copy bandwidth)
  plan                 shoal plan CONFIG with no profile cached: it measures one on the spot; a step time on every row
  plan-check           shoal plan --check on train-fp32's run: predicted and measured rows, model state within 1%
  run-ddp-script       shoal run --nproc 1 of PyTorch's DDP tutorial script (CUDA + NCCL, unchanged): both epochs, a
                       snapshot of finite CUDA tensors
  session              shoal.Session: tests/fixtures/session_script.py unchanged under shoal run --nproc 1 (sess.data()
                       hands its batches out on the GPU): killed (SIGKILL) after step 5 and run again, it ends bitwise
                       equal to an uninterrupted run (dropout on CUDA: the CUDA RNG restored); its peak is CUDA's
  env-check            shoal env --check --nproc 1: every line ok, exit 0
  resume-gpu-cpu       steps 1-8 on the GPU, the same command on the CPU to 16 (parallel.device = cpu), on the GPU to
                       24: every step's loss within 1e-4 of train-fp32's uninterrupted run (two devices' kernels)
  export               shoal export of train-fp32's run: bitwise its final weights; they load into the one-process
                       GPT, whose forward on the GPU is finite
  gloo-dp, gloo-zero2, gloo-zero3, gloo-tp2
                       two workers sharing the GPU over gloo (parallel.device = cuda, parallel.backend = gloo) against
                       one process: shoal parity PASS within 1e-4 (GPU kernels differ by batch shape; 1e-5 on CPUs)
  gloo-fp8-tp2, gloo-fp8-zero3
                       the same in fp8, against one process in fp8: tp 2 by torchao's float8 styles, ZeRO 3 gathering
                       its weights in float8; PASS within shoal parity's fp8 default, 5e-2
  ps-sync, ps-sparse, ps-async
                       a parameter server (sync.mode = "parameter-server") of one worker and one server sharing the
                       GPU over gloo: synchronous, with the embedding tables by rows (ps.sparse), and asynchronous
                       (the roles as jobs of their own, 8 updates, none stale); 8 steps, every loss within 1e-4 of
                       train-fp32's (gpu_paths_ranks.py)
  live-heal            two one-worker nodes of a live run (--nnodes 1:2) sharing the GPU over gloo, node 1's worker
                       killed after step 4: the group regroups, the replacement heals from a peer's state (summary.json
                       says so); every loss within 1e-4 of one process's
Without CUDA, probe, plan, plan-check, session, env-check, resume-gpu-cpu (all of it on the CPU) and export run on
the CPU (against a CPU run of train-fp32's config); the rest print `skip  NAME  no CUDA: ...`.

Untested on GPUs by this script: NCCL between ranks (one GPU, and NCCL refuses two ranks on one device), several
GPUs, several nodes (docs/gpus.md).

On a GPU machine whose python3 has a CUDA torch but not shoal's other dependencies (pydantic, tomli-w, ...), with
no network: put their wheels in .whl/ (ignored by git; brought along with the checkout), then one call:
    bash benchmarks/gpu_paths.sh [ARGS]     (installs .whl/ into /tmp/site, puts src/ on PYTHONPATH, runs this;
                                             the logs go to $OUT/gpu_paths_logs, which comes back)
Where shoal is installed:
    python -m benchmarks.gpu_paths [--only NAME[,NAME]] [--list] [--out DIR] [--logs DIR]
Sized for about 6 minutes on one H100 (about 30 process starts, compile's first step, the probe) before the
parameter server's and live-heal's paths (about 12 more process starts and live-heal's wait for its replacement:
not yet timed on a GPU); on 2 CPU cores the CPU paths take 4-13 minutes, most of it the probe and the plan's
measurement.

One line per path (`ok    NAME  detail`, `FAIL  NAME  reason`, `skip  NAME  why`), then the last line
    RESULT ok=N failed=M skipped=K seconds=S device="<name>" torch=<version>
Exit code 0 when nothing failed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import gpu_paths_commands as commands
from benchmarks import gpu_paths_ranks as ranks
from benchmarks.gpu_paths_tools import (
    ACCUM,
    INIT_SCALE,
    OVERFLOW_STEP,
    STEPS,
    Ctx,
    check_close,
    check_learning,
    fp32_run,
    layout_line,
    mib,
    newest_train_state,
    step_records,
    train,
)
from benchmarks.harness import HERE, Bench, Failed, python_json


def p_train_fp32(ctx: Ctx) -> str:
    run = fp32_run(ctx)
    backend, expected = layout_line(run), "nccl" if ctx.dev == "cuda" else "gloo"
    if backend != expected:
        raise Failed(f"trained over {backend}, not {expected} on the {ctx.dev}")
    return (f"{STEPS} steps on {ctx.dev} ({backend}): {check_learning(run.losses, STEPS)}, median step "
            f"{run.summary['median_step_time_s'] * 1e3:.1f} ms")


def p_train_bf16(ctx: Ctx) -> str:
    run = train(ctx, "train-bf16", ctx.folder("train-bf16") / "run",
                [f"parallel.device={ctx.dev}", "precision.dtype=bf16"])
    close = check_close(run.losses, fp32_run(ctx).losses, range(1, STEPS + 1), 2e-2, "fp32")
    return f"{check_learning(run.losses, STEPS)}; {close}"


def p_train_fp16(ctx: Ctx) -> str:
    folder = ctx.folder("train-fp16")
    trace = folder / "weights.txt"
    run = train(ctx, "train-fp16", folder / "run", [
        f"parallel.device={ctx.dev}", "precision.dtype=fp16", 'model.name="gpu_paths_model:build"',
        f"model.overflow_call={(OVERFLOW_STEP - 1) * ACCUM + 1}", f'model.trace_file="{trace}"'],
        env={"PYTHONPATH": f"{HERE}{os.pathsep}{ctx.env['PYTHONPATH']}"})  # the model's module
    learned = check_learning(run.losses, STEPS)
    records = {m["step"]: m for m in step_records(run.dir)}
    overflowed = [s for s, m in records.items() if m["grad_norm"] is None]  # metrics.jsonl writes inf, NaN as null
    if overflowed != [OVERFLOW_STEP]:
        raise Failed(f"gradient norm not finite at steps {overflowed}, expected exactly step {OVERFLOW_STEP}")
    said = {s: (m.get("overflow"), m.get("loss_scale")) for s, m in records.items() if "overflow" in m}
    if said != {OVERFLOW_STEP: (True, INIT_SCALE / 2)}:
        raise Failed(f"metrics.jsonl says overflow and loss scale {said}, expected step {OVERFLOW_STEP} at "
                     f"{INIT_SCALE / 2:g}")
    if run.summary["bad_steps"] != 0:
        raise Failed(f"summary.json counts {run.summary['bad_steps']} bad steps: an fp16 overflow is the scaler's")
    scale = newest_train_state(run.dir)["parts"]["scaler"].get("scale")
    if scale != INIT_SCALE / 2:
        raise Failed(f"loss scale {scale} at the end, expected {INIT_SCALE / 2:g} ({INIT_SCALE:g} halved once)")
    sums = {int(c): float(v) for c, v in (ln.split() for ln in trace.read_text().splitlines())}
    starts = [sums[(s - 1) * ACCUM + 1] for s in range(1, STEPS + 1)]  # the weights each step starts from
    unchanged = [s for s in range(1, STEPS) if starts[s] == starts[s - 1]]  # step s's update left them as they were
    if unchanged != [OVERFLOW_STEP]:
        raise Failed(f"the weights were left unchanged by step(s) {unchanged}, expected only step {OVERFLOW_STEP}")
    close = check_close(run.losses, fp32_run(ctx).losses, range(1, OVERFLOW_STEP + 1), 1e-2, "fp32")
    return (f"step {OVERFLOW_STEP} overflowed: its update skipped, loss scale {INIT_SCALE:g} -> {scale:g} (said in "
            f"metrics.jsonl), gradient norm null, bad_steps 0; every other step updated; {learned}; steps "
            f"1-{OVERFLOW_STEP} {close}")


def p_train_compile(ctx: Ctx) -> str:
    run = train(ctx, "train-compile", ctx.folder("train-compile") / "run",
                [f"parallel.device={ctx.dev}", "train.compile=true"], timeout=480)
    ref = fp32_run(ctx)
    close = check_close(run.losses, ref.losses, range(1, STEPS + 1), 1e-3, "eager fp32")
    return (f"{check_learning(run.losses, STEPS)}; {close}; median step {run.summary['median_step_time_s'] * 1e3:.1f} "
            f"ms (eager {ref.summary['median_step_time_s'] * 1e3:.1f} ms)")


def p_train_fp8(ctx: Ctx) -> str:
    run = train(ctx, "train-fp8", ctx.folder("train-fp8") / "run",
                [f"parallel.device={ctx.dev}", "precision.dtype=fp8"])
    close = check_close(run.losses, fp32_run(ctx).losses, range(1, STEPS + 1), 2e-2, "fp32")
    return f"{check_learning(run.losses, STEPS)}; {close}; median step {run.summary['median_step_time_s'] * 1e3:.1f} ms"


def p_train_checkpointing(ctx: Ctx) -> str:
    run = train(ctx, "train-checkpointing", ctx.folder("train-checkpointing") / "run",
                [f"parallel.device={ctx.dev}", "precision.activation_checkpointing=true"])
    ref = fp32_run(ctx)
    close = check_close(run.losses, ref.losses, range(1, STEPS + 1), 1e-5, "fp32 without it")
    peak, ref_peak = run.summary["peak_memory_bytes"], ref.summary["peak_memory_bytes"]
    if not 0 < peak < ref_peak:
        raise Failed(f"CUDA peak {peak} bytes with activation checkpointing, {ref_peak} without: expected lower")
    return f"{check_learning(run.losses, STEPS)}; {close}; CUDA peak {mib(peak)} (without: {mib(ref_peak)})"


def p_host_syncs(ctx: Ctx) -> str:
    run = train(ctx, "host-syncs", ctx.folder("host-syncs") / "run",
                [f"parallel.device={ctx.dev}", "metrics.host_syncs=true", "metrics.log_interval=8"])
    logged = {m["step"]: m.get("host_syncs") for m in step_records(run.dir)}
    median, sites = run.summary.get("host_syncs_per_step"), run.summary.get("host_sync_sites")
    if None in logged.values() or median is None:
        raise Failed(f"metrics.host_syncs = true, yet the logged steps' metrics ({logged}) or summary.json "
                     f"(host_syncs_per_step {median}) lack the count")
    if median != 0:  # 20 of the 23 steps after the first are not logged: the median is theirs
        raise Failed(f"the median step synced with the host {median} times, expected none; where: {sites}")
    close = check_close(run.losses, fp32_run(ctx).losses, run.losses.keys(), 1e-6, "fp32 uncounted")
    return (f"median step 0 syncs (first step {run.summary['host_syncs_first_step']}, logged steps {logged}); "
            f"where: {sites}; {close}")


def p_cuda_memory(ctx: Ctx) -> str:
    run = fp32_run(ctx)
    steps = [m for m in step_records(run.dir) if "peak_memory_bytes" in m]
    if len(steps) != STEPS:
        raise Failed(f"peak_memory_bytes in {len(steps)} of {STEPS} steps' metrics (metrics.log_interval = 1)")
    rows = run.summary["memory_per_rank"]
    state = sum(rows[0][k] for k in ("params", "grads", "optimizer"))
    peak = run.summary["peak_memory_bytes"]
    largest = max(m["peak_memory_bytes"] for m in steps)
    if peak != largest:
        raise Failed(f"summary.json's peak {peak} is not the largest step's, {largest}")
    if not state <= peak < ctx.gpu_bytes:
        raise Failed(f"CUDA peak {peak} bytes: expected between the model state ({state}) and the GPU's memory "
                     f"({ctx.gpu_bytes})")
    return (f"CUDA peak {mib(peak)} in metrics.jsonl and summary.json: at least the model state {mib(state)}, below "
            f"{mib(ctx.gpu_bytes)}")


def p_start_memory(ctx: Ctx) -> str:
    run = fp32_run(ctx)
    params = run.summary["memory_per_rank"][0]["params"]
    start = run.summary["start_memory_bytes"]
    if not params <= start <= params + 2**20:
        raise Failed(f"the start allocated {start} bytes on the GPU for {params} bytes of parameters: expected those "
                     f"and at most 1 MiB more (the init is computed on the CPU)")
    return f"the start allocated {mib(start)} on the GPU for {mib(params)} of parameters"


# name: (what it needs CUDA for, or None: it runs on a CPU too; the function)
PATHS = {
    "train-fp32": ("shoal train on a GPU", p_train_fp32),
    "train-bf16": ("bf16 autocast on a GPU", p_train_bf16),
    "train-fp16": ("fp16 and its loss scaler train on GPUs only", p_train_fp16),
    "train-compile": ("torch.compile of a GPU run", p_train_compile),
    "train-fp8": ("float8 matmuls (compute capability 8.9 or newer)", p_train_fp8),
    "train-checkpointing": ("activation checkpointing on a GPU (the CUDA peak)", p_train_checkpointing),
    "host-syncs": ("torch's sync debug mode (a CPU step reads its loss by design)", p_host_syncs),
    "cuda-memory": ("CUDA's peak memory", p_cuda_memory),
    "start-memory": ("CUDA's allocated memory", p_start_memory),
    "probe": (None, commands.p_probe),
    "plan": (None, commands.p_plan),
    "plan-check": (None, commands.p_plan_check),
    "run-ddp-script": ("a CUDA + NCCL script (shoal run --cpu runs it on CPUs: tests/integration/test_shoal_run.py)",
                       commands.p_run_ddp_script),
    "session": (None, commands.p_session),
    "env-check": (None, commands.p_env_check),
    "resume-gpu-cpu": (None, commands.p_resume),
    "export": (None, commands.p_export),
    **{f"gloo-{name}": ("two workers sharing a GPU over gloo", commands.parity_path(name, layout))
       for name, layout in commands.LAYOUTS.items()},
    **{f"gloo-{name}": ("fp8 on two workers sharing a GPU over gloo",
                        commands.parity_path(name, layout, ("precision.dtype=fp8",), None))
       for name, layout in commands.FP8_LAYOUTS.items()},
    "ps-sync": ("a parameter server sharing a GPU over gloo", ranks.p_ps_sync),
    "ps-sparse": ("a parameter server sharing a GPU over gloo", ranks.p_ps_sparse),
    "ps-async": ("a parameter server sharing a GPU over gloo", ranks.p_ps_async),
    "live-heal": ("two live nodes sharing a GPU over gloo", ranks.p_live_heal),
}


def facts(ctx_env: dict, out: Path, logs: Path) -> dict:
    """torch's version and the device, asked of the interpreter the paths run in (and whether it imports shoal)."""
    code = ("import json, torch, shoal; c = torch.cuda.is_available(); "
            "print(json.dumps({'torch': torch.__version__, 'cuda': c, "
            "'name': torch.cuda.get_device_name(0) if c else None, "
            "'bytes': torch.cuda.get_device_properties(0).total_memory if c else 0}))")
    return python_json(code, cwd=out, env=ctx_env, log=logs / "00-facts.log")


def cpu_name() -> str:
    try:
        return next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


def context(out: Path, logs: Path) -> tuple[Ctx, dict]:
    """The paths' context in `out` (their run dirs) and `logs` (emptied), and the facts of the interpreter they run
    in (torch, CUDA, the device). The paths' interpreters import this checkout's shoal; profiles go to a cache of
    this invocation's own."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(logs, ignore_errors=True)
    cache = {"XDG_CACHE_HOME": str(out / "cache")}
    seen = facts(Bench(out, logs, cuda=True, extra=cache).env, out, logs)
    return Ctx(out, logs, seen["cuda"], seen["bytes"], cache), seen


def run_path(ctx: Ctx, name: str) -> tuple[str, str]:
    needs, fn = PATHS[name]
    if needs and not ctx.cuda:
        return "skip", f"no CUDA: {needs}"
    started = time.monotonic()
    try:
        detail, status = fn(ctx), "ok"
    except Failed as e:
        detail, status = str(e), "FAIL"
    except Exception as e:  # a check that broke: the path fails, the others still run
        detail, status = f"{type(e).__name__}: {e}", "FAIL"
    return status, f"{' '.join(detail.split())} ({time.monotonic() - started:.1f} s)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated paths to run (default: all; --list names them)")
    ap.add_argument("--list", action="store_true", help="list the paths and exit")
    ap.add_argument("--out", help="folder for the run dirs and logs (kept); default: a temporary one")
    ap.add_argument("--logs", help="folder for every command's output (default: <out>/logs)")
    args = ap.parse_args()
    if args.list:
        for name, (needs, _) in PATHS.items():
            print(f"{name:20s} {'needs CUDA: ' + needs if needs else 'runs on a CPU too'}")
        return 0
    chosen = args.only.split(",") if args.only else list(PATHS)
    unknown = [n for n in chosen if n not in PATHS]
    if unknown:
        ap.error(f"unknown path(s) {', '.join(unknown)}; --list names them")
    started = time.monotonic()
    out = Path(args.out).resolve() if args.out else Path(tempfile.mkdtemp(prefix="shoal-gpu-paths-"))
    logs = Path(args.logs).resolve() if args.logs else out / "logs"
    try:
        ctx, seen = context(out, logs)
    except Failed as e:  # torch or shoal does not import: no path can run
        print(f"FAIL  setup  {e} (logs in {logs})")
        print(f'RESULT ok=0 failed=1 skipped=0 seconds={time.monotonic() - started:.0f} device="?" torch=?')
        return 1
    device = seen["name"] if seen["cuda"] else f"CPU ({cpu_name()})"
    print(f"gpu_paths: {len(chosen)} path(s) on {device}, torch {seen['torch']}; run dirs in {out}, logs in {logs}",
          flush=True)
    counts = {"ok": 0, "FAIL": 0, "skip": 0}
    width = max(len(n) for n in chosen)
    for name in chosen:
        status, detail = run_path(ctx, name)
        counts[status] += 1
        print(f"{status:<6}{name:<{width}}  {detail}", flush=True)
    if not args.out and not counts["FAIL"]:
        shutil.rmtree(out, ignore_errors=True)
    print(f'RESULT ok={counts["ok"]} failed={counts["FAIL"]} skipped={counts["skip"]} '
          f'seconds={time.monotonic() - started:.0f} device="{device}" torch={seen["torch"]}')
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
