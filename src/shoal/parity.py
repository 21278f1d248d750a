"""`shoal parity A.toml B.toml`: do two layouts train the same model?

Both configs run for the same number of steps on the same data and seed (each as an ordinary `shoal
train`, in a temporary run dir), and their per-step loss and gradient norm are compared. They may
differ only in how the work is laid out, synchronised and computed (config.LAYOUT_SECTIONS: [parallel],
[sync], [ps], [balance], [comm], [precision], [checkpoint], [metrics]; micro-batch size, compile);
anything else would make a different training run, and is refused naming the key. Exit 0 when every
step agrees within the relative tolerance, 1 otherwise.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from shoal.config import LAYOUT_KEYS, LAYOUT_SECTIONS, Config, load_config
from shoal.errors import UserError
from shoal.rundir import RunDir, read_metrics

# default relative tolerance by the less precise of the two compute dtypes: fp32 differs only in
# summation order; bf16 keeps 8 mantissa bits; fp8's backward casts gradients to float8 e5m2 (2 mantissa
# bits), where a difference of one bf16 ulp before the cast can become a step of 12.5%: tp 2 and ZeRO 3
# against one process, both fp8, differed by up to 2.3e-2 in the gradient norm over 8 steps on one H200
DEFAULT_RTOL = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 1e-2, "fp8": 5e-2}
PRECISION_ORDER = ("fp32", "fp16", "bf16", "fp8")


def first_difference(a: Config, b: Config) -> str | None:
    """The first key (section.key) in which two configs describe different training runs."""
    da, db = a.model_dump(), b.model_dump()
    for section in sorted(set(da) | set(db)):
        if section in LAYOUT_SECTIONS:
            continue
        va, vb = da.get(section) or {}, db.get(section) or {}
        for key in sorted(set(va) | set(vb)):
            if f"{section}.{key}" not in LAYOUT_KEYS and va.get(key) != vb.get(key):
                return f"{section}.{key} ({va.get(key)!r} vs {vb.get(key)!r})"
    return None


def world_size(cfg: Config, given: int | None, name: str) -> int:
    p = cfg.parallel
    if given is not None:
        return given
    if p.dp == "auto":
        raise UserError(f'{name}: parallel.dp = "auto" leaves the number of processes open; set parallel.dp in the '
                        f"config or give --nproc A,B")
    return p.dp * p.tp * p.pp


def run_one(config: str, nproc: int, steps: int, overrides: list[str], run_dir: Path) -> list[dict]:
    """Train `config` for `steps` steps; its metrics, one record per step."""
    fixed = [f"train.steps={steps}", "metrics.log_interval=1", "checkpoint.enabled=false",
             "checkpoint.final_weights=false", "metrics.tensorboard=false", "metrics.progress=false",
             "train.val_interval=0"]
    # --nnodes 1: both runs are local, even inside a scheduler's multi-node job (launch/environment.py)
    cmd = [sys.executable, "-m", "shoal", "train", config, "--nproc", str(nproc), "--nnodes", "1",
           "--run-dir", str(run_dir), "--resume", "never", *[a for o in [*overrides, *fixed] for a in ("--set", o)]]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-15:])
        raise UserError(f"{config} failed (exit {r.returncode}):\n{tail}")
    records = read_metrics(RunDir(run_dir).metrics)
    return [m for m in records if "loss" in m]


def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def parity(config_a: str, config_b: str, steps: int, rtol: float | None, nprocs: tuple[int | None, int | None],
           overrides: list[str]) -> int:
    from rich.console import Console
    from rich.table import Table

    cfg_a, cfg_b = load_config(config_a, overrides), load_config(config_b, overrides)
    diff = first_difference(cfg_a, cfg_b)
    if diff:
        raise UserError(f"{config_a} and {config_b} describe different training runs: {diff}; parity compares "
                        f"layouts of one run (they may differ in {', '.join(f'[{s}]' for s in LAYOUT_SECTIONS)}, "
                        f"{', '.join(sorted(LAYOUT_KEYS))})")
    if steps < 1:
        raise UserError(f"--steps ({steps}) must be >= 1")
    worlds = world_size(cfg_a, nprocs[0], config_a), world_size(cfg_b, nprocs[1], config_b)
    import torch

    from shoal.preflight import check_job

    for name, cfg, world in ((config_a, cfg_a, worlds[0]), (config_b, cfg_b, worlds[1])):
        try:  # both layouts are checked before either trains
            check_job(cfg, [world], cuda=torch.cuda.is_available())
        except UserError as e:
            raise UserError(f"{name}: {e}") from None
    if rtol is None:
        worst = max((cfg_a.precision.dtype, cfg_b.precision.dtype), key=PRECISION_ORDER.index)
        rtol = DEFAULT_RTOL[worst]
    console = Console()
    if not console.is_terminal:
        console.width = 200  # a pipe or a log file: keep the table's numbers whole
    with tempfile.TemporaryDirectory(prefix="shoal-parity-") as tmp:
        runs = []
        for name, config, world in (("A", config_a, worlds[0]), ("B", config_b, worlds[1])):
            console.print(f"{name}: {config} on {world} process{'es' if world > 1 else ''} ...")
            runs.append(run_one(config, world, steps, overrides, Path(tmp) / name))
    a, b = ({m["step"]: m for m in run} for run in runs)
    table = Table("step", "loss A", "loss B", "rel diff", "grad norm A", "grad norm B", "rel diff",
                  title=f"parity: A = {config_a} (world {worlds[0]}), B = {config_b} (world {worlds[1]})")
    worst_loss, worst_norm = (0.0, 0), (0.0, 0)
    for step in sorted(set(a) & set(b)):
        dl, dn = rel_diff(a[step]["loss"], b[step]["loss"]), rel_diff(a[step]["grad_norm"], b[step]["grad_norm"])
        worst_loss, worst_norm = max(worst_loss, (dl, step)), max(worst_norm, (dn, step))
        table.add_row(str(step), f"{a[step]['loss']:.6f}", f"{b[step]['loss']:.6f}", f"{dl:.2e}",
                      f"{a[step]['grad_norm']:.6f}", f"{b[step]['grad_norm']:.6f}", f"{dn:.2e}")
    console.print(table)
    if set(a) != set(b) or len(a) != steps:
        console.print(f"FAIL: the runs logged different steps (A: {len(a)}, B: {len(b)} of {steps})")
        return 1
    ok = worst_loss[0] <= rtol and worst_norm[0] <= rtol
    console.print(f"{'PASS' if ok else 'FAIL'}: largest relative difference: loss {worst_loss[0]:.2e} (step "
                  f"{worst_loss[1]}), gradient norm {worst_norm[0]:.2e} (step {worst_norm[1]}); tolerance {rtol:.0e}")
    return 0 if ok else 1
