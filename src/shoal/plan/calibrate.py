"""What the planner's formulas miss, measured: the probe's reference GPT trained by shoal itself in each
strategy, its measured step time against the prediction for it, fitted per strategy as a line

    measured = a x predicted + b

over two widths of the model (REFERENCE_WIDTHS' ends). The formulas add up operators measured one at
a time, with side-by-side processes; a real run also pays what they do not count: the training loop
(in one process a step ~4-6% longer than the bare model's), the communication library's threads
taking cycles from the compute on shared cores, and the rest of each strategy's own work (largest
under tensor parallelism: here a = 1.57-1.79 for tp, 1.05-1.27 for the rest). On this machine
the formulas alone under-predict every layout of the planner benchmark, by 5-30%.

The strategies are keyed as predict.strategy() names a layout: pp, else tp, else the ZeRO stage (dp for
none); a layout whose strategy was not measured is predicted by the formulas alone. `shoal probe`
calibrates on one node (not with --cluster): 12 short runs, about 80 s for 2 processes."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from shoal.hardware import HardwareProfile, line_through

STEPS = 10  # the run's median step: the first (warm-up) and the noisiest fall out


def reference_layouts(nproc: int) -> dict[str, list[str]]:
    """Per strategy the layout keys of its reference run over `nproc` processes: dp strategies over all
    of them; tp and pp 2 (the reference GPT has 2 blocks and 4 heads) where nproc is even."""
    runs = {"dp": ["parallel.zero=0"]}
    if nproc > 1:
        runs.update({f"zero{z}": [f"parallel.zero={z}"] for z in (1, 2, 3)})
    if nproc % 2 == 0:
        runs.update(tp=["parallel.tp=2"], pp=["parallel.pp=2", 'parallel.pp_schedule="1f1b"'])
    return runs


def reference_config(width: int, layout: list[str], nproc: int, threads: int) -> list[str]:
    """`--set` values for the probe's reference GPT (probe.py: 2 blocks of `width`, 4 heads, 128 byte
    tokens, 4 sequences per replica a step) in `layout`, in micro-batches of 2."""
    split = 2 if any(k.startswith(("parallel.tp=", "parallel.pp=")) for k in layout) else 1
    return ["model.name=\"gpt\"", "model.n_layer=2", f"model.d_model={width}", "model.n_head=4", "model.seq_len=128",
            'data.source="stdlib-text"', "data.max_bytes=400000", f"train.global_batch_size={4 * nproc // split}",
            "train.micro_batch_size=2", f"train.steps={STEPS}", "train.val_interval=0", "train.val_batches=1",
            "metrics.log_interval=1", "metrics.tensorboard=false", "metrics.progress=false",
            "checkpoint.enabled=false", "checkpoint.final_weights=false", f"parallel.threads_per_worker={threads}",
            *layout]


# what a line may say of the formulas and stay physics: what they miss grows with the work they count
# (slopes measured here: tp 1.57-1.79, the other strategies 1.05-1.27), and it never takes more than
# half of the smaller reference step away (a noisy point once made tp's line 3.15 x predicted - 314 ms,
# which predicted 1232 ms for a step of 401, where the formulas alone said 491)
SLOPES = (0.5, 2.5)
LEAST_INTERCEPT = -0.5  # x the smaller reference step predicted


def line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(a, b) of measured = a x predicted + b through the first and last (predicted, measured) points; a
    ratio alone (b = 0) where the predictions coincide."""
    if points[0][0] == points[-1][0]:
        return points[-1][1] / points[-1][0], 0.0
    return line_through(points[0], points[-1])


def fit(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """line(points), or None where it is not physics (a slope outside SLOPES, or an intercept below
    LEAST_INTERCEPT x the smaller prediction): a noisy reference run made it, and the formulas alone
    predict that strategy."""
    a, b = line(points)
    if not SLOPES[0] <= a <= SLOPES[1] or b < LEAST_INTERCEPT * min(p for p, _ in points):
        return None
    return a, b


def reference_points(profile: HardwareProfile, nproc: int, threads: int, widths: tuple[int, ...], work_dir: Path,
                     strategies: list[str] | None = None, timeout: float = 600.0
                     ) -> dict[str, list[tuple[float, float]]]:
    """{strategy: [(predicted, measured) step seconds per width]}: the reference GPT at each of `widths`
    trained by `shoal train --nproc nproc` in each strategy (run dirs under `work_dir`, named
    STRATEGY-WIDTH), against the formulas' prediction for the same run from `profile` (uncalibrated).
    A run that has not ended in `timeout` seconds is killed and fails the calibration."""
    from shoal.config import load_config
    from shoal.plan.planner import predict_config

    bare = profile.model_copy(update={"calibration": {}})
    out = {}
    for name, layout in reference_layouts(nproc).items():
        if strategies is not None and name not in strategies:
            continue
        out[name] = []
        for width in widths:
            run_dir = work_dir / f"{name}-{width}"
            sets = reference_config(width, layout, nproc, threads)
            cmd = [sys.executable, "-m", "shoal", "train", "--nproc", str(nproc), "--run-dir", str(run_dir),
                   *[a for s in sets for a in ("--set", s)]]
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            except subprocess.TimeoutExpired as e:
                raise RuntimeError(f"the calibration run {name} at width {width} did not end in {timeout:.0f} s; "
                                   f"killed (run dir {run_dir})") from e
            if r.returncode:
                raise RuntimeError(f"the calibration run {name} at width {width} failed ({r.returncode}):\n"
                                   f"{r.stdout[-1500:]}\n{r.stderr[-3000:]}")
            measured = json.loads((run_dir / "summary.json").read_text())["median_step_time_s"]
            cfg = load_config(run_dir / "config.toml", stored=True)
            out[name].append((predict_config(cfg, nproc, bare).step_time, measured))
    return out


def calibrate(profile: HardwareProfile, nproc: int, threads: int, widths: tuple[int, ...],
              log: Callable[[str], None] = print) -> dict[str, tuple[float, float]]:
    """{strategy: (a, b)} fitted on reference_points."""
    with tempfile.TemporaryDirectory(prefix="shoal-calibrate-") as tmp:
        points = reference_points(profile, nproc, threads, widths, Path(tmp))
    out = {}
    for name, pts in points.items():
        runs = ", ".join(f"{p * 1e3:.1f} -> {m * 1e3:.1f} ms" for p, m in pts)
        (a, b), fitted = line(pts), fit(pts)
        if fitted is None:
            log(f"not calibrated {name}: its runs ({runs}) give measured = {a:.2f} x predicted {b * 1e3:+.1f} ms, "
                f"outside what a correction may be (a slope of {SLOPES[0]}-{SLOPES[1]}, an intercept above "
                f"{LEAST_INTERCEPT:g} x the smaller step): a noisy run; the formulas alone predict {name}")
            continue
        out[name] = fitted
        log(f"calibrated {name}: measured = {a:.2f} x predicted {b * 1e3:+.1f} ms ({runs})")
    return out
