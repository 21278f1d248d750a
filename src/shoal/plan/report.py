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


def render(planned: list[Planned], top: int, console: Console | None = None) -> None:
    console = console or Console()
    if not console.is_terminal:
        console.width = 200  # a pipe or a log file: do not wrap the reasons
    ok = [p for p in planned if p.ok]
    t = Table("#", "layout", "step", "compute", "comm", "bubble", "calibration", "params", "grads", "optimizer",
              "activations", "peak / rank", title=f"{len(ok)} valid layouts, fastest first (top {min(top, len(ok))})")
    for i, p in enumerate(ok[:top], 1):
        m, tm = p.prediction.memory, p.prediction.time
        t.add_row(str(i), p.candidate.label(), _s(tm["step"]), _s(tm["compute"]), _s(tm["comm"]), _s(tm["bubble"]),
                  _s(tm.get("calibration")),
                  *(human_bytes(m[k]) for k in ("params", "grads", "optimizer", "activations", "peak")))
    console.print(t)
    if ok and ok[0].prediction.time["comm"] is None and ok[0].prediction.time["compute"] is not None:
        console.print("communication not predicted: this profile has no collective curves and no network; run "
                      "`shoal probe --out profile.json` on the machines and pass --hardware profile.json")
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
