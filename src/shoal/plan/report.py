"""What `shoal plan` prints (rich tables: the valid layouts ranked, then the rejected ones with their
reasons) and writes (`--apply`: the best layout's keys set in a copy of the user's config file)."""

from __future__ import annotations

from pathlib import Path

import tomli_w
import tomllib
from rich.console import Console
from rich.table import Table

from shoal.config import load_config
from shoal.errors import UserError
from shoal.plan.planner import Planned, human_bytes


def _s(t: float | None) -> str:
    return "?" if t is None else f"{t * 1e3:.1f} ms"


def render(planned: list[Planned], top: int, console: Console | None = None, missing: str | None = None) -> None:
    """The valid layouts, then the rejected ones. Titled "fastest first" only when every valid layout has
    a predicted step time; otherwise the title says what the order is, and a line above the table says
    what is missing and (`missing`: from the caller, which knows where the profile came from) what fills
    it in."""
    console = console or Console()
    if not console.is_terminal:
        console.width = 200  # a pipe or a log file: do not wrap the reasons
    ok = [p for p in planned if p.ok]
    shown = f"top {min(top, len(ok))}"
    untimed = [p for p in ok if p.prediction.step_time is None]
    if not untimed:
        title = f"{len(ok)} valid layouts, fastest first ({shown})"
    else:
        computed = any(p.prediction.time["compute"] is not None for p in untimed)
        order = "predicted compute time, then peak memory" if computed else "peak memory per rank"
        timed = len(ok) - len(untimed)
        title = (f"{len(ok)} valid layouts: {timed} by predicted step time, then {len(untimed)} without one by "
                 f"{order} ({shown})" if timed else f"{len(ok)} valid layouts by {order}, no step times ({shown})")
        what = "communication is not predicted (the profile has no collective curves)" if computed else \
            "no step times (no hardware profile)"
        console.print(f"{len(untimed)} of {len(ok)} layouts without a step time: {what}; "
                      f"{missing or 'run `shoal probe` on the machines, or plan with --preset'}")
    gpu = any("device" in p.prediction.memory for p in ok)  # the device's total: what must fit (predict.py)
    t = Table("#", "layout", "step", "compute", "comm", "bubble", "calibration", "params", "grads", "optimizer",
              "activations", *(("working", "peak", "device / rank") if gpu else ("peak / rank",)), title=title)
    for i, p in enumerate(ok[:top], 1):
        m, tm = p.prediction.memory, p.prediction.time
        kinds = ("params", "grads", "optimizer", "activations", *(("working", "peak", "device") if gpu else ("peak",)))
        t.add_row(str(i), p.candidate.label(), _s(tm["step"]), _s(tm["compute"]), _s(tm["comm"]), _s(tm["bubble"]),
                  _s(tm.get("calibration")), *(human_bytes(m[k]) for k in kinds))
    console.print(t)
    rejected: dict[str, list[str]] = {}
    for p in planned:
        if not p.ok:
            rejected.setdefault(p.reason, []).append(p.candidate.label())
    if rejected:
        r = Table("layouts", "why not", title=f"{sum(map(len, rejected.values()))} rejected layouts")
        for reason, labels in rejected.items():
            shown = ", ".join(labels[:3]) + (f" (+{len(labels) - 3} more)" if len(labels) > 3 else "")
            r.add_row(shown, reason)
        console.print(r)


def apply(config_path: str | Path | None, planned: list[Planned], out: str | Path) -> Planned:
    """Write the best valid layout's keys into a copy of the config; the copy must load."""
    best = next((p for p in planned if p.ok), None)
    if best is None:
        raise UserError("no layout is valid for this config and --nproc/--memory, so --apply has nothing to write; "
                        "see the reasons above")
    raw = tomllib.loads(Path(config_path).read_text(encoding="utf-8")) if config_path else {}
    for key, value in best.candidate.keys.items():
        section, _, name = key.partition(".")
        raw.setdefault(section, {})[name] = value
    Path(out).write_text(f"# {best.candidate.label()}: chosen by shoal plan from {config_path or 'the defaults'}\n"
                         + tomli_w.dumps(raw), encoding="utf-8")
    load_config(out)  # what was written is a config shoal loads
    return best
