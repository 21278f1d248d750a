"""The report page: one HTML file that needs nothing else (each figure a PNG inside it as a base64
data URI, the style inline, no script), and the same figures as PNG files beside it."""

from __future__ import annotations

import base64
import html
import io
import time
from pathlib import Path

from shoal.errors import UserError, require
from shoal.report import figures
from shoal.report.data import Run, load_runs, stragglers

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px auto; max-width: 1040px;
       color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
img { width: 100%; max-width: 1000px; display: block; }
table { border-collapse: collapse; font-size: 0.9em; margin: 0.5em 0; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: right; } th { background: #f4f4f4; }
td:first-child, th:first-child { text-align: left; }
.note { color: #666; font-size: 0.9em; } .swatch { display: inline-block; width: 0.9em; height: 0.9em; }
"""

# summary.json's headline numbers, as (key, column title, format)
HEADLINE = (("model", "model", "{}"), ("world_size", "world", "{}"), ("dp", "dp", "{}"), ("tp", "tp", "{}"),
            ("pp", "pp", "{}"), ("steps", "steps", "{}"), ("final_loss", "final loss", "{:.4f}"),
            ("val_loss", "val loss", "{:.4f}"), ("median_step_time_s", "median step", "{:.3f} s"),
            ("profile.median_mfu", "MFU", "{:.1%}"), ("peak_memory_bytes", "peak memory", "mib"),
            ("total_time_s", "time", "{:.1f} s"),
            ("restarts", "restarts", "{}"))


def png(fig) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)  # Agg: renders without a display
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def _cell(fmt: str, value) -> str:
    if value is None:
        return "–"
    if fmt == "mib" and isinstance(value, (int, float)):
        return f"{value / 2**20:,.0f} MiB"
    try:
        return html.escape(fmt.format(value))
    except (ValueError, TypeError):
        return html.escape(str(value))


def _get(summary: dict, key: str):
    """summary.json's value at a dotted key (profile.median_mfu), None where absent."""
    for part in key.split("."):
        summary = summary.get(part) if isinstance(summary, dict) else None
    return summary


def _table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _swatch(run: Run, colours: dict[str, str]) -> str:
    from matplotlib.colors import to_hex

    return (f'<span class="swatch" style="background:{to_hex(colours[run.name])}"></span> '
            f'<span title="{html.escape(str(run.path.resolve()))}">{html.escape(run.name)}</span>')


def runs_table(runs: list[Run], colours: dict[str, str]) -> str:
    rows = []
    for run in runs:
        s = run.summary
        if not s:  # still running: what the metrics say so far
            last = run.rows[-1]
            s = {"steps": last["step"], "final_loss": last.get("loss")}
        rows.append([_swatch(run, colours)] +
                    [_cell(fmt, _get(s, key)) for key, _, fmt in HEADLINE])
    note = "".join(f'<p class="note">{html.escape(r.name)}: no summary.json yet (the run has not finished); '
                   f'numbers from its last logged step.</p>' for r in runs if not r.summary)
    return _table(["run"] + [title for _, title, _ in HEADLINE], rows) + note


def checkpoints_table(runs: list[Run], colours: dict[str, str]) -> str:
    from shoal.report.data import step_time_at

    rows = []
    for run in runs:
        for ck in run.summary.get("checkpoints") or []:
            t = step_time_at(run, ck.get("step", -1))
            rows.append([_swatch(run, colours), _cell("{}", ck.get("step")), _cell("{:.2f} s", t),
                         _cell("{:.3f} s", ck.get("blocking_s")), _cell("{:.3f} s", ck.get("total_s")),
                         _cell("{:,} B", ck.get("bytes")), "async" if ck.get("async") else "blocking"])
    if not rows:
        return '<p class="note">No checkpoint was saved (or summary.json is not written yet).</p>'
    return _table(["run", "step", "at", "training paused", "total", "size", "save"], rows)


def recoveries_table(runs: list[Run], colours: dict[str, str]) -> str:
    rows = []
    for run in runs:
        for rec in run.recoveries:
            parts = rec.get("breakdown_s") or {}
            rows.append([_swatch(run, colours), _cell("{}", rec.get("restart")),
                         _cell("{}", rec.get("failed_after_step")), _cell("{}", rec.get("resumed_from_step")),
                         _cell("{:.1f} s", rec.get("seconds_lost")),
                         html.escape(", ".join(f"{k} {v:.1f} s" for k, v in parts.items()
                                               if isinstance(v, (int, float))))])
    if not rows:
        return '<p class="note">No recovery from a failure.</p>'
    return _table(["run", "restart", "failed after step", "resumed from step", "seconds lost", "where they went"],
                  rows)


def membership_table(runs: list[Run], colours: dict[str, str]) -> str:
    rows = [[_swatch(run, colours), _cell("{}", e.get("step")), _cell("{}", e.get("world")),
             _cell("{:.2f} s", e.get("regroup_s")), html.escape(str(e["line"]))]
            for run in runs for e in run.membership]
    if not rows:
        return '<p class="note">No change of the group (a live elastic run, --nnodes MIN:MAX, records them).</p>'
    return _table(["run", "step", "world after", "regrouped in", "change"], rows)


def stragglers_list(runs: list[Run]) -> str:
    items = [f"<li>{html.escape(run.name)}: {html.escape(text)}</li>" for run in runs for text in stragglers(run)]
    return f"<ul>{''.join(items)}</ul>" if items else '<p class="note">No run named a straggler.</p>'


def render(paths: list[Path], out: Path) -> list[Path]:
    """Write the page to `out` and each figure beside it as <out stem>-<figure>.png; returns the files."""
    require("matplotlib", "report", "shoal report")  # before any figure or colour: a missing extra is one line
    runs = load_runs(paths)
    if out.suffix.lower() not in (".html", ".htm"):
        raise UserError(f"--out {out}: expected an .html file, for example --out report.html")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out}: cannot make its folder ({e.strerror or e}); pass a writable path") from None
    colours = figures.run_colours(runs)
    written, sections = [out], []
    extra = {"timeline": checkpoints_table(runs, colours) + "<h3>Recoveries</h3>" + recoveries_table(runs, colours)
             + "<h3>Membership changes</h3>" + membership_table(runs, colours),
             "per_rank": "<h3>Stragglers named</h3>" + stragglers_list(runs)}
    for name, title, draw in figures.FIGURES:
        fig = draw(runs)
        if fig is None:
            if name == "per_rank":  # the named stragglers still have their place
                sections.append(f"<h2>Stragglers</h2>{stragglers_list(runs)}")
            continue
        data = png(fig)
        path = out.with_name(f"{out.stem}-{name}.png")
        path.write_bytes(data)
        written.append(path)
        uri = "data:image/png;base64," + base64.b64encode(data).decode("ascii")
        doc = html.escape(" ".join((draw.__doc__ or "").split()))
        sections.append(f'<h2 id="{name}">{html.escape(title)}</h2><p class="note">{doc}</p>'
                        f'<img class="figure" data-figure="{name}" alt="{html.escape(title)}" src="{uri}">'
                        f'{extra.get(name, "")}')
    names = ", ".join(run.name for run in runs)
    page = (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>shoal report: {html.escape(names)}'
            f'</title><style>{STYLE}</style></head><body><h1>shoal report: {html.escape(names)}</h1>'
            f'<p class="note">Made {time.strftime("%Y-%m-%d %H:%M")} by <code>shoal report</code>.</p>'
            f'{runs_table(runs, colours)}{"".join(sections)}</body></html>\n')
    out.write_text(page, encoding="utf-8")
    return written
