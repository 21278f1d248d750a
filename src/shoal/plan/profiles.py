"""Which hardware profile `shoal plan` prices a job with when given neither --hardware nor --preset.

`shoal probe` writes its profile to a per-machine cache as well as to --out:
$XDG_CACHE_HOME/shoal/profiles/<machine>/probe-<nproc>x<nnodes>.json (~/.cache/shoal/... by default, beside
the tokenized datasets), where <machine> is a digest of hardware.this_machine() (CPU model and cores, GPU
model and count, torch version, backend): a home directory shared by machines of different kinds keeps
each one's profile apart. `plan` takes the profile of this machine for the job's processes; a cached
profile of the same job from another machine or another torch version is refused in one line naming
the difference (--hardware still forces one); with none, it measures on the spot (probe.measure's
`spot`: ~11 s for 2 processes on a CPU here, their start included; sized for ~20 s on a GPU; no
calibration) and caches that until a `shoal probe` replaces it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from shoal.errors import UserError
from shoal.hardware import HardwareProfile, load_profile, machine_differences, save_profile, this_machine

SPOT_MAX_BYTES = 16 * 2 ** 20  # the largest collective measured on the spot (beyond it: linear in bytes)
# how long the measurement on the spot takes, said before it starts: as measured on this 2-core CPU for 2
# processes, their start included; on a GPU the budget plan/reference.py's sizes were chosen for, not yet timed on
# one (what each part took is said after it, from the profile's measured_seconds)
SPOT_TIME = {False: "~11 s for 2", True: "~20 s"}


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "shoal" / "profiles"


def machine_digest(machine: dict) -> str:
    return hashlib.sha256(json.dumps(machine, sort_keys=True).encode()).hexdigest()[:16]


def cache_path(machine: dict, nproc: int, nnodes: int) -> Path:
    return cache_dir() / machine_digest(machine) / f"probe-{nproc}x{nnodes}.json"


def store(profile: HardwareProfile) -> Path | None:
    """Keep a probe's profile in the cache of the machine it measured (None: it recorded no machine, or
    the cache cannot be written; the profile at --out is what the user asked for, so this never fails)."""
    if not profile.machine:
        return None
    path = cache_path(profile.machine, profile.nproc, profile.nnodes)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            tmp = Path(f.name)
        save_profile(profile, tmp)
        tmp.replace(path)  # whole or not at all: a plan reading it meanwhile sees the old one
    except OSError:
        return None
    return path


@dataclass
class Chosen:
    profile: HardwareProfile | None
    line: str  # said above the plan: which profile, or why none


def age(seconds: float) -> str:
    for unit, size in (("day", 86400), ("hour", 3600), ("min", 60)):
        if seconds >= size:
            n = int(seconds // size)
            return f"{n} {unit}{'s' if n > 1 and unit != 'min' else ''} ago"
    return "just now"


def describe(profile: HardwareProfile, where: str) -> str:
    """'profile: <where>, measured by shoal probe 3 days ago on AMD EPYC, 2 processes[; calibrated]'."""
    how = "on the spot by shoal plan" if profile.spot else "by shoal probe"
    when = f" {age(time.time() - profile.measured_at)}" if profile.measured_at else ""
    cal = "calibrated for " + ", ".join(profile.calibration) if profile.calibration else "not calibrated"
    return (f"profile: {where}, measured {how}{when} on {profile.device_name}, {profile.nproc} process(es)"
            f"{f' x {profile.nnodes} nodes' if profile.nnodes > 1 else ''}; {cal}")


def forced(path: str) -> Chosen:
    """--hardware: the file as given, used even when it was measured elsewhere (said in the line)."""
    profile = load_profile(path)
    line = describe(profile, path)
    other = machine_differences(profile.machine, this_machine())
    if other:
        line += f" (measured on another machine: {', '.join(other)}; used as --hardware asks)"
    return Chosen(profile, line)


def choose(nproc: int, nnodes: int, measure: bool = True) -> Chosen:
    """This machine's cached profile for nproc x nnodes processes; none: measured on the spot (one node,
    `measure`) or no profile, with the line saying why and what fills it in."""
    here = this_machine()
    path = cache_path(here, nproc, nnodes)
    probe = probe_command(nproc, nnodes)
    if path.is_file():
        try:
            profile = load_profile(path)
        except UserError:  # unreadable (another shoal's format): measured again below
            profile = None
        if profile is not None:
            note = "" if profile.calibration else f" (run `{probe}` to calibrate, {calibration_time(here, nproc)})"
            return Chosen(profile, describe(profile, str(path)) + note)
    stale = _stale(here, nproc, nnodes)
    if nnodes > 1 or not measure:
        why = f"{stale}; " if stale else ""
        return Chosen(None, f"no profile of this machine for {nproc} x {nnodes} processes: {why}step times need "
                            f"one: `{probe}` on the machines, --hardware PROFILE.json or --preset h100 (see "
                            f"docs/planner.md)")
    started = time.monotonic()
    profile = spot(nproc)
    took = time.monotonic() - started
    stored = store(profile)
    where = f"measured on the spot in {took:.0f} s, cached in {stored}" if stored else \
        f"measured on the spot in {took:.0f} s"
    return Chosen(profile, f"profile: {where}{f' ({stale})' if stale else ''}; not calibrated: `{probe}` "
                           f"calibrates it ({calibration_time(here, nproc)}) and replaces it")


def calibration_time(machine: dict, nproc: int) -> str:
    """How long `shoal probe` takes with its calibration: ~5 min for 2 processes on this 2-core CPU (36 runs);
    on GPUs, where a reference run is once per width (plan/reference.py), ~1 min on one (3 runs of the world-1
    strategy) and a few on more (3 runs per strategy the group allows)."""
    if not machine.get("gpus"):
        return "~5 min"
    return "~1 min" if nproc == 1 else "a few min"


def probe_command(nproc: int, nnodes: int) -> str:
    """The probe that measures (and calibrates) a profile for this job: one node, or the cluster's."""
    return f"shoal probe --nproc {nproc}" + (" --cluster" if nnodes > 1 else "")


def _stale(here: dict, nproc: int, nnodes: int) -> str | None:
    """The newest cached profile of the same job from another machine (or torch), in words."""
    name = f"probe-{nproc}x{nnodes}.json"
    found = []
    for path in cache_dir().glob(f"*/{name}"):
        try:
            profile = load_profile(path)
        except UserError:
            continue
        differs = machine_differences(profile.machine, here)
        if differs:
            found.append((profile.measured_at or 0.0, differs))
    if not found:
        return None
    return "the cached one was measured with " + ", ".join(max(found)[1]) + ": not used"


def spot(nproc: int) -> HardwareProfile:
    """What plan needs measured now: `shoal probe --spot` on nproc local workers (matmul and collective
    curves, the reference steps' operators, the parallel wrappers' overheads; no calibration runs)."""
    from shoal.plan.probe import launch_probe

    gpu = bool(this_machine().get("gpus"))
    with tempfile.TemporaryDirectory(prefix="shoal-spot-") as tmp:
        out = Path(tmp) / "profile.json"
        print(f"shoal plan: no profile of this machine for {nproc} process(es); measuring it now ({SPOT_TIME[gpu]})",
              file=sys.stderr, flush=True)
        code = launch_probe(["--out", str(out), "--max-size", f"{SPOT_MAX_BYTES}B", "--spot"], nproc)
        if code != 0 or not out.is_file():
            raise UserError(f"measuring this machine for {nproc} process(es) failed (exit {code}, output above); "
                            f"run `shoal probe --nproc {nproc}` to see why, or plan with --preset")
        profile = load_profile(out)
    parts = measured_parts(profile)
    if parts:
        print(f"shoal plan: measured {parts}", file=sys.stderr, flush=True)
    return profile


def measured_parts(profile: HardwareProfile) -> str:
    """What each part of the probe took ('matmul 0.9 s, reference steps 5.2 s, ...'): its `measured_seconds`
    (probe.measure); empty for a profile that did not record them."""
    took = getattr(profile, "measured_seconds", None) or {}
    return ", ".join(f"{part} {seconds:.1f} s" for part, seconds in took.items())
