"""What do checkpoints cost, and how long does a crash cost?

For the default GPT (0.84M parameters) and a ~100M-parameter GPT (14 layers, d_model 768), on 2 workers:
  - blocking save: seconds a synchronous checkpoint stops training (DCP save + manifest + rename);
  - async stall: seconds an async checkpoint stops training (target: under 10% of the blocking save);
Both are measured on a mid-run save in the steady state (the second of the run; the first async save
also builds the reusable state-dict views, and is reported beside it);
  - restore: seconds to load the checkpoint when a run resumes;
  - recovery: seconds from SIGKILL of a worker to the first step completed after torch elastic restarts
    the group and it resumes from the newest checkpoint (target: under 10 s on CPU);
  - peer: torch.save of the same model + AdamW state_dict from one process, for scale.
Medians over --repeats runs.

    python -m benchmarks.checkpoint_cost [--repeats 3] [--sizes default,100m]

Last line: RESULT <size>_blocking_s=... <size>_async_stall_ratio=... <size>_restore_s=... <size>_recovery_s=...
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = {
    "default": ["--set", "train.global_batch_size=32", "--set", "train.micro_batch_size=16",
                "--set", "model.seq_len=128"],
    "100m": ["--set", "model.n_layer=14", "--set", "model.d_model=768", "--set", "model.n_head=12",
             "--set", "model.seq_len=128",
             "--set", "train.global_batch_size=2", "--set", "train.micro_batch_size=1"],
}


# steps between saves: long enough for an async save to be written before the next one starts
INTERVAL = {"default": 4, "100m": 8}


def shoal(run_dir: Path, size: str, steps: int, *extra: str, interval: int = 2, background: bool = False):
    cmd = [sys.executable, "-m", "shoal", "train", str(ROOT / "configs/gpt-tiny.toml"), "--nproc", "2",
           "--run-dir", str(run_dir), *SIZES[size], "--set", f"train.steps={steps}",
           "--set", f"checkpoint.interval={interval}",
           "--set", "train.val_interval=0", "--set", "train.val_batches=1", "--set", "metrics.log_interval=1",
           "--set", "metrics.tensorboard=false", "--set", "checkpoint.final_weights=false", *extra]
    if background:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return json.loads((run_dir / "summary.json").read_text())


def workers_of(pid: int) -> list[int]:
    """The launcher's child processes that run `shoal train` (the workers)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid and \
                    b"shoal" in (stat.parent / "cmdline").read_bytes():
                out.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            pass
    return out


def recovery_seconds(run_dir: Path, size: str) -> float:
    """SIGKILL one worker after the step-2 checkpoint; time until the first step after the restart."""
    proc = shoal(run_dir, size, 8, "--max-restarts", "1", background=True)
    progress = run_dir / "progress.json"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if json.loads(progress.read_text())["step"] >= 3:
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    workers = workers_of(proc.pid)
    killed_at = time.time()
    os.kill(max(workers), signal.SIGKILL)
    if proc.wait(timeout=900) != 0:
        raise RuntimeError(f"the run did not recover (exit {proc.returncode})")
    after = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    parts = json.loads((run_dir / "summary.json").read_text())["recoveries"][-1]["breakdown_s"]
    print("  recovery breakdown (s, from the last step before the kill): "
          + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()), flush=True)
    return min(m["time"] for m in after if m["time"] > killed_at) - killed_at


def torch_save_seconds(size: str, tmp: Path) -> float:
    """The peer: one process, torch.save of model + AdamW state (after one step so the moments exist)."""
    code = f"""
import sys, time, torch
from shoal.config import load_config
from shoal.models.registry import build_model
from shoal.models.spec import DataSpec
args = {SIZES[size]!r}
cfg = load_config({str(ROOT / "configs/gpt-tiny.toml")!r}, [a for a in args if a != "--set"])
m = build_model(cfg.model, DataSpec("tokens", vocab_size=256)).model
opt = torch.optim.AdamW(m.parameters())
m(torch.randint(256, (1, 8))).sum().backward(); opt.step()
t0 = time.perf_counter()
torch.save({{"model": m.state_dict(), "optim": opt.state_dict()}}, {str(tmp / "peer.pt")!r})
print(time.perf_counter() - t0)
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT).stdout
    return float(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sizes", default="default,100m")
    args = ap.parse_args()
    result = []
    for size in args.sizes.split(","):
        rows: dict[str, list[float]] = {k: [] for k in ("blocking", "stall", "first_stall", "async_total", "restore",
                                                         "recovery", "peer", "params", "bytes")}
        for r in range(args.repeats):
            with tempfile.TemporaryDirectory() as d:
                tmp = Path(d)
                # saves at k, 2k and 3k (the last also ends the run); the second is measured: a mid-run
                # save in the steady state (the first one also builds the state-dict views: first_stall)
                k = INTERVAL[size]
                sync = shoal(tmp / "sync", size, 3 * k, interval=k)
                rows["blocking"].append(sync["checkpoints"][1]["blocking_s"])
                rows["bytes"].append(sync["checkpoints"][1]["bytes"])
                rows["params"].append(sync["parameters"])
                asyn = shoal(tmp / "async", size, 3 * k, "--set", "checkpoint.async=true", interval=k)
                rows["first_stall"].append(asyn["checkpoints"][0]["blocking_s"])
                rows["stall"].append(asyn["checkpoints"][1]["blocking_s"])
                rows["async_total"].append(asyn["checkpoints"][1]["total_s"])
                resumed = shoal(tmp / "sync", size, 3 * k + 2, interval=k)  # continues from step 3k
                rows["restore"].append(resumed["recoveries"][-1]["restore_s"])
                rows["recovery"].append(recovery_seconds(tmp / "kill", size))
                rows["peer"].append(torch_save_seconds(size, tmp))
            print(f"{size} run {r + 1}: " + ", ".join(f"{k} {v[-1]:.3g}" for k, v in rows.items()), flush=True)
        med = {k: statistics.median(v) for k, v in rows.items()}
        ratio = med["stall"] / med["blocking"]
        print(f"{size}: {med['params'] / 1e6:.1f}M parameters, checkpoint {med['bytes'] / 2**20:.0f} MiB: "
              f"blocking save {med['blocking']:.2f} s (torch.save from one process: {med['peer']:.2f} s); "
              f"async stall {med['stall']:.3f} s = {ratio:.1%} of blocking (target < 10%; the run's first async "
              f"save: {med['first_stall']:.3f} s), written in "
              f"{med['async_total']:.2f} s; restore {med['restore']:.2f} s; SIGKILL to first resumed step "
              f"{med['recovery']:.1f} s (target < 10 s)")
        result += [f"{size}_blocking_s={med['blocking']:.3f}", f"{size}_async_stall_ratio={ratio:.3f}",
                   f"{size}_restore_s={med['restore']:.3f}", f"{size}_recovery_s={med['recovery']:.2f}"]
    print("RESULT " + " ".join(result))


if __name__ == "__main__":
    main()
