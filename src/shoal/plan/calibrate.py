"""What the planner's formulas miss, measured: the probe's reference GPT trained by shoal itself in each
strategy, its measured step time against the prediction for it, fitted per strategy as a line

    measured = a x predicted + b

over the widths of the device's reference GPT (plan/reference.py; on a GPU in bf16). The formulas add up
operators measured one at a time, with side-by-side processes; a real run also pays what they do not count: the
training loop (in one process a step ~4-6% longer than the bare model's), the communication library's
threads taking cycles from the compute on shared cores, and the rest of each strategy's own work
(largest under tensor parallelism). On this machine the formulas alone under-predict most layouts of
the planner benchmark, by 5-30%.

A line from single runs extrapolates whatever noise its points carry (a tp line through two runs once
came out 3.15 x predicted - 314 ms, the formulas' step at the smaller width priced at a collective slow
mode the probe had met). So on a CPU each reference point is two runs (plan/reference.py), in rounds (every point
once, then again), so that a burst of other work lands on one run of several points rather than on
every run of one; a point is the median of its runs. The line is then checked (check()): one whose
slope or intercept no physics of the formulas' misses allows, or one that predicts the reference runs
themselves worse than the formulas alone do, is not kept: that strategy is predicted by the formulas,
and the probe says so in one line. And the probe measures its own noise, the share of the machine's CPU
time other processes took while it measured and calibrated (OtherCpu); above BUSY it writes no
calibration at all and says so in one line.

The strategies are keyed as predict.strategy() names a layout: pp, else tp, else the ZeRO stage (dp for
none); a layout whose strategy was not calibrated is predicted by the formulas alone. `shoal probe`
calibrates on one node (not with --cluster). What was decided and why is kept in the profile under
CHECKS_KEY."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from shoal.hardware import HardwareProfile, line_through
from shoal.plan.reference import CPU_REFERENCE, Reference, reference_for

STEPS = 10  # the run's median step: the first (warm-up) and the noisiest fall out
CHECKS_KEY = "calibration_checks"  # the profile's record of the checks (an extra key of HardwareProfile)

# what a line may say of the formulas and stay physics: what they miss grows with the work they count
# (slopes measured here: tp 1.22-1.79, the other strategies 1.00-1.27), and the fixed part of a step
# they miss (the loop around the model, measured 1-21 ms) neither takes away more than half of the
# smallest reference step predicted nor is more than half of the smallest measured (a noisy point
# once made tp's line 3.15 x predicted - 314 ms, which predicted 1232 ms for a step of 401, where the
# formulas alone said 491)
SLOPES = (0.5, 2.5)
LEAST_INTERCEPT = -0.5  # x the smallest reference step predicted
MOST_INTERCEPT = 0.5  # x the smallest reference step measured

# other processes' share of the machine's CPU time above which the probe's timings are not this machine's
# own: on a 2-CPU machine a quiet probe saw 0.7% while measuring and 6-7% while calibrating, one beside
# two busy loops 34% while measuring (and its per-operator overhead 10.4 us against 3.0)
BUSY = 0.15


def reference_layouts(nproc: int) -> dict[str, list[str]]:
    """Per strategy the layout keys of its reference run over `nproc` processes: dp strategies over all
    of them; tp and pp 2 (the reference GPT has 2 blocks and 4 heads) where nproc is even."""
    runs = {"dp": ["parallel.zero=0"]}
    if nproc > 1:
        runs.update({f"zero{z}": [f"parallel.zero={z}"] for z in (1, 2, 3)})
    if nproc % 2 == 0:
        runs.update(tp=["parallel.tp=2"], pp=["parallel.pp=2", 'parallel.pp_schedule="1f1b"'])
    return runs


def reference_config(width: int, layout: list[str], nproc: int, threads: int,
                     reference: Reference = CPU_REFERENCE) -> list[str]:
    """`--set` values for the probe's reference GPT (plan/reference.py; a CPU's: 2 blocks of `width`, 4 heads,
    128 byte tokens, 4 sequences per replica a step) in `layout`, in micro-batches of 2; a GPU's with its
    vocabulary and in its calibration dtype."""
    split = 2 if any(k.startswith(("parallel.tp=", "parallel.pp=")) for k in layout) else 1
    gpu = ([f"model.vocab_size={reference.vocab}"] if reference.vocab != CPU_REFERENCE.vocab else []) + \
        ([f'precision.dtype="{reference.calibration_dtype}"'] if reference.calibration_dtype != "fp32" else [])
    return ["model.name=\"gpt\"", "model.n_layer=2", f"model.d_model={width}", f"model.n_head={reference.heads(width)}",
            f"model.seq_len={reference.seq_len}", 'data.source="stdlib-text"', "data.max_bytes=400000",
            f"train.global_batch_size={reference.batch * nproc // split}", "train.micro_batch_size=2",
            f"train.steps={STEPS}", "train.val_interval=0", "train.val_batches=1", "metrics.log_interval=1",
            "metrics.tensorboard=false", "metrics.progress=false", "checkpoint.enabled=false",
            "checkpoint.final_weights=false", f"parallel.threads_per_worker={threads}", *gpu, *layout]


Point = tuple[float, "float | list[float]"]  # (predicted, measured: one run's step or several runs')


def _runs(measured) -> list[float]:
    return [float(measured)] if isinstance(measured, (int, float)) else [float(m) for m in measured]


def medians(points: list[Point]) -> list[tuple[float, float]]:
    """(predicted, the median of its runs) per point."""
    return [(p, statistics.median(_runs(m))) for p, m in points]


def line(points: list[Point]) -> tuple[float, float]:
    """(a, b) of measured = a x predicted + b through the points' medians: through the two where there
    are two; where there are more, Theil and Sen's (the median of the pairwise slopes, the intercept
    the median of each point's measured - a x predicted), which one bad point does not move; a ratio
    alone (b = 0) where the predictions coincide."""
    from scipy.stats import theilslopes

    pts = sorted(medians(points))
    if pts[0][0] == pts[-1][0]:
        return pts[-1][1] / pts[-1][0], 0.0
    if len(pts) == 2:
        return line_through(pts[0], pts[-1])
    slope = float(theilslopes([m for _, m in pts], [p for p, _ in pts]).slope)
    return slope, statistics.median(m - slope * p for p, m in pts)


def error(a: float, b: float, points: list[Point]) -> float:
    """The median relative error of a x predicted + b over every run of every point."""
    return statistics.median(abs(a * p + b - m) / m for p, ms in points for m in _runs(ms))


def check(points: list[Point]) -> tuple[tuple[float, float], str | None]:
    """line(points) and why it is not kept (None: it is): a slope outside SLOPES, an intercept below
    LEAST_INTERCEPT x the smallest prediction or above MOST_INTERCEPT x the smallest measured step,
    or the reference runs predicted worse by the line than by the formulas alone (a = 1, b = 0)."""
    a, b = line(points)
    mids = medians(points)
    least, most = LEAST_INTERCEPT * min(p for p, _ in mids), MOST_INTERCEPT * min(m for _, m in mids)
    if not SLOPES[0] <= a <= SLOPES[1]:
        return (a, b), f"a slope outside {SLOPES[0]:g}-{SLOPES[1]:g}"
    if not least <= b <= most:
        return (a, b), (f"an intercept outside {least * 1e3:+.1f} to {most * 1e3:+.1f} ms ({LEAST_INTERCEPT:g} x "
                        f"the smallest step predicted to {MOST_INTERCEPT:g} x the smallest measured)")
    fitted, formulas = error(a, b, points), error(1.0, 0.0, points)
    if fitted > formulas:
        return (a, b), f"an error of {fitted:.1%} on its own runs, where the formulas alone are {formulas:.1%} off"
    return (a, b), None


def fit(points: list[Point]) -> tuple[float, float] | None:
    """line(points), or None where check() does not keep it: the formulas alone predict that strategy."""
    (a, b), why = check(points)
    return None if why else (a, b)


def processes(proc: str = "/proc") -> dict[int, tuple[int, float]]:
    """{pid: (parent pid, CPU seconds it has used, all its threads)} of every process /proc lists."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"{entry.path}/stat") as f:
                text = f.read()
        except OSError:  # it ended
            continue
        fields = text[text.rindex(")") + 2:].split()  # after the command's name, which may hold spaces
        out[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    return out


def steal_seconds(stat: str = "/proc/stat") -> float:
    """CPU seconds a hypervisor gave to someone else, over every CPU (/proc/stat's steal)."""
    with open(stat) as f:
        return int(f.readline().split()[8]) / os.sysconf("SC_CLK_TCK")


class OtherCpu:
    """The share of the machine's CPU time that went to other processes from when this was made to
    share(): every process outside this one's tree (its descendants: the probe's workers, a `shoal
    train` and its workers), sampled from /proc every `interval` seconds in a thread, plus the steal
    time /proc/stat counts (a hypervisor running someone else), over the wall time x the CPUs. A
    process that starts and ends between two samples is not seen. None where there is no /proc.

    Another process's ready threads take CPU time from the probe's on shared cores, which is what makes
    its timings not the machine's own. (The machine's busy time less this process tree's getrusage
    would not do: a process that is not waited for, as a forkserver's workers, is never counted.)"""

    def __init__(self, interval: float | None = 0.5, scan: Callable[[], dict[int, tuple[int, float]]] = processes,
                 steal: Callable[[], float] = steal_seconds, clock: Callable[[], float] = time.monotonic,
                 cpus: int | None = None, root: int | None = None):
        self.scan, self.steal, self.clock = scan, steal, clock
        self.cpus, self.root = cpus or os.cpu_count() or 1, root or os.getpid()
        try:
            self.seen = {pid: cpu for pid, (_, cpu) in self.scan().items()}
            self.start = self.clock(), self.steal()
        except OSError:
            self.seen, self.start = None, None
        self.other, self.lock, self.done = 0.0, threading.Lock(), threading.Event()
        if interval and self.start:
            threading.Thread(target=self._run, args=(interval,), daemon=True, name="shoal-other-cpu").start()

    def _run(self, interval: float) -> None:
        while not self.done.wait(interval):
            self.sample()

    def sample(self) -> None:
        """Add what every process outside this one's tree used since the last sample (a new one: all it used)."""
        procs = self.scan()
        children: dict[int, list[int]] = {}
        for pid, (parent, _) in procs.items():
            children.setdefault(parent, []).append(pid)
        tree, todo = set(), [self.root]
        while todo:
            pid = todo.pop()
            tree.add(pid)
            todo += children.get(pid, [])
        with self.lock:
            self.other += sum(max(cpu - self.seen.get(pid, 0.0), 0.0) for pid, (_, cpu) in procs.items()
                              if pid not in tree)
            self.seen = {pid: cpu for pid, (_, cpu) in procs.items()}

    def share(self) -> float | None:
        """Other processes' share of the CPU time so far (and the sampling stops)."""
        if self.start is None:
            return None
        self.done.set()
        self.sample()
        (t0, steal0), t1 = self.start, self.clock()
        if t1 <= t0:
            return None
        with self.lock:
            return (self.other + max(self.steal() - steal0, 0.0)) / ((t1 - t0) * self.cpus)


def busy_line(share: float, phase: str) -> str:
    """The probe's one line where it writes no calibration from a busy machine."""
    return (f"not calibrated: other processes took {share:.0%} of this machine's CPU time while the probe {phase} "
            f"(more than {BUSY:.0%}), so its timings are not this machine's own; the profile is written without a "
            f"calibration (the formulas alone predict every layout). Rerun `shoal probe` on a quiet machine, or "
            f"pass --force-calibration to calibrate anyway")


def reference_points(profile: HardwareProfile, nproc: int, threads: int, widths: tuple[int, ...], work_dir: Path,
                     strategies: list[str] | None = None, timeout: float = 600.0, repeats: int | None = None
                     ) -> dict[str, list[tuple[float, list[float]]]]:
    """{strategy: [(predicted, [measured step seconds per run]) per width]}: the reference GPT of the profile's
    device (plan/reference.py) at each of `widths` trained `repeats` times (None: the reference's
    calibration_repeats) by `shoal train --nproc nproc` in each strategy (run dirs under
    `work_dir`, named STRATEGY-WIDTH-RUN/ATTEMPT), in rounds of every point once, against the formulas'
    prediction for the same run from `profile` (uncalibrated). A run that has not ended in `timeout`
    seconds is killed and fails the calibration."""
    from shoal.config import load_config
    from shoal.plan.planner import predict_config

    bare, reference = profile.model_copy(update={"calibration": {}}), reference_for(profile.device)
    layouts = {n: k for n, k in reference_layouts(nproc).items() if strategies is None or n in strategies}
    predicted: dict[tuple[str, int], float] = {}
    measured: dict[tuple[str, int], list[float]] = {}
    for run in range(repeats or reference.calibration_repeats):
        for name, layout in layouts.items():
            for width in widths:
                sets = reference_config(width, layout, nproc, threads, reference)
                for attempt in range(2):  # a run that fails to start (its forkserver gone) is tried once more
                    run_dir = work_dir / f"{name}-{width}-{run}" / str(attempt)
                    cmd = [sys.executable, "-m", "shoal", "train", "--nproc", str(nproc), "--run-dir", str(run_dir),
                           *[a for s in sets for a in ("--set", s)]]
                    try:
                        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
                    except subprocess.TimeoutExpired as e:
                        raise RuntimeError(f"the calibration run {name} at width {width} did not end in "
                                           f"{timeout:.0f} s; killed (run dir {run_dir})") from e
                    if r.returncode == 0:
                        break
                if r.returncode:
                    raise RuntimeError(f"the calibration run {name} at width {width} failed ({r.returncode}):\n"
                                       f"{r.stdout[-1500:]}\n{r.stderr[-3000:]}")
                measured.setdefault((name, width), []).append(
                    json.loads((run_dir / "summary.json").read_text())["median_step_time_s"])
                if (name, width) not in predicted:
                    cfg = load_config(run_dir / "config.toml", stored=True)
                    predicted[name, width] = predict_config(cfg, nproc, bare, cuda=profile.device == "cuda").step_time
    return {name: [(predicted[name, w], measured[name, w]) for w in widths] for name in layouts}


@dataclass
class Calibration:
    """The lines kept per strategy, and the record of how they were decided (the profile's CHECKS_KEY):
    {"busy": {phase: share}, "busy_threshold": BUSY, "refused": the busy line or None, "forced": bool,
     "fell_back": {strategy: why}, "points": {strategy: [[predicted, [measured, ...]], ...]}}."""

    lines: dict[str, tuple[float, float]] = field(default_factory=dict)
    record: dict = field(default_factory=dict)


def calibrate(profile: HardwareProfile, nproc: int, threads: int, widths: tuple[int, ...],
              busy_measuring: float | None = None, force: bool = False, log: Callable[[str], None] = print,
              points: Callable[..., dict] | None = None) -> Calibration:
    """{strategy: (a, b)} fitted on the reference points (`points`, reference_points), each checked, and
    nothing where other processes took more than BUSY of the CPU time while the probe measured
    (`busy_measuring`, OtherCpu's share over the measuring) or calibrated, unless `force`."""
    out = Calibration(record={"busy": {}, "busy_threshold": BUSY, "refused": None, "forced": force,
                              "fell_back": {}, "points": {}})
    rec = out.record

    def busy(share: float | None, phase: str, key: str) -> bool:
        rec["busy"][key] = share
        if share is None or share <= BUSY or force:
            return False
        rec["refused"] = busy_line(share, phase)
        log(rec["refused"])
        return True

    if busy(busy_measuring, "measured", "measuring"):
        return out
    meter = OtherCpu()
    with tempfile.TemporaryDirectory(prefix="shoal-calibrate-") as tmp:
        measured = (points or reference_points)(profile, nproc, threads, widths, Path(tmp))
    rec["points"] = {name: [[p, _runs(m)] for p, m in pts] for name, pts in measured.items()}
    if busy(meter.share(), "calibrated", "calibrating"):
        return out
    for name, pts in measured.items():
        runs = ", ".join(f"{p * 1e3:.1f} -> {m * 1e3:.1f} ms" for p, m in medians(pts))
        (a, b), why = check(pts)
        said = f"measured = {a:.2f} x predicted {b * 1e3:+.1f} ms (medians of {len(_runs(pts[0][1]))}: {runs})"
        if why:
            rec["fell_back"][name] = why
            log(f"not calibrated {name}: its line {said} has {why}; the formulas alone predict {name}")
            continue
        out.lines[name] = (a, b)
        log(f"calibrated {name}: {said}")
    return out
