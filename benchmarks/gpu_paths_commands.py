"""benchmarks/gpu_paths.py's paths beyond `shoal train` itself: the planner, users' scripts under `shoal run`,
`shoal env --check`, a run resumed across devices, export, and two workers sharing the GPU (`shoal parity`).
Each takes the invocation's Ctx and returns its one-line detail, or raises Failed with the reason."""

from __future__ import annotations

import json
import math
import re

from benchmarks.gpu_paths_tools import STEPS, Ctx, check_close, fp32_run, layout_line, mib, step_records, train
from benchmarks.harness import ROOT, Failed, last_line

FIXTURES = ROOT / "tests" / "fixtures"
TUTORIAL = FIXTURES / "pytorch_examples" / "multigpu_torchrun.py"  # PyTorch's DDP tutorial, unchanged
# a user's loop over shoal.Session, unchanged (sess.data() hands its batches out on the GPU)
SESSION = FIXTURES / "session_script.py"
# the second config of each parity check; the first is one process (dp = 1)
LAYOUTS = {"dp": "dp = 2\n", "zero2": "dp = 2\nzero = 2\n", "zero3": "dp = 2\nzero = 3\n", "tp2": "dp = 1\ntp = 2\n"}
# precision.dtype = "fp8" in both runs: tp 2 split by torchao's float8 styles (over gloo, those that move nothing in
# float8 between ranks), ZeRO 3 gathering its float8 weights in float8 (FSDP2 gathers them as bytes)
FP8_LAYOUTS = {"fp8-tp2": LAYOUTS["tp2"], "fp8-zero3": LAYOUTS["zero3"]}
PARITY_STEPS = 8
# shoal parity's fp32 default is 1e-5, which CPUs hold; on a GPU the two layouts' matmuls have other shapes, for
# which cuBLAS picks other kernels, each rounding its own way
PARITY_RTOL = 1e-4
# a Session's peak on CUDA is the caching allocator's count, a few MiB for its MLP; on a CPU it is the process's
# resident set, hundreds of MiB with torch loaded
SESSION_CUDA_PEAK = 256 * 2**20
PLAN_ROW = re.compile(r"^(.+?)\s+predicted\s+(\S+(?: [KMG]iB| B)?)\s+measured\s+(\S+(?: [KMG]iB| B)?)\s+error (\S+)$")


def plan_cache(ctx: Ctx):
    """XDG_CACHE_HOME of `shoal plan` and `plan --check`: empty before the plan, which measures this machine on the
    spot and keeps its profile there for the check (probe's profile goes to a cache of its own)."""
    return ctx.out / "plan" / "cache"


def p_probe(ctx: Ctx) -> str:
    folder = ctx.folder("probe")
    profile = folder / "profile.json"
    r = ctx.shoal("probe", ["probe", "--no-calibrate", "--nproc", "1", "--out", profile], cwd=folder, timeout=420,
                  env={"XDG_CACHE_HOME": str(folder / "cache")})
    p = json.loads(profile.read_text())
    if p.get("device") != ctx.dev:
        raise Failed(f"profile of device {p.get('device')!r}, expected {ctx.dev!r}")
    rates = p.get("matmul_flops") or {}
    if not rates or not all(math.isfinite(v) and v > 0 for v in rates.values()):
        raise Failed(f"matmul rates {rates}")
    if not p.get("memory_bandwidth", 0) > 0:
        raise Failed(f"copy bandwidth {p.get('memory_bandwidth')}")
    wrote = next((ln for ln in r.stdout.splitlines() if ln.startswith("wrote ")), "wrote ?: ?")
    return f"{p['device']} profile: {wrote.split(': ', 1)[1]}"


def p_plan(ctx: Ctx) -> str:
    folder = ctx.folder("plan")
    r = ctx.shoal("plan", ["plan", ctx.config()], cwd=folder, timeout=300, env={"XDG_CACHE_HOME": str(plan_cache(ctx))})
    measured = re.search(r"measured on the spot in [\d.]+ s", r.stdout)
    valid = re.search(r"(\d+) valid layouts", r.stdout)
    if not measured or not valid:
        raise Failed(f"no profile measured on the spot, or no table: {r.stdout.splitlines()[:2]}")
    rows = [re.split(r"[│|]", ln) for ln in r.stdout.splitlines() if re.match(r"\W+\d+\W+dp\d", ln)]
    # cells: "", "#", "layout", "step", ...
    untimed = [cells[2].strip() for cells in rows if not re.fullmatch(r"[\d.]+ (ms|s|us|µs)", cells[3].strip())]
    if not rows or untimed or len(rows) != min(int(valid.group(1)), 15):
        raise Failed(f"{len(rows)} rows of {valid.group(1)} valid layouts; without a step time: {untimed[:3]}")
    return (f"profile {measured.group(0)}; {valid.group(1)} valid layouts, each with a step time; fastest "
            f"{rows[0][2].strip()} at {rows[0][3].strip()}")


def p_plan_check(ctx: Ctx) -> str:
    run = fp32_run(ctx)
    plan_cache(ctx).mkdir(parents=True, exist_ok=True)
    r = ctx.shoal("plan-check", ["plan", "--check", run.dir], cwd=ctx.out, timeout=120,
                  env={"XDG_CACHE_HOME": str(plan_cache(ctx))})
    rows = {m.group(1).strip(): m for m in (PLAN_ROW.match(ln) for ln in r.stdout.splitlines()) if m}
    for name in ("params (bytes)", "grads (bytes)", "optimizer (bytes)", "model state (bytes)"):
        err = rows[name].group(4) if name in rows else None
        if err is None or err == "?" or abs(float(err.rstrip("%"))) > 1.0:
            raise Failed(f"{name}: {rows[name].group(0) if name in rows else 'no row'} (expected within 1%)")
    step, peak = rows.get("step time (s)"), rows.get("peak (bytes)")
    timing = (f"step time predicted {step.group(2)} s, measured {step.group(3)} s ({step.group(4)})" if step
              else "no step time (no profile cached: the plan path makes one)")
    peaks = f"peak predicted {peak.group(2)}, measured {peak.group(3)} ({peak.group(4)})" if peak else "no peak row"
    state = rows["model state (bytes)"]
    return f"{len(rows)} rows; model state {state.group(3)} ({state.group(4)}); {timing}; {peaks}"


def p_run_ddp_script(ctx: Ctx) -> str:
    folder = ctx.folder("run-ddp-script")
    r = ctx.shoal("run-ddp-script", ["run", "--nproc", "1", TUTORIAL, "2", "1", "--batch_size", "32"], cwd=folder,
                  timeout=180)
    for epoch in (0, 1):  # 2048 samples in batches of 32 on one rank
        line = f"[GPU0] Epoch {epoch} | Batchsize: 32 | Steps: 64"
        if line not in r.stdout:
            raise Failed(f"no {line!r} in its output: {last_line(r.out)}")
    if "Epoch 1 | Training snapshot saved at snapshot.pt" not in r.stdout:
        raise Failed(f"no snapshot saved after epoch 1: {last_line(r.out)}")
    snap = ctx.python("run-ddp-script", (
        "import json, torch; s = torch.load('snapshot.pt'); m = s['MODEL_STATE']; "
        "print(json.dumps({'devices': sorted({str(t.device) for t in m.values()}), 'n': len(m), "
        "'finite': all(bool(t.isfinite().all()) for t in m.values()), 'epoch': s['EPOCHS_RUN']}))"), cwd=folder)
    if snap["devices"] != ["cuda:0"] or not snap["finite"] or snap["epoch"] != 1:
        raise Failed(f"snapshot.pt: {snap} (expected finite tensors on cuda:0, epoch 1)")
    return f"2 epochs of 64 steps over NCCL; snapshot.pt of epoch 1: {snap['n']} finite tensors on cuda:0"


def p_session(ctx: Ctx) -> str:
    folder = ctx.folder("session")
    whole, cut = folder / "whole", folder / "killed"
    ctx.shoal("session", ["run", "--nproc", "1", SESSION, whole], cwd=folder, timeout=180)
    ctx.shoal("session", ["run", "--nproc", "1", SESSION, cut], cwd=folder, timeout=180, expect=137,
              env={"KILL_AT": "5"})  # rank 0 SIGKILLs itself after step 5 (checkpoints every 2 steps)
    again = ctx.shoal("session", ["run", "--nproc", "1", SESSION, cut], cwd=folder, timeout=180)
    if "starting at step 4" not in again.stdout:
        raise Failed(f"the rerun did not start from step 4's checkpoint: {last_line(again.out)}")
    losses = {m["step"]: m["loss"] for m in step_records(whole)}
    redone = step_records(cut)
    # step 5 is written before the kill only when its report was read by then (a step may be read a step late):
    # every step once, or step 5 twice, each with the uninterrupted run's loss
    steps = [m["step"] for m in redone]
    if steps not in ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 5, 6, 7, 8]) or any(
            m["loss"] != losses[m["step"]] for m in redone):
        raise Failed(f"steps {steps} and losses of the killed run differ from the uninterrupted one: {redone[:2]}...")
    same = ctx.python("session", (
        "import json, torch; from safetensors.torch import load_file; "
        f"a, b = load_file({str(whole / 'model.safetensors')!r}), load_file({str(cut / 'model.safetensors')!r}); "
        "print(json.dumps({'n': len(a), 'equal': a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)}))"),
        cwd=folder)
    if not same["equal"]:
        raise Failed("the killed and rerun script's final weights differ from the uninterrupted run's")
    peak = json.loads((whole / "summary.json").read_text())["memory_per_rank"][0]["peak"]
    if ctx.cuda and not 0 < peak < SESSION_CUDA_PEAK:
        raise Failed(f"peak {mib(peak)}: not CUDA's allocator's count, so not trained on the GPU")
    where = f"the GPU (peak {mib(peak)}, CUDA's allocator)" if ctx.cuda else f"the CPU (peak RSS {mib(peak)})"
    return (f"8 steps on {where}; killed after step 5 and rerun from step 4, every loss and the {same['n']} final "
            f"tensors bitwise those of an uninterrupted run")


def p_env_check(ctx: Ctx) -> str:
    folder = ctx.folder("env-check")
    r = ctx.shoal("env-check", ["env", "--check", "--nproc", "1"], cwd=folder, timeout=240, expect=None)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("ok ", "FAIL"))]
    failed = [ln for ln in lines if ln.startswith("FAIL")]
    if r.rc != 0 or failed or not lines:
        raise Failed(f"exit {r.rc}: {failed[0] if failed else last_line(r.out)}")
    names = [ln.split()[1] for ln in lines]
    if not {"collective", "matmul", "training"} <= set(names):
        raise Failed(f"checks {names}: expected collective, matmul and training")
    matmul = next(ln for ln in lines if ln.split()[1] == "matmul")
    return f"{len(lines)} checks ok ({', '.join(names)}); {' '.join(matmul.split()[2:])}"


def p_resume(ctx: Ctx) -> str:
    run_dir = ctx.folder("resume-gpu-cpu") / "run"
    k = STEPS // 3
    parts = [(k, ctx.dev), (2 * k, "cpu"), (3 * k, ctx.dev)]  # the same command, asking for more steps each time
    runs = [train(ctx, "resume-gpu-cpu", run_dir, [f"train.steps={steps}", f"parallel.device={dev}"])
            for steps, dev in parts]
    for (steps, _), r in zip(parts[:-1], runs[1:], strict=True):
        if not re.search(rf"resumed from .* \(step {steps}\)", r.out):
            raise Failed(f"the run to step {steps + k} did not resume from step {steps}: {last_line(r.out)}")
    recorded = [m["step"] for m in step_records(run_dir)]
    if recorded != list(range(1, STEPS + 1)):
        raise Failed(f"metrics.jsonl records steps {recorded}, expected 1..{STEPS} once each")
    close = check_close(runs[-1].losses, fp32_run(ctx).losses, range(1, STEPS + 1), 1e-4, "an uninterrupted run")
    where = ", ".join(f"{s - k + 1}-{s} on {dev} ({layout_line(r)})" for (s, dev), r in zip(parts, runs, strict=True))
    return f"steps {where}, each part resuming the last: every step's loss {close}"


def p_export(ctx: Ctx) -> str:
    run = fp32_run(ctx)
    folder = ctx.folder("export")
    out = folder / "model.safetensors"
    r = ctx.shoal("export", ["export", run.dir, "--out", out], cwd=folder, timeout=120)
    if f"(step {STEPS})" not in r.stdout:
        raise Failed(f"not the checkpoint of step {STEPS}: {last_line(r.out)}")
    got = ctx.python("export", f"""
import json, torch
from safetensors.torch import load_file, load_model
from shoal.config import load_config
from shoal.models.registry import build_model
from shoal.models.spec import DataSpec
exported, final = load_file({str(out)!r}), load_file({str(run.dir / 'model.safetensors')!r})
cfg = load_config({str(run.dir / 'config.toml')!r})
model = build_model(cfg.model, DataSpec("tokens", vocab_size=256)).model
load_model(model, {str(out)!r})  # strict: every tensor of the model, nothing else
model = model.to({ctx.dev!r}).eval()
with torch.no_grad():
    logits = model(torch.randint(0, 256, (2, cfg.model.seq_len), device={ctx.dev!r}))
print(json.dumps({{"n": len(exported), "equal": exported.keys() == final.keys() and all(
    torch.equal(exported[k], final[k]) for k in final), "finite": bool(logits.isfinite().all()),
    "device": str(logits.device)}}))""", cwd=folder)
    if not got["equal"] or not got["finite"]:
        raise Failed(f"exported weights {got} (expected bitwise the run's final weights, finite logits)")
    return (f"checkpoint of step {STEPS} exported: {got['n']} tensors, bitwise the run's final weights; loaded into "
            f"the one-process GPT, finite logits on {got['device']}")


def parity_path(name: str, layout: str, sets: tuple[str, ...] = (), rtol: float | None = PARITY_RTOL):
    """The path `gloo-<name>`: `layout` ([parallel] keys) on two workers sharing the GPU, against one process;
    `sets`: --set overrides of both runs; `rtol` None: shoal parity's default for their number format."""
    def p_parity(ctx: Ctx) -> str:
        folder = ctx.folder(f"gloo-{name}")
        one = ctx.config("one.toml", "\n[parallel]\ndp = 1\n")
        other = ctx.config(f"{name}.toml", "\n[parallel]\n" + layout)
        both = [a for s in (f"parallel.device={ctx.dev}", "parallel.backend=gloo", *sets) for a in ("--set", s)]
        rtols = ["--rtol", rtol] if rtol else []
        r = ctx.shoal(f"gloo-{name}", ["parity", one, other, "--steps", PARITY_STEPS, *rtols, *both],
                      cwd=folder, timeout=300, expect=None)
        verdict = next((ln for ln in r.stdout.splitlines() if ln.startswith(("PASS", "FAIL"))), None)
        if r.rc != 0 or not verdict or not verdict.startswith("PASS"):
            raise Failed(verdict or f"exit {r.rc}: {last_line(r.out)}")
        where = f"2 workers sharing the {ctx.dev} over gloo"
        return f"{layout.strip().replace(chr(10), ', ')}: {where} vs 1 process, {PARITY_STEPS} steps: {verdict}"
    return p_parity
