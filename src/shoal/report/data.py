"""What the report draws, read from a run directory: metrics.jsonl (one object per logged step),
summary.json (written when the run ends; absent while it runs) and recoveries.json. Plain Python, no
plotting, so the extraction is tested on its own."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from shoal.errors import UserError
from shoal.rundir import RunDir, read_json, read_metrics

# keys ending in _s that are not a phase of one step: the step's total, and rates (tokens_per_s)
NOT_PHASES = {"step_time_s"}


@dataclass
class Run:
    """One run directory's records."""

    name: str  # the legend's label
    path: Path
    rows: list[dict]  # metrics.jsonl, in the order written (a recovery's redone steps appear twice)
    summary: dict = field(default_factory=dict)  # {} while the run has not finished
    recoveries: list[dict] = field(default_factory=list)

    @property
    def membership(self) -> list[dict]:
        """A live elastic run's changes of its group (step, time, world after, line): summary.json's, or
        while the run goes, metrics.jsonl's records of them."""
        events = self.summary.get("membership")
        if isinstance(events, list) and events:
            return [e for e in events if isinstance(e, dict) and "line" in e]
        return [{"step": r["step"], "time": r["time"], "world": r.get("world"), "line": r["membership"]}
                for r in self.rows if isinstance(r.get("membership"), str)]

    @property
    def t0(self) -> float:
        """The time axis's zero: the first logged step (metrics hold wall-clock times, not a start)."""
        return min(r["time"] for r in self.rows if isinstance(r.get("time"), (int, float)))


def load_run(path: Path, name: str | None = None) -> Run:
    run = RunDir(Path(path))
    if not run.path.is_dir():
        raise UserError(f"{path} is not a directory; pass the run dir of a `shoal train` (its --run-dir)")
    if not run.metrics.exists():
        if not run.config.exists():
            raise UserError(f"{path} is not a run dir (no metrics.jsonl, no config.toml); pass the --run-dir of "
                            f"a `shoal train`")
        raise UserError(f"run dir {path} has no metrics yet (no metrics.jsonl); the first line is written after "
                        f"metrics.log_interval steps")
    rows = read_metrics(run.metrics)
    rows = [r for r in rows if isinstance(r, dict) and "step" in r and "time" in r]
    if not rows:
        raise UserError(f"run dir {path} has no metrics yet (metrics.jsonl is empty); the first line is written "
                        f"after metrics.log_interval steps")
    summary = read_json(run.summary, {})
    recoveries = summary.get("recoveries") or read_json(run.recoveries, [])
    return Run(name or run.path.name, run.path, rows, summary if isinstance(summary, dict) else {},
               recoveries if isinstance(recoveries, list) else [])


def load_runs(paths: list[Path]) -> list[Run]:
    """The runs, labelled by folder name (by the whole path where two folders share a name)."""
    names = [Path(p).name or str(p) for p in paths]
    return [load_run(Path(p), name if names.count(name) == 1 else str(p)) for p, name in zip(paths, names, strict=True)]


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def series(run: Run, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows that have a number for `key` (validation keys are on some rows only;
    a non-finite loss was written as null)."""
    pairs = [(r["step"], r[key]) for r in run.rows if is_number(r.get(key))]
    return [s for s, _ in pairs], [v for _, v in pairs]


def elapsed(run: Run) -> tuple[list[float], list[int]]:
    """(seconds since the first logged step, step) of every row: progress on the time axis."""
    t0 = run.t0
    return [r["time"] - t0 for r in run.rows], [r["step"] for r in run.rows]


def run_phases(run: Run) -> list[str]:
    """The parts a step's time is split into, in first-seen order. With the step profile on, the time_*_s
    parts (data wait, compute, pipeline bubble, optimizer, exposed communication per mesh axis), which add
    up to the step time; without it, the timer's phases (data_wait_s, forward_backward_s, optimizer_s and
    any other per-step *_s key a layout records). Never both: the profile's parts re-cut the timer's
    phases, and stacking both would count each second twice."""
    numeric = [k for r in run.rows for k, v in r.items()
               if k.endswith("_s") and not k.endswith("_per_s") and k not in NOT_PHASES and is_number(v)]
    profiled = [k for k in numeric if k.startswith("time_")]
    return list(dict.fromkeys(profiled or numeric))


def phase_keys(runs: list[Run]) -> list[str]:
    """Every run's phases, for one colour per phase across the runs."""
    return list(dict.fromkeys(k for run in runs for k in run_phases(run)))


def throughput_keys(runs: list[Run]) -> list[str]:
    """Items per second (tokens_per_s, samples_per_s); FLOP/s has a panel of its own."""
    return sorted({k for run in runs for r in run.rows for k, v in r.items()
                   if k.endswith("_per_s") and "flop" not in k and is_number(v)})


def comm_keys(runs: list[Run]) -> list[str]:
    """Bytes sent per step: comm_bytes, and per mesh axis where a layout records it (not the running total)."""
    return sorted({k for run in runs for r in run.rows for k, v in r.items()
                   if k.startswith("comm_bytes") and not k.endswith("_total") and is_number(v)})


def per_rank_keys(runs: list[Run]) -> list[str]:
    """Metrics recorded rank by rank (`<name>_per_rank`: a list of numbers per logged step, e.g. the step
    profile's compute_s_per_rank): where a straggler shows."""
    return sorted({k for run in runs for r in run.rows for k, v in r.items()
                   if k.endswith("_per_rank") and isinstance(v, list) and all(is_number(x) for x in v)})


def stragglers(run: Run) -> list[str]:
    """The stragglers the run named, as text: summary.json's profile (each rank named, how often, how
    slow at worst), then the logged steps that named one, consecutive namings of one rank as one span."""
    out = []
    for e in (run.summary.get("profile") or {}).get("stragglers") or []:
        out.append(f"rank {e.get('rank')}: named at {e.get('times_named')} logged step(s), compute at worst "
                   f"{e.get('worst_ratio', 0):.2f}x the median of the other ranks")
    span = None  # [rank, first step, last step, worst ratio]
    for r in run.rows + [{}]:  # the sentinel closes the last span
        rank = r.get("straggler_rank")
        if span and rank == span[0]:
            span[2], span[3] = r["step"], max(span[3], r.get("straggler_ratio") or 0.0)
            continue
        if span:
            out.append(f"steps {span[1]}-{span[2]}: rank {span[0]}, compute up to {span[3]:.2f}x the median of "
                       f"the other ranks")
        steps = r.get("straggler_steps") or [r.get("step"), r.get("step")]
        span = [rank, steps[0], r.get("step"), r.get("straggler_ratio") or 0.0] if rank is not None else None
    return out


def step_time_at(run: Run, step: int) -> float | None:
    """When `step` completed, seconds since the first logged step: interpolated between the logged steps
    around it, in the last attempt that reached it (a recovery redoes steps; summary.json's checkpoints
    are the last attempt's). None before the first logged step."""
    found, prev = None, None
    for r in run.rows:
        if r["step"] == step:
            found = r["time"]
        elif prev is not None and prev["step"] < step < r["step"]:
            found = prev["time"] + (step - prev["step"]) / (r["step"] - prev["step"]) * (r["time"] - prev["time"])
        prev = r
    return None if found is None else found - run.t0
