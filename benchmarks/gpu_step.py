"""One GPU's training step: `shoal train` against the plain loop a user writes, in one command.

The same model, data shape and seed on both sides: a GPT of GPT-2 124M's shape (12 layers x 768, 12 heads, 1024
tokens, vocabulary 50304), bf16 autocast, one process, a global batch of one micro-batch (no accumulation), read
from one token file of uniform random ids (uniform over GPT-2's 50257). Per micro-batch (16 and 64; where one does
not fit, the largest power-of-two fraction of it that does, found by the plain loop's eager run, which uses the
most memory), eager and then compiled, --pairs pairs (3; 2 with --quick) of the two sides run one after the other,
the order swapped in every other pair so that a drift of the card's clock or temperature hits both alike (and one
tuned run with --tuned), each a process of its own:
  plain loop, eager / compiled   benchmarks/gpu_step_loop.py: nanoGPT's loop (fused AdamW, SDPA, pinned batches
                                 copied non_blocking, the loss read at logged steps only) around the model shoal's
                                 own builder makes from the same config file and seed; torch.compile of the
                                 model and its loss
  shoal train, eager / compiled  `python -m shoal train CONFIG --nproc 1` (train.compile = true), its defaults but
                                 for no checkpoints, no TensorBoard and validation only at the end (once, one log
                                 interval after the last timed step)
Step time, both sides alike: the wall time from the end of logged step W (the warm-up: compilation, the
allocator, first touches) to the end of logged step W + N, over N; logged steps every 10, so a log step's read-back
is in the window as often as it is in a run. shoal's ends are the `time` of those steps in metrics.jsonl, stamped
after the step's results were read back (a logged step is read at once), neither of them the run's last step; the
plain loop's, a torch.cuda.synchronize and the clock at the same steps. (summary.json's median_step_time_s, shoal's
own per-step figure, is printed beside it.)
Per (mode, micro-batch) the ratio is taken within each pair and reported as the median and range of the pairs'. Each
run's SM clock, temperature and power are sampled by nvidia-smi every 250 ms (beside its row, and their range in the
summary). TF32 is left at torch's default on both sides. The loss each side computes is printed first, with the head
and loss alone timed (gpu_step_loop.py loss): the loop's F.cross_entropy under autocast against shoal's plain, fused
(model.fused_loss, an eager GPT's default on CUDA) and chunked losses, each's time, memory and error against float64.
--trace adds, at the first micro-batch, one compiled run of each side with torch.profiler over the 3 steps after the
warm-up (shoal's metrics.trace_steps; the loop's own profiler), both traces kept under --out, and what each shows per
step: kernels (operators on a CPU), the device's busy and idle time in the traced span, the largest kernels by time,
and the kernels one side runs and the other does not.
MFU: 6N + 12 L T d FLOPs per token (N the matmul weights: every parameter but the position table, the tied
embedding once, as nanoGPT's estimate_mfu and shoal's profile count them), against the card's data-sheet dense
bf16 peak (shoal.hardware's preset for the card; none for a card without one) and against a bf16 8192^3 matmul
measured at the start of the run (best of 5). Host syncs per step, over the 10 steps after the warm-up of an eager
run at the first micro-batch, as shoal's metrics.host_syncs counts them (on CUDA torch's sync debug mode, "warn":
.item(), .tolist(), copies to the host, stream syncs; on the CPU the reads of one value), on both sides: in the
plain loop's own process after its timed steps, in shoal's in a short run of its own (counting is never timed). Peak
memory: CUDA's peak allocated bytes (shoal: summary.json's peak_memory_bytes).

    python -m benchmarks.gpu_step [--quick] [--micro 16,64] [--pairs 3] [--trace] [--tuned] [--fp8 | --fp8-only]
                                  [--out DIR]
    bash benchmarks/gpu_step.sh [ARGS]     (a GPU machine whose python3 has torch: the wheels it lacks in .whl/)

Sized for ~12 minutes on one H100 at one micro-batch (--micro 16), ~20 at both (each pair: two process starts and,
compiled, two torch.compile's from a warm inductor cache). Without CUDA it runs the same
code on the CPU with a tiny GPT (2 x 64, 64 tokens, vocabulary 512, micro-batches 2 and 4, 2 + 4 steps; compiled
through dynamo and AOTAutograd only, not inductor) and says its figures are not GPU figures; --quick runs the tiny
GPT on a GPU. --fp8 adds `shoal train` of a ~1B GPT (18 x 2048) in bf16 against precision.dtype = "fp8" (float8
linear layers through torchao), compiled, the same 50 steps: step time and the loss curve; it runs where shoal takes
that dtype, torchao imports and the card has compute capability >= 8.9, and says which of those it lacks otherwise.
--tuned adds, at each micro-batch, a `shoal train` with what docs/gpus.md tells a GPU user to set for speed (TUNED:
CUDA graphs, the loss over chunks), against the compiled plain loop (tuned_ratio_mbN), where this shoal takes them.

Targets on one H100: shoal / plain loop <= 1.00 eager and compiled; best MFU >= 41% (llm.c's on this model and card).
Last line: RESULT card=... device=cuda|cpu torch=... eager_ratio_mb16=<median> ... eager_spread_mb16=<min>-<max> ...
(per micro-batch run) best_mfu=<shoal's, data sheet> best_mfu_plain=... matmul_tflops=... loss_fused_vs_loop=...
syncs_shoal=... syncs_plain=... seconds=...
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import gpu_step_report as report
from benchmarks import harness
from benchmarks.harness import HERE, Failed, gpt_on_tokens, read_jsonl, run

GPT2 = {"n_layer": 12, "n_head": 12, "d_model": 768, "seq_len": 1024, "vocab_size": 50304}
TINY = {"n_layer": 2, "n_head": 2, "d_model": 64, "seq_len": 64, "vocab_size": 512}
FP8_GPT = {"n_layer": 18, "n_head": 16, "d_model": 2048, "seq_len": 1024, "vocab_size": 50304}  # ~1.0B
# Without CUDA, torch.compile goes through dynamo and AOTAutograd only, on both sides: inductor's C++ compile of even
# the tiny GPT takes ~45 s a run on 2 CPU cores with its cache cold, and the CPU run only shows that the code runs
DATA_VOCAB = {50304: 50257, 512: 500}  # token ids drawn below this (GPT-2's vocabulary, padded to 50304)
# --tuned: what docs/gpus.md tells a GPU user to set for speed (CUDA graphs; the loss without whole logits)
TUNED = ["train.compile=reduce-overhead", "model.loss_chunks=8"]


class Bench(harness.Bench):
    """The invocation: the shape, the step counts, the token file, the device's facts."""

    def __init__(self, args, out: Path, logs: Path):
        super().__init__(out, logs, args.cuda)
        self.args = args
        self.shape = TINY if args.quick else GPT2
        self.warmup, self.timed, self.interval = args.warmup, args.timed, args.log_interval
        self.tokens = out / "tokens.bin"
        self.facts: dict = {}

    def config(self, name: str, shape: dict, steps: int, warmup: int, interval: int) -> Path:
        return gpt_on_tokens(self.out / "configs" / f"{name}.toml", shape, self.tokens, steps=steps, warmup=warmup,
                             interval=interval, dtype="bf16")

    def step_config(self) -> Path:
        """shoal's runs: one log interval past the timed window, whose ends are then both steps in mid-run."""
        return self.config("step", self.shape, self.warmup + self.timed + self.interval, self.warmup, self.interval)


def prepare(b: Bench) -> dict:
    """The device's facts and matmul rate, and the token file (enough windows for the largest run, twice)."""
    steps = b.warmup + b.timed + b.interval
    count = 2 * max(b.args.micro_batches) * steps * (b.shape["seq_len"] + 1) + 100_000
    if b.args.fp8 or b.args.fp8_only:
        count = max(count, 2 * FP8_MICRO * FP8_STEPS * (FP8_GPT["seq_len"] + 1))
    r = run([sys.executable, HERE / "gpu_step_loop.py", "prepare", "--tokens", b.tokens, "--count", count,
             "--vocab", DATA_VOCAB[b.shape["vocab_size"]], "--matmul", 512 if b.args.quick else 8192,
             "--tuned", *TUNED],
            cwd=b.out, env=b.env, timeout=300, log=b.log("prepare"))
    return json.loads(r.stdout.strip().splitlines()[-1])


def loss_costs(b: Bench) -> dict:
    """The head and its loss alone, the loop's against shoal's (gpu_step_loop.py loss), at the first micro-batch."""
    s = b.shape
    r = run([sys.executable, HERE / "gpu_step_loop.py", "loss", "--micro", b.args.micro_batches[0], "--seq",
             s["seq_len"], "--d-model", s["d_model"], "--vocab", s["vocab_size"], "--reps", 5 if b.args.quick else 20],
            cwd=b.out, env=b.env, timeout=300, log=b.log("loss"))
    return json.loads(r.stdout.strip().splitlines()[-1])


def plain_run(b: Bench, mb: int, compiled: bool, config: Path) -> dict:
    """The plain loop's run at micro-batch `mb`: its JSON, {"oom": ...} when it did not fit."""
    mode = "compiled" if compiled else "eager"
    cmd = [sys.executable, HERE / "gpu_step_loop.py", "train", config, "--micro", mb, "--warmup", b.warmup,
           "--timed", b.timed, "--log-interval", b.interval, "--sync-steps", b.interval if not compiled else 0,
           *(["--compile"] if compiled else [])]
    r = run(cmd, cwd=b.out, env=b.env, timeout=420 if compiled else 240, log=b.log(f"plain-{mode}-mb{mb}"),
            expect=None)
    last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    if r.rc == 3 and '"oom"' in last:
        return json.loads(last)
    if r.rc != 0:
        raise Failed(f"the plain loop exited {r.rc}: {report.tail(r.out)}")
    return json.loads(last)


def shoal_run(b: Bench, name: str, config: Path, sets: list[str], warmup: int, steps: int,
              env: dict | None = None, timeout: float = 240) -> dict:
    """`shoal train` of `config` in a run dir of its own: its step time from the end of logged step `warmup` to the
    end of logged step `steps` (metrics.jsonl's stamps), its losses, peak and own median; {"oom": ...} when it did
    not fit."""
    run_dir = b.out / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    args = [sys.executable, "-m", "shoal", "train", config, "--nproc", "1", "--run-dir", run_dir,
            *[a for s in sets for a in ("--set", s)]]
    r = run(args, cwd=b.out, env={**b.env, **(env or {})}, timeout=timeout, log=b.log(name), expect=None)
    if r.rc != 0:
        if "out of memory" in r.out.lower():
            return {"oom": report.tail(r.out)}
        raise Failed(f"shoal train exited {r.rc}: {report.tail(r.out)}")
    records = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "loss" in m]
    stamps = {m["step"]: m["time"] for m in records}
    if warmup not in stamps or steps not in stamps:
        raise Failed(f"metrics.jsonl has no record of step {warmup} or {steps} (logged: {sorted(stamps)})")
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"step_s": (stamps[steps] - stamps[warmup]) / (steps - warmup), "steps_timed": steps - warmup,
            "stamps": stamps, "peak_bytes": summary.get("peak_memory_bytes"), "own_median_s":
            summary.get("median_step_time_s"), "losses": {m["step"]: m["loss"] for m in records}, "summary": summary}


class Clocks:
    """The GPU's SM clock, temperature and power while a run goes (nvidia-smi every 250 ms, in a process of its
    own): a ratio of 3% means nothing if one side ran throttled. Off a GPU, or without nvidia-smi: nothing."""

    QUERY = "clocks.sm,temperature.gpu,power.draw"

    def __init__(self, cuda: bool):
        self.cuda, self.proc = cuda and shutil.which("nvidia-smi") is not None, None

    def __enter__(self):
        if self.cuda:
            self.proc = subprocess.Popen(["nvidia-smi", "-i", "0", f"--query-gpu={self.QUERY}", "--format=csv,noheader,"
                                          "nounits", "-lms", "250"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                         text=True)
        return self

    def __exit__(self, *exc):
        self.samples = []
        if self.proc is not None:
            self.proc.terminate()
            out, _ = self.proc.communicate(timeout=10)
            for line in out.splitlines():
                try:
                    self.samples.append([float(x) for x in line.split(",")])
                except ValueError:  # "[N/A]" or a half-written last line
                    continue
        return False

    def summary(self) -> dict | None:
        if not self.samples:
            return None
        sm, temp, power = zip(*self.samples, strict=True)
        return {"sm_mhz_median": statistics.median(sm), "sm_mhz_min": min(sm), "temp_c_max": max(temp),
                "power_w_mean": statistics.fmean(power), "samples": len(sm)}


def side_run(b: Bench, who: str, mode: str, mb: int, config: Path, pair: int) -> dict:
    """One run of `who` ("plain loop" or "shoal train") at `mode` and `mb`, with the clocks it ran at: its row."""
    with Clocks(b.facts["cuda"]) as clocks:
        try:
            if who == "plain loop":
                got = plain_run(b, mb, mode == "compiled", config)
            else:
                sets = [f"train.micro_batch_size={mb}", f"train.global_batch_size={mb}",
                        *(TUNED if mode == "tuned" else [f"train.compile={str(mode == 'compiled').lower()}"])]
                got = shoal_run(b, f"shoal-{mode}-mb{mb}-{pair}", config, sets, b.warmup, b.warmup + b.timed,
                                timeout=240 if mode == "eager" else 420)
        except Failed as e:
            got = {"failed": str(e)}
    r = (report.failed_row(who, mode, mb, got["failed"]) if "failed" in got
         else report.oom_row(who, mode, mb, got["oom"]) if "oom" in got else report.row(who, mode, mb, got, b))
    r.update(pair=pair, clocks=clocks.summary())
    return r


def micro_batch_runs(b: Bench, mb: int, done: set[int], rows: list) -> None:
    """The runs at `mb`, or at the largest halving of it that fits and was not measured already (the plain loop's
    eager run finds it: it holds the most memory of the four, as measured on an H100): eager, then compiled, each
    as --pairs pairs of the plain loop and shoal run one after the other, the order swapped in every other pair so
    that a drift of the card's clock or temperature hits both sides alike."""
    config = b.step_config()
    while True:
        first = side_run(b, "plain loop", "eager", mb, config, 0)
        if first["status"] != "OOM" or mb // 2 < 1 or mb // 2 in done:
            break
        rows.append(first)
        report.show(rows[-1])
        mb //= 2
    done.add(mb)
    for mode in ("eager", "compiled"):
        for pair in range(b.args.pairs):
            order = ("plain loop", "shoal train") if pair % 2 == 0 else ("shoal train", "plain loop")
            for who in order:
                rows.append(first if (mode, pair, who) == ("eager", 0, "plain loop")
                            else side_run(b, who, mode, mb, config, pair))
                report.show(rows[-1])
    if b.args.tuned and b.facts["cuda"] and b.facts["shoal_tuned"]:
        rows.append(side_run(b, "shoal train", "tuned", mb, config, 0))
        report.show(rows[-1])


TRACED = 3  # steps traced on each side, from the one after the warm-up


def traces(b: Bench, mb: int) -> dict:
    """--trace: one compiled run of each side at `mb` with torch.profiler over the same TRACED steps after the
    warm-up (shoal's metrics.trace_steps, the loop's own profiler), and what each trace shows per step."""
    first, last = b.warmup + 1, b.warmup + TRACED
    config, folder = b.step_config(), b.out / "traces"
    shutil.rmtree(folder, ignore_errors=True)
    got = {}
    try:
        run([sys.executable, HERE / "gpu_step_loop.py", "train", config, "--micro", mb, "--warmup", b.warmup,
             "--timed", b.timed, "--log-interval", b.interval, "--sync-steps", 0, "--compile", "--trace-dir", folder,
             "--trace-steps", first, last], cwd=b.out, env=b.env, timeout=420, log=b.log(f"trace-plain-mb{mb}"))
        got["plain loop"] = report.trace_summary(folder / "loop.pt.trace.json", TRACED)
        shoal_run(b, f"trace-shoal-mb{mb}", config, [f"train.micro_batch_size={mb}", f"train.global_batch_size={mb}",
                  "train.compile=true", f"metrics.trace_steps=[{first},{last}]"], b.warmup, b.warmup + b.timed,
                  timeout=420)
        [shoal_trace] = sorted((b.out / "runs" / f"trace-shoal-mb{mb}" / "traces").glob("rank0*.json"))
        got["shoal train"] = report.trace_summary(shoal_trace, TRACED)
    except (Failed, ValueError, OSError) as e:
        got["error"] = str(e)
    return {"mb": mb, "steps": [first, last], **got}


def shoal_syncs(b: Bench, mb: int) -> dict:
    """Host syncs per step inside `shoal train` (eager, micro-batch `mb`): shoal's own count (metrics.host_syncs, the
    median over the steps after the first) in a run of warm-up + one interval of its own (counting is never timed)."""
    steps = b.warmup + b.interval
    config = b.config("syncs", b.shape, steps + b.interval, b.warmup, b.interval)
    got = shoal_run(b, f"shoal-syncs-mb{mb}", config, [f"train.micro_batch_size={mb}", f"train.global_batch_size={mb}",
                                                      "metrics.host_syncs=true"], b.warmup, steps)
    if "oom" in got:
        raise Failed(f"out of memory: {got['oom']}")
    summary = got["summary"]
    return {"steps": summary["steps"], "per_step": summary["host_syncs_per_step"],
            "sites": {k: v / summary["steps"] for k, v in summary["host_sync_sites"].items()}}


FP8_MICRO, FP8_STEPS, FP8_WARMUP, FP8_INTERVAL = 8, 50, 10, 5


def fp8_compare(b: Bench) -> dict:
    """Part 5's comparison, where it can run: `shoal train` of the ~1B GPT in bf16 and in fp8, compiled, the same
    steps and data: step time over steps FP8_WARMUP..FP8_STEPS, and the loss every FP8_INTERVAL steps."""
    f, args = b.facts, b.args
    if not (args.fp8 or args.fp8_only):
        return {"status": "not run", "why": "--fp8 adds it (a ~1B GPT, shoal bf16 against precision.dtype = fp8)"}
    if not f["shoal_fp8"]:
        return {"status": "skipped", "why": "shoal has no fp8 yet"}
    if not f["cuda"]:
        return {"status": "skipped", "why": "no CUDA GPU"}
    if tuple(f["capability"]) < (8, 9):
        return {"status": "skipped", "why": f"compute capability {f['capability']} < 8.9: no float8 matmuls"}
    if not f["torchao"]:
        return {"status": "skipped", "why": "torchao is not importable (its wheel can travel in .whl/)"}
    shape = TINY if args.quick else FP8_GPT
    config = b.config("fp8", shape, FP8_STEPS, FP8_WARMUP, FP8_INTERVAL)
    runs = {}
    for dtype in ("bf16", "fp8"):
        sets = [f"train.micro_batch_size={FP8_MICRO}", f"train.global_batch_size={FP8_MICRO}", "train.compile=true",
                f"precision.dtype={dtype}"]
        try:
            runs[dtype] = shoal_run(b, f"fp8-{dtype}", config, sets, FP8_WARMUP, FP8_STEPS - FP8_INTERVAL,
                                    timeout=480)
        except Failed as e:
            runs[dtype] = {"error": str(e)}
    return {"status": "run", "shape": shape, "micro": FP8_MICRO, "steps": FP8_STEPS, "runs": runs}


def tuned_note(b: Bench) -> str:
    said = " ".join(TUNED)
    if not b.args.tuned:
        return f"tuned: not run: --tuned adds shoal train with {said} at each micro-batch"
    if not b.facts["cuda"]:
        return "tuned: skipped: no CUDA GPU (reduce-overhead captures CUDA graphs)"
    if not b.facts["shoal_tuned"]:
        return f"tuned: skipped: this shoal does not take {said}"
    return f"tuned: shoal train with {said}, against the compiled plain loop"


def defaults(ap: argparse.ArgumentParser, args, cuda: bool) -> None:
    """The step counts and micro-batches of a GPU run, or of --quick (implied without CUDA)."""
    args.quick, args.cuda = args.quick or not cuda, cuda
    q = args.quick
    args.micro_batches = [int(x) for x in (args.micro or ("2,4" if q else "16,64")).split(",")]
    args.warmup = args.warmup or (2 if q else 10)
    args.timed = args.timed or (4 if q else 30)
    args.log_interval = 2 if q else 10
    args.pairs = args.pairs or (2 if q else 3)
    if args.pairs < 1 or (args.pairs < 3 and not q):
        ap.error("--pairs: at least 3 (the median and spread of the ratios need them); 1 or more with --quick")
    if args.warmup % args.log_interval or args.timed % args.log_interval:
        ap.error(f"--warmup and --timed must be multiples of the log interval, {args.log_interval}: the window's "
                 f"ends are logged steps")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the tiny GPT and a few steps (implied without CUDA)")
    ap.add_argument("--micro", help="micro-batches, comma-separated (default 16,64; 2,4 with --quick)")
    ap.add_argument("--warmup", type=int, help="steps before the timed ones (default 10; 2 with --quick)")
    ap.add_argument("--timed", type=int, help="timed steps (default 30; 4 with --quick)")
    ap.add_argument("--pairs", type=int, help="alternated pairs of runs per setting (default 3; 2 with --quick)")
    ap.add_argument("--tuned", action="store_true", help="add shoal train with TUNED per micro-batch")
    ap.add_argument("--trace", action="store_true", help="add a torch.profiler trace of the compiled step, each side")
    ap.add_argument("--fp8", action="store_true", help="add the fp8 comparison (~1B GPT, bf16 against fp8)")
    ap.add_argument("--fp8-only", action="store_true", help="only the fp8 comparison")
    ap.add_argument("--out", help="folder for run dirs, configs, logs and gpu_step.json (kept); default: temporary")
    ap.add_argument("--logs", help="folder for every command's output (default: <out>/logs)")
    args = ap.parse_args()
    started = time.monotonic()
    import torch  # only to ask whether there is a GPU (no CUDA context is made here)

    defaults(ap, args, torch.cuda.is_available())
    out = Path(args.out).resolve() if args.out else Path(tempfile.mkdtemp(prefix="shoal-gpu-step-"))
    out.mkdir(parents=True, exist_ok=True)
    logs = Path(args.logs).resolve() if args.logs else out / "logs"
    shutil.rmtree(logs, ignore_errors=True)
    b = Bench(args, out, logs)
    try:
        b.facts = prepare(b)
    except Failed as e:  # torch or shoal does not import, or the device failed: nothing can run
        print(f"gpu_step: FAIL prepare: {e} (logs in {logs})")
        print(f"RESULT card=? device=? torch=? failed=1 seconds={time.monotonic() - started:.0f}")
        return 1
    report.header(b)
    try:
        b.facts["loss"] = loss_costs(b)
    except Failed as e:
        b.facts["loss"] = {"error": str(e)}
    report.loss_lines(b.facts["loss"])
    if not args.fp8_only:
        report.table_header()
    rows: list[dict] = []
    syncs: dict = {}
    if not args.fp8_only:
        done: set[int] = set()
        for mb in args.micro_batches:
            micro_batch_runs(b, mb, done, rows)
            report.save(b, rows, syncs)
            if mb == args.micro_batches[0]:
                try:
                    syncs = shoal_syncs(b, min(done))
                except Failed as e:
                    syncs = {"error": str(e)}
                report.save(b, rows, syncs)
                if args.trace:
                    b.facts["trace"] = traces(b, min(done))
                    report.trace_lines(b.facts["trace"])
    fp8 = fp8_compare(b)
    failed = report.summary(b, rows, syncs, fp8, time.monotonic() - started, tuned_note(b))
    report.save(b, rows, syncs, fp8)
    if not args.out and not failed:
        shutil.rmtree(out, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
