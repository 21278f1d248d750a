"""benchmarks/gpu_planner.py's figures: the rows `shoal plan --check` prints, read back whatever their names; the
table of predicted against measured per run and profile; the median and worst error per profile and quantity;
the RESULT line. Standard library only."""

from __future__ import annotations

import re
import statistics

# `shoal plan --check`'s rows (cli/plan.py): "<quantity>  predicted <value>  measured <value>  error <+x.x% | ?>",
# a value a number with or without its unit ("0.07969", "394.52 MiB") or "?"
ROW = re.compile(r"^(?P<name>\S.*?)\s+predicted\s+(?P<predicted>\S+(?: [A-Za-z]+)?)\s+measured\s+"
                 r"(?P<measured>\S+(?: [A-Za-z]+)?)\s+error\s+(?P<error>\S+)\s*$")
STEP, PEAK = "step time", "peak"  # the quantities the RESULT line sums up, by the start of their rows' names


def error_value(text: str) -> float | None:
    """'+6.4%' -> 0.064; '?' (nothing to compare) -> None."""
    return float(text.rstrip("%")) / 100 if text.endswith("%") else None


def check_rows(stdout: str) -> list[dict]:
    """Every row `plan --check` printed, in its order: {"name", "predicted", "measured", "error"} (the values as
    printed, the error as a fraction or None)."""
    rows = []
    for line in stdout.splitlines():
        m = ROW.match(line.strip())
        if m:
            rows.append({"name": m["name"].strip(), "predicted": m["predicted"], "measured": m["measured"],
                         "error": error_value(m["error"])})
    return rows


def slug(name: str) -> str:
    """'step time (s)' -> 'step_time': a quantity's key in the RESULT line."""
    return "_".join(re.sub(r"\(.*?\)", "", name).split())


def pct(error: float | None) -> str:
    return "?" if error is None else f"{error:+.1%}"


TABLE_HEAD = f"{'run':<14} {'profile':<12} {'quantity':<22} {'predicted':>12} {'measured':>12} {'error':>9}"


def table_lines(run: str, profile: str, rows: list[dict]) -> list[str]:
    return [f"{run:<14} {profile:<12} {r['name']:<22} {r['predicted']:>12} {r['measured']:>12} {pct(r['error']):>9}"
            for r in rows]


def errors_by(results: list[dict]) -> dict[tuple[str, str], list[tuple[float, str]]]:
    """{(profile, quantity): [(error, run), ...]} over every run's check, the quantities with an error only."""
    out: dict[tuple[str, str], list[tuple[float, str]]] = {}
    for res in results:
        for r in res["rows"]:
            if r["error"] is not None:
                out.setdefault((res["profile"], r["name"]), []).append((r["error"], res["run"]))
    return out


def spread(errors: list[tuple[float, str]]) -> dict:
    """The median of the errors' sizes, and the worst one (signed) with its run."""
    worst, run = max(errors, key=lambda e: abs(e[0]))
    return {"median": statistics.median(abs(e) for e, _ in errors), "worst": worst, "worst_run": run,
            "runs": len(errors)}


def summary(results: list[dict]) -> dict[str, dict[str, dict]]:
    """{profile: {quantity: spread}} over the runs checked."""
    out: dict[str, dict[str, dict]] = {}
    for (profile, name), errors in errors_by(results).items():
        out.setdefault(profile, {})[name] = spread(errors)
    return out


def summary_lines(spreads: dict[str, dict[str, dict]]) -> list[str]:
    """Per profile and quantity: over how many runs, the median error's size and the worst error."""
    lines = [f"{'profile':<12} {'quantity':<22} {'runs':>4} {'median':>8} {'worst':>9}"]
    for profile, quantities in spreads.items():
        lines += [f"{profile:<12} {name:<22} {s['runs']:>4} {s['median']:>8.1%} {pct(s['worst']):>9} ({s['worst_run']})"
                  for name, s in quantities.items()]
    return lines


def result_fields(spreads: dict[str, dict[str, dict]]) -> dict[str, str]:
    """{"<profile>_<quantity>_median": "0.123", "..._worst": "-0.359"} for the step time and the peak."""
    out = {}
    for profile, quantities in spreads.items():
        key = slug(profile.split()[0])
        for name, s in quantities.items():
            if name.startswith((STEP, PEAK)):
                out[f"{key}_{slug(name)}_median"] = f"{s['median']:.3f}"
                out[f"{key}_{slug(name)}_worst"] = f"{s['worst']:+.3f}"
    return out


def result_line(facts: dict, fields: dict[str, str]) -> str:
    said = " ".join(f"{k}={v}" for k, v in {**facts, **fields}.items())
    return f"RESULT {said}"
