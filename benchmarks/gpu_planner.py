"""The planner against one GPU: plan, train a handful of layouts and micro-batch sizes, and hold each run against
what the planner predicted for it, in one command.

A GPT of GPT-2 124M's shape (12 layers x 768, 12 heads, 1024 tokens, vocabulary 50304), stdlib-text (byte tokens
into the model's vocabulary), bf16 autocast, one process, a global batch of one micro-batch. First `shoal plan
CONFIG --nproc 1` with an empty profile cache (under --out): it measures this machine on the spot and caches the
profile, and says so (its first line and what each part of the measurement took are printed). Then each run, a
`shoal train` of --steps steps in a process of its own:
  mb8            micro-batch 8
  mb16           micro-batch 16
  mb16-ckpt      micro-batch 16, precision.activation_checkpointing
  mb16-compile   micro-batch 16, train.compile
  mb16-chunks    micro-batch 16, model.loss_chunks = 8
  mb16-fp16      micro-batch 16, precision.dtype = fp16 (CUDA only)
and after it `shoal plan CONFIG --preset PRESET --nproc 1 --check RUN_DIR` (PRESET: the card's data sheet,
shoal.hardware.gpu_preset_for, h100 for a card without one) and `shoal plan CONFIG --nproc 1 --check RUN_DIR`
(the profile measured on the spot, from the cache). Every row `plan --check` prints (step time, model state,
peak, and whatever rows it adds) is read as printed, whatever its name. Per profile and quantity: the median
and the worst relative error over the runs.

    python -m benchmarks.gpu_planner [--runs mb8,mb16] [--steps 30] [--out DIR]
    bash benchmarks/gpu_planner.sh [ARGS]     (a GPU machine whose python3 has torch: the wheels it lacks in .whl/)

Sized for ~5 minutes on one H100 (the spot measurement, six trainings of 30 steps with one torch.compile, twelve
checks; about twenty process starts). Without CUDA it runs the same code on the CPU with a tiny GPT (2 x 64, 2
heads, 64 tokens, vocabulary 512, micro-batches 2 and 4, no fp16 run, 6 steps; compiled through dynamo and
AOTAutograd only, not inductor) and says its figures are not GPU figures; --quick runs the tiny GPT on a GPU.
Last line: RESULT card=... device=cuda|cpu torch=... preset=... runs=N spot_s=<the plan's measurement>
preset_step_time_median=... preset_step_time_worst=... preset_peak_median=... preset_peak_worst=... spot_...
(the same for the spot profile) failed=N seconds=...
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import gpu_planner_report as report
from benchmarks import harness
from benchmarks.gpu_step_report import tail
from benchmarks.harness import ROOT, Failed, run, write_config

GPT2 = {"n_layer": 12, "n_head": 12, "d_model": 768, "seq_len": 1024, "vocab_size": 50304}
TINY = {"n_layer": 2, "n_head": 2, "d_model": 64, "seq_len": 64, "vocab_size": 512}
# (suffix, --set values, CUDA only) of each run beyond its micro-batch: the smaller micro-batch plain, the larger
# plain and with each of these
VARIANTS = [("ckpt", ["precision.activation_checkpointing=true"], False), ("compile", ["train.compile=true"], False),
            ("chunks", ["model.loss_chunks=8"], False), ("fp16", ["precision.dtype=fp16"], True)]


class Bench(harness.Bench):
    """The invocation: the model, the runs, the device's facts."""

    def __init__(self, args, out: Path, logs: Path, facts: dict):
        # the plan's profile cache, emptied: the first plan measures this machine on the spot, the checks find it
        super().__init__(out, logs, facts["cuda"], extra={"XDG_CACHE_HOME": str(out / "cache")})
        self.args, self.facts = args, facts
        self.shape = TINY if args.quick else GPT2

    def shoal(self, name: str, args: list, timeout: float, expect: int | None = 0):
        return run([sys.executable, "-m", "shoal", *args], cwd=self.out, env=self.env, timeout=timeout,
                   log=self.log(name), expect=expect)

    def config(self) -> Path:
        """configs/gpt_planner.toml with this invocation's model, steps and first micro-batch."""
        small, steps = self.args.micro[0], self.args.steps
        return write_config("gpt_planner", self.out / "gpt.toml", {
            "model": self.shape, "metrics": {"log_interval": self.args.log_interval},
            "train": {"steps": steps, "micro_batch_size": small, "global_batch_size": small,
                      "warmup_steps": steps // 3}})


def runs(micro: list[int], cuda: bool) -> dict[str, list[str]]:
    """{name: --set values}: each micro-batch plain, and the largest with each variant this device takes."""
    out = {f"mb{mb}": [f"train.micro_batch_size={mb}", f"train.global_batch_size={mb}"] for mb in micro}
    large = max(micro)
    for suffix, sets, cuda_only in VARIANTS:
        if cuda or not cuda_only:
            out[f"mb{large}-{suffix}"] = out[f"mb{large}"] + sets
    return out


# the card's name and its data sheet's preset, read in a process of its own: a CUDA context this process kept would
# count, for the whole run, in the device memory every run and the probe measure outside torch's allocator
CARD = ("import json, torch; from shoal.hardware import gpu_preset_for; n = torch.cuda.get_device_name(0); "
        "p = gpu_preset_for(n); print(json.dumps([n, p.name if p else None]))")


def facts_of_this_machine() -> dict:
    """The card, torch, and the preset of the card's data sheet (h100 for a card without one, and on a CPU)."""
    import torch  # only to ask whether there is a GPU (no CUDA context is made here)

    from shoal.hardware import cpu_name

    cuda = torch.cuda.is_available()
    card, preset = f"CPU ({cpu_name()})", None
    if cuda:
        path = os.pathsep.join(p for p in [str(ROOT / "src"), os.environ.get("PYTHONPATH")] if p)
        r = subprocess.run([sys.executable, "-c", CARD], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": path}, check=True)
        card, preset = json.loads(r.stdout.strip().splitlines()[-1])
    return {"card": card, "device": "cuda" if cuda else "cpu", "torch": torch.__version__, "cuda": cuda,
            "preset": preset or "h100"}


def spot_plan(b: Bench, config: Path) -> dict:
    """`shoal plan CONFIG --nproc 1` on an empty cache: the measurement on the spot, its line and its parts."""
    shutil.rmtree(b.out / "cache", ignore_errors=True)
    started = time.monotonic()
    r = b.shoal("plan", ["plan", config, "--nproc", "1", "--top", "5"], timeout=600)
    took = time.monotonic() - started
    first = r.stdout.splitlines()[0] if r.stdout.strip() else ""
    measured = re.search(r"measured on the spot in (\d+) s", first)
    said = "shoal plan: measured "  # plan/profiles.py's line of what each part took
    parts = next((ln.removeprefix(said) for ln in r.stderr.splitlines() if ln.startswith(said)), None)
    if not measured:
        raise Failed(f"the plan measured nothing on the spot: {first or tail(r.out)}")
    best = next(([c.strip() for c in re.split(r"[│|]", ln) if c.strip()] for ln in r.stdout.splitlines()
                 if re.match(r"\W*1\W+dp\d", ln)), None)  # the table's first row: #, layout, step, ...
    return {"line": first, "seconds": took, "measured_s": int(measured[1]), "parts": parts,
            "best": f"{best[1]} at {best[2]}" if best and len(best) > 2 else None}


def train(b: Bench, name: str, config: Path, sets: list[str]) -> Path:
    """`shoal train` of the run into a run dir of its own; Failed with its last lines if it did not end well."""
    run_dir = b.out / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    compiled = any(s.startswith("train.compile") for s in sets)
    r = b.shoal(f"train-{name}", ["train", config, "--nproc", "1", "--run-dir", run_dir,
                                  *[a for s in sets for a in ("--set", s)]], timeout=480 if compiled else 300,
                expect=None)
    if r.rc != 0 or not (run_dir / "summary.json").is_file():
        why = "out of memory" if "out of memory" in r.out.lower() else f"exit {r.rc}"
        raise Failed(f"shoal train {why}: {tail(r.out)}")
    return run_dir


def check(b: Bench, name: str, config: Path, run_dir: Path, preset: str | None) -> dict:
    """`shoal plan CONFIG [--preset P] --nproc 1 --check RUN_DIR`: its first line and its rows."""
    label = f"preset {preset}" if preset else "spot"
    args = ["plan", config, *(["--preset", preset] if preset else []), "--nproc", "1", "--check", run_dir]
    r = b.shoal(f"check-{name}-{label.split()[0]}", args, timeout=300)
    rows = report.check_rows(r.stdout)
    if not rows:
        raise Failed(f"plan --check printed no rows: {tail(r.out)}")
    return {"run": name, "profile": label, "line": r.stdout.splitlines()[0], "rows": rows}


def header(b: Bench) -> None:
    f, s = b.facts, b.shape
    print(f"gpu_planner: {f['card']}, torch {f['torch']}; run dirs and logs in {b.out}")
    if not f["cuda"]:
        print("no CUDA GPU: ran on CPU with a tiny model; the figures are not GPU figures (compiled: dynamo and "
              "AOTAutograd only, no inductor; no fp16 run)")
    elif b.args.quick:
        print("--quick: a tiny model and a few steps; the figures are a smoke test, not the benchmark's")
    print(f"GPT {s['n_layer']} x {s['d_model']}, {s['n_head']} heads, {s['seq_len']} tokens, vocabulary "
          f"{s['vocab_size']}, stdlib-text, bf16 autocast, one process; {b.args.steps} steps per run; preset "
          f"{f['preset']}", flush=True)


def run_all(b: Bench, config: Path, chosen: dict[str, list[str]]) -> tuple[list[dict], list[str]]:
    """Each run trained, then checked against the preset and the spot profile, its rows printed as they come;
    the checks, and the runs that failed."""
    results, failed = [], []
    print(f"\n{report.TABLE_HEAD}", flush=True)
    for name, sets in chosen.items():
        try:
            run_dir = train(b, name, config, sets)
            for preset in (b.facts["preset"], None):
                got = check(b, name, config, run_dir, preset)
                results.append(got)
                print("\n".join(report.table_lines(name, got["profile"], got["rows"])), flush=True)
        except Failed as e:
            failed.append(name)
            print(f"{name:<14} FAIL: {e}", flush=True)
    return results, failed


def defaults(ap: argparse.ArgumentParser, args, cuda: bool) -> dict[str, list[str]]:
    """The micro-batches and step counts of a GPU run or of --quick (implied without CUDA), and the runs chosen."""
    args.quick, q = args.quick or not cuda, args.quick or not cuda
    args.micro = [2, 4] if q else [8, 16]
    args.steps = args.steps or (6 if q else 30)
    args.log_interval = 2 if q else 10
    every = runs(args.micro, cuda)
    wanted = [r for r in (args.runs or "").split(",") if r]
    unknown = [r for r in wanted if r not in every]
    if unknown:
        ap.error(f"--runs {','.join(unknown)}: not a run here; the runs are {', '.join(every)}")
    return {name: sets for name, sets in every.items() if not wanted or name in wanted}


def finish(b: Bench, spot: dict | None, results: list[dict], failed: list[str], seconds: float) -> int:
    """The summary per profile, gpu_planner.json, the RESULT line; 1 where anything failed."""
    spreads = report.summary(results)
    print()
    for line in report.summary_lines(spreads):
        print(line)
    f = b.facts
    (b.out / "gpu_planner.json").write_text(json.dumps({"facts": f, "spot": spot, "checks": results,
                                                        "summary": spreads, "failed": failed}, indent=1) + "\n")
    facts = {"card": json.dumps(f["card"]), "device": f["device"], "torch": f["torch"], "preset": f["preset"],
             "runs": len({r["run"] for r in results}), "spot_s": spot["measured_s"] if spot else "-"}
    print(report.result_line(facts, {**report.result_fields(spreads), "failed": str(len(failed)),
                                      "seconds": f"{seconds:.0f}"}))
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the tiny GPT and a few steps (implied without CUDA)")
    ap.add_argument("--runs", help="runs to train, comma-separated (default: every one this device takes)")
    ap.add_argument("--steps", type=int, help="steps per run (default 30; 6 with --quick)")
    ap.add_argument("--out", help="folder for run dirs, the config, the profile cache, logs and gpu_planner.json "
                                  "(kept); default: temporary")
    ap.add_argument("--logs", help="folder for every command's output (default: <out>/logs)")
    args = ap.parse_args()
    started = time.monotonic()
    facts = facts_of_this_machine()
    chosen = defaults(ap, args, facts["cuda"])
    out = Path(args.out).resolve() if args.out else Path(tempfile.mkdtemp(prefix="shoal-gpu-planner-"))
    out.mkdir(parents=True, exist_ok=True)
    logs = Path(args.logs).resolve() if args.logs else out / "logs"
    shutil.rmtree(logs, ignore_errors=True)
    b = Bench(args, out, logs, facts)
    config = b.config()
    header(b)
    try:
        spot = spot_plan(b, config)
        print(f"the first plan: {spot['seconds']:.1f} s in all; {spot['line']}")
        print(f"  its measurement: {spot['parts'] or 'parts not said'}; its best layout: {spot['best']}", flush=True)
    except Failed as e:
        spot = None
        print(f"the first plan: FAIL: {e}", flush=True)
    results, failed = run_all(b, config, chosen)
    code = finish(b, spot, results, failed + ([] if spot else ["spot-plan"]), time.monotonic() - started)
    if not args.out and not code:
        shutil.rmtree(out, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
