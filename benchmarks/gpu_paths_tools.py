"""benchmarks/gpu_paths.py's plumbing (beside the scripts' shared harness.py): the comparisons of a run's numbers,
the invocation's context (Ctx) and the small GPT's `shoal train`, which most paths run. Standard library only."""

from __future__ import annotations

import json
import math
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import HERE, Bench, Failed, python_json, read_jsonl, run, tomllib

SMALL_GPT = (HERE / "configs" / "small_gpt.toml").read_text()  # its comments say what it is
STEPS = tomllib.loads(SMALL_GPT)["train"]["steps"]
ACCUM = 4  # its global batch of 32 in micro-batches of 8, on one process
OVERFLOW_STEP = 5
INIT_SCALE = 2.0 ** 16  # torch.amp.GradScaler's initial scale; it halves at an overflow, grows after 2000 steps


def step_records(run_dir: Path) -> list[dict]:
    """metrics.jsonl's per-step records (a Session also logs records of its own: those have no loss)."""
    return [m for m in read_jsonl(run_dir / "metrics.jsonl") if "loss" in m]


def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def worst_diff(losses: dict[int, float], reference: dict[int, float], steps) -> tuple[float, int]:
    """The largest relative difference between two runs' losses over `steps`, and its step."""
    missing = [s for s in steps if s not in losses or s not in reference]
    if missing:
        raise Failed(f"no loss recorded at step(s) {missing[:5]}")
    return max((rel_diff(losses[s], reference[s]), s) for s in steps)


def check_close(losses: dict[int, float], reference: dict[int, float], steps, rtol: float, what: str) -> str:
    diff, step = worst_diff(losses, reference, steps)
    if not diff <= rtol:
        raise Failed(f"{what}: loss at step {step} is {losses[step]:.6f}, the reference's {reference[step]:.6f}: "
                     f"relative difference {diff:.2e} > {rtol:g}")
    return f"within {diff:.1e} of {what} (tolerance {rtol:g})"


def check_learning(losses: dict[int, float], steps: int) -> str:
    """Every step's loss finite, and the last quarter's mean below the first quarter's."""
    if sorted(losses) != list(range(1, steps + 1)):
        raise Failed(f"losses of steps {sorted(losses)[:3]}...{sorted(losses)[-3:]}, expected 1..{steps}")
    bad = [s for s, v in losses.items() if v is None or not math.isfinite(v)]
    if bad:
        raise Failed(f"loss not finite at step(s) {bad[:5]}")
    q = max(steps // 4, 1)
    first = sum(losses[s] for s in range(1, q + 1)) / q
    last = sum(losses[s] for s in range(steps - q + 1, steps + 1)) / q
    if not last < first:
        raise Failed(f"loss did not fall: mean {first:.4f} over steps 1-{q}, {last:.4f} over the last {q}")
    return f"loss {losses[1]:.4f} -> {losses[steps]:.4f}"


def newest_train_state(run_dir: Path) -> dict:
    """train_state.json of the run's newest checkpoint (shoal's small parts as JSON: schedule, data position,
    bad-step counters, the loss scaler)."""
    found = sorted((run_dir / "checkpoints").glob("step_*/train_state.json"))
    if not found:
        raise Failed(f"no checkpoint in {run_dir}/checkpoints")
    return json.loads(found[-1].read_text())


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.1f} GiB"


@dataclass
class Run:
    dir: Path
    out: str
    losses: dict[int, float]
    summary: dict


class Ctx(Bench):
    """The paths' invocation: a Bench (their run dirs in `out`, every command's output in `logs`, their
    subprocesses' environment) with the device they train on ("cuda", or "cpu" on a machine without CUDA), its
    memory, and what several paths read, made once (`shared`: train-fp32's run)."""

    def __init__(self, out: Path, logs: Path, cuda: bool, gpu_bytes: int, extra: dict | None = None):
        super().__init__(out, logs, cuda, extra)
        self.cuda, self.dev, self.gpu_bytes = cuda, "cuda" if cuda else "cpu", gpu_bytes
        self.shared: dict = {}

    def folder(self, name: str) -> Path:
        """The path's own folder, emptied: a run dir left by an earlier invocation would resume."""
        path = self.out / name
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    def shoal(self, name: str, args: list, cwd: Path, timeout: float = 240, expect: int | None = 0,
              env: dict | None = None):
        return run([sys.executable, "-m", "shoal", *args], cwd=cwd, env={**self.env, **(env or {})},
                   timeout=timeout, log=self.log(name), expect=expect)

    def python(self, name: str, code: str, cwd: Path) -> dict:
        return python_json(code, cwd=cwd, env=self.env, log=self.log(name))

    def config(self, name: str = "gpt.toml", extra: str = "") -> Path:
        path = self.out / "configs" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(SMALL_GPT + extra)
        return path


def train(ctx: Ctx, name: str, run_dir: Path, sets: list[str], timeout: float = 240, env: dict | None = None,
          nproc: int | None = None) -> Run:
    """`shoal train` of the small GPT into `run_dir`, with `sets` as --set overrides (`nproc`: --nproc)."""
    args = ["train", ctx.config(), "--run-dir", run_dir, *(["--nproc", nproc] if nproc else []),
            *[a for s in sets for a in ("--set", s)]]
    r = ctx.shoal(name, args, cwd=run_dir.parent, timeout=timeout, env=env)
    losses = {m["step"]: m["loss"] for m in step_records(run_dir)}  # a step trained twice: its last record
    summary = json.loads((run_dir / "summary.json").read_text())
    return Run(run_dir, r.out, losses, summary)


def fp32_run(ctx: Ctx) -> Run:
    """train-fp32's run, trained once for every path that reads it (on the CPU where there is no CUDA)."""
    if "fp32" not in ctx.shared:
        try:
            run_dir = ctx.folder("train-fp32") / "run"
            ctx.shared["fp32"] = train(ctx, "train-fp32", run_dir, [f"parallel.device={ctx.dev}"])
        except Failed as e:
            ctx.shared["fp32"] = e
    got = ctx.shared["fp32"]
    if isinstance(got, Failed):
        raise Failed(f"train-fp32's run failed: {got}")
    return got


def layout_line(run: Run) -> str:
    """The run's layout, from its first line ("... world 1 = dp 1 x tp 1 x pp 1 (nccl); ...")."""
    found = re.search(r"world \d+ = .*?\(([^)]*)\)", run.out)
    return found.group(1) if found else "?"
