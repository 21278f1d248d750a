"""The report's figures, drawn with matplotlib's Agg canvas (no display, no pyplot global state). Each
takes the runs and returns a Figure, or None when no run recorded what it draws. Runs keep one colour
across every figure; the legend names them."""

from __future__ import annotations

from shoal.errors import require
from shoal.report.data import (
    Run,
    comm_keys,
    elapsed,
    is_number,
    per_rank_keys,
    phase_keys,
    run_phases,
    series,
    step_time_at,
    throughput_keys,
)

WIDTH = 10.0  # inches at 100 dpi: 1000 px, the page's column
RATE_PANELS = ("mfu",)  # per-step rates drawn beside throughput when a run records them


def _mpl():
    require("matplotlib", "report", "shoal report")
    from matplotlib.figure import Figure
    from matplotlib.ticker import EngFormatter

    return Figure, EngFormatter


def run_colours(runs: list[Run]) -> dict[str, str]:
    """tab10, the colour-blind-safer default of matplotlib, one colour per run."""
    return {run.name: f"C{i % 10}" for i, run in enumerate(runs)}


def _figure(rows: int = 1, cols: int = 1, height: float = 3.4, **kw):
    Figure, _ = _mpl()
    fig = Figure(figsize=(WIDTH, height * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False, **kw)
    return fig, axes


def _integer_steps(axis) -> None:
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def _label(key: str) -> str:
    """time_exposed_dp_s -> exposed dp; compute_s_per_rank -> compute."""
    return key.removeprefix("time_").removesuffix("_per_rank").removesuffix("_s").replace("_", " ")


def loss(runs: list[Run]):
    """Training loss per logged step (solid), validation loss where measured (dashed, dots)."""
    colours = run_colours(runs)
    fig, ax = _figure()
    ax = ax[0][0]
    val_seen = False
    for i, run in enumerate(runs):
        # earlier runs drawn wider: runs that train the same steps (one run on two layouts) stay visible
        width = 1.5 + 1.5 * (len(runs) - 1 - i)
        steps, values = series(run, "loss")
        ax.plot(steps, values, color=colours[run.name], linewidth=width, label=run.name)
        vsteps, vvalues = series(run, "val_loss")
        if vsteps:
            val_seen = True
            ax.plot(vsteps, vvalues, color=colours[run.name], linewidth=width, linestyle="--", marker="o",
                    markersize=4 + width)
    if val_seen:
        ax.plot([], [], color="0.3", label="training (solid)")
        ax.plot([], [], color="0.3", linestyle="--", marker="o", markersize=4, label="validation (dashed)")
    ax.set(xlabel="step", ylabel="loss", title="Loss")
    _integer_steps(ax.xaxis)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return fig


def throughput(runs: list[Run]):
    """Items per second per logged step, one panel per kind of item, and MFU where recorded."""
    keys = throughput_keys(runs) + [k for k in RATE_PANELS if any(series(r, k)[0] for r in runs)]
    if not keys:
        return None
    _, EngFormatter = _mpl()
    colours = run_colours(runs)
    fig, axes = _figure(1, len(keys))
    for ax, key in zip(axes[0], keys, strict=True):
        for run in runs:
            steps, values = series(run, key)
            if steps:
                ax.plot(steps, values, color=colours[run.name], marker=".", label=run.name)
        if key == "mfu":
            ax.set(ylabel="model FLOPs utilisation", title="MFU")
        else:
            ax.set(ylabel=key.removesuffix("_per_s") + "/s", title=f"Throughput ({key.removesuffix('_per_s')}/s)")
            ax.yaxis.set_major_formatter(EngFormatter())
        ax.set_xlabel("step")
        _integer_steps(ax.xaxis)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return fig


def breakdown(runs: list[Run]):
    """Where each step's time goes, one panel per run: the step profile's parts stacked (data wait,
    compute, pipeline bubble, optimizer, communication waited for per mesh axis), or without the profile
    the timer's phases, under the measured step time (dashed; a gap is time no part claims)."""
    phases = phase_keys(runs)
    if not phases:
        return None
    _, EngFormatter = _mpl()
    shown = [run for run in runs if run_phases(run)]
    fig, axes = _figure(len(shown), 1, height=2.8, sharex=True, sharey=True)
    from matplotlib import colormaps

    # phases take Set2, not tab10, so a phase never looks like a run
    palette = {k: colormaps["Set2"].colors[i % 8] for i, k in enumerate(phases)}
    for ax, run in zip(axes[:, 0], shown, strict=True):
        mine = run_phases(run)
        rows = [r for r in run.rows if any(k in r for k in mine)]
        steps = [r["step"] for r in rows]
        ax.stackplot(steps, *[[r.get(k) or 0.0 for r in rows] for k in mine], colors=[palette[k] for k in mine],
                     labels=[_label(k) for k in mine], step="mid")
        total_steps, totals = series(run, "step_time_s")
        if total_steps:
            ax.plot(total_steps, totals, color="black", linestyle="--", linewidth=1, drawstyle="steps-mid",
                    label="step time")
        ax.set(ylabel="seconds", title=f"Step time breakdown: {run.name}")
        ax.yaxis.set_major_formatter(EngFormatter(unit="s"))
        ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    axes[-1][0].set_xlabel("step")
    _integer_steps(axes[-1][0].xaxis)
    return fig


def memory(runs: list[Run]):
    """Per rank, at the last measurement: peak memory (left) and the model state the rank holds,
    parameters / gradients / optimizer state stacked (right); runs side by side."""
    per_run = [(run, run.summary.get("memory_per_rank") or []) for run in runs]
    per_run = [(run, ranks) for run, ranks in per_run if ranks]
    if not per_run:
        return None
    _, EngFormatter = _mpl()
    colours = run_colours(runs)
    kinds = list(dict.fromkeys(k for _, ranks in per_run for r in ranks for k, v in r.items()
                               if k not in ("rank", "peak") and is_number(v)))
    hatches = ["", "//", "..", "xx", "\\\\", "oo"]
    fig, axes = _figure(1, 2)
    ax_peak, ax_state = axes[0]
    width = 0.8 / len(per_run)
    for i, (run, ranks) in enumerate(per_run):
        x = [r["rank"] + (i - (len(per_run) - 1) / 2) * width for r in ranks]
        ax_peak.bar(x, [r.get("peak", 0) for r in ranks], width, color=colours[run.name], label=run.name)
        bottom = [0.0] * len(ranks)
        for j, kind in enumerate(kinds):
            values = [r.get(kind, 0) for r in ranks]
            ax_state.bar(x, values, width, bottom=bottom, color=colours[run.name], hatch=hatches[j % len(hatches)],
                         edgecolor="white", alpha=1.0 - 0.25 * (j % 3))
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for j, kind in enumerate(kinds):
        ax_state.bar([0], [0], 0, color="0.55", hatch=hatches[j % len(hatches)], edgecolor="white",
                     alpha=1.0 - 0.25 * (j % 3), label=kind)
    ranks = sorted({r["rank"] for _, rs in per_run for r in rs})
    for ax, title in ((ax_peak, "Peak memory per rank"), (ax_state, "Model state per rank")):
        ax.set(xlabel="rank", ylabel="bytes", title=title, xticks=ranks)
        ax.yaxis.set_major_formatter(EngFormatter(unit="B"))
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize="small")
    return fig


def comm(runs: list[Run]):
    """Bytes this rank sent per step (to keep replicas in sync; per mesh axis where recorded)."""
    keys = comm_keys(runs)
    if not keys:
        return None
    _, EngFormatter = _mpl()
    colours = run_colours(runs)
    styles = ["-", "--", ":", "-."]
    fig, ax = _figure()
    ax = ax[0][0]
    for run in runs:
        for j, key in enumerate(keys):
            steps, values = series(run, key)
            if steps:
                ax.plot(steps, values, color=colours[run.name], linestyle=styles[j % len(styles)], marker=".",
                        label=run.name if len(keys) == 1 else f"{run.name}: {_label(key)}")
    ax.set(xlabel="step", ylabel="bytes per step", title="Bytes sent per step (rank 0)")
    _integer_steps(ax.xaxis)
    ax.yaxis.set_major_formatter(EngFormatter(unit="B"))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return fig


def per_rank(runs: list[Run]):
    """Metrics recorded rank by rank, one line per rank, one panel per run and metric: a straggler is
    the line above the others."""
    keys = per_rank_keys(runs)
    panels = [(run, k) for k in keys for run in runs if any(isinstance(r.get(k), list) for r in run.rows)]
    if not panels:
        return None
    from matplotlib import colormaps

    _, EngFormatter = _mpl()
    fig, axes = _figure(len(panels), 1, height=2.6, sharex=True)
    for ax, (run, key) in zip(axes[:, 0], panels, strict=True):
        rows = [r for r in run.rows if isinstance(r.get(key), list)]
        for rank in range(max(len(r[key]) for r in rows)):
            pts = [(r["step"], r[key][rank]) for r in rows if rank < len(r[key])]
            # ranks take Dark2, not tab10, so a rank never looks like a run
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", color=colormaps["Dark2"].colors[rank % 8],
                    label=f"rank {rank}")
        ax.set(ylabel=_label(key), title=f"{_label(key)} per rank: {run.name}")
        named = [(r["step"], r[key][r["straggler_rank"]]) for r in rows
                 if is_number(r.get("straggler_rank")) and r["straggler_rank"] < len(r[key])]
        if named:  # the logged steps that named a straggler: a ring around that rank's point
            ax.plot([p[0] for p in named], [p[1] for p in named], "o", markersize=11, markerfacecolor="none",
                    markeredgecolor="red", label="named straggler")
        if key.removesuffix("_per_rank").endswith("_s"):
            ax.yaxis.set_major_formatter(EngFormatter(unit="s"))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    axes[-1][0].set_xlabel("step")
    _integer_steps(axes[-1][0].xaxis)
    return fig


def timeline(runs: list[Run]):
    """Progress on the time axis: steps completed against seconds since the first logged step, each
    checkpoint a marker, each recovery from a failure a shaded span (the seconds it lost), each change of
    a live run's group a dashed line marked with the world size after it."""
    colours = run_colours(runs)
    fig, ax = _figure()
    ax = ax[0][0]
    saw_ckpt = saw_recovery = saw_change = False
    for run in runs:
        c = colours[run.name]
        seconds, steps = elapsed(run)
        # one line per attempt: a recovery goes back to its checkpoint's step, drawn as a new line
        cuts = [0] + [i for i in range(1, len(steps)) if steps[i] < steps[i - 1]] + [len(steps)]
        for n, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
            ax.plot(seconds[a:b], steps[a:b], color=c, marker=".", label=None if n else run.name)
        for ck in run.summary.get("checkpoints") or []:
            t = step_time_at(run, ck.get("step", -1))
            if t is not None:
                saw_ckpt = True
                ax.plot([t], [ck["step"]], marker="D", markersize=7, color=c, markeredgecolor="black")
        for rec in run.recoveries:
            failed = rec.get("failed_at")
            if not isinstance(failed, (int, float)):
                continue
            saw_recovery = True
            lost = rec.get("seconds_lost") or 0.0
            ax.axvspan(failed - run.t0, failed - run.t0 + lost, color=c, alpha=0.2)
            ax.annotate(f"restart {rec.get('restart', '?')}: {lost:.1f} s lost", (failed - run.t0, 0),
                        xytext=(3, 3), textcoords="offset points", fontsize="small", color=c, rotation=90,
                        va="bottom")
        for e in run.membership:
            if isinstance(e.get("time"), (int, float)):
                saw_change = True
                ax.axvline(e["time"] - run.t0, color=c, linestyle="--", alpha=0.6)
                ax.annotate(f"world {e.get('world', '?')}", (e["time"] - run.t0, 0), xytext=(3, 3),
                            textcoords="offset points", fontsize="small", color=c, rotation=90, va="bottom")
    if saw_ckpt:
        ax.plot([], [], "D", color="0.6", markeredgecolor="black", label="checkpoint")
    if saw_change:
        ax.plot([], [], "--", color="0.6", label="the group changed (live run)")
    if saw_recovery:
        ax.fill_between([], [], color="0.6", alpha=0.3, label="recovery (seconds lost)")
    ax.set(xlabel="seconds since the first logged step", ylabel="step", title="Progress, checkpoints, recoveries")
    ax.set_ylim(bottom=0)
    _integer_steps(ax.yaxis)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return fig


def experts(runs: list[Run]):
    """A mixture of experts' balance: per MoE layer, the most any expert received over the mean on each logged
    step (1.0: even), one line per run and layer."""
    colours = run_colours(runs)
    shown = [run for run in runs if any(r.get("expert_imbalance") for r in run.rows)]
    if not shown:
        return None
    fig, ax = _figure()
    ax = ax[0][0]
    styles = ("-", "--", ":", "-.")
    for run in shown:
        rows = [r for r in run.rows if r.get("expert_imbalance")]
        for layer in range(max(len(r["expert_imbalance"]) for r in rows)):
            pts = [(r["step"], r["expert_imbalance"][layer]) for r in rows
                   if layer < len(r["expert_imbalance"]) and is_number(r["expert_imbalance"][layer])]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=colours[run.name], marker=".",
                    linestyle=styles[layer % len(styles)], label=f"{run.name}, MoE layer {layer}")
    ax.axhline(1.0, color="0.5", linewidth=0.8)
    ax.set(xlabel="step", ylabel="max / mean tokens per expert", title="Expert balance")
    _integer_steps(ax.xaxis)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


# (name, title, what it shows): the page's order
FIGURES = (
    ("loss", "Loss", loss),
    ("throughput", "Throughput", throughput),
    ("breakdown", "Step time breakdown", breakdown),
    ("memory", "Memory per rank", memory),
    ("comm", "Bytes sent", comm),
    ("per_rank", "Per rank (stragglers)", per_rank),
    ("experts", "Expert balance", experts),
    ("timeline", "Checkpoints and recoveries", timeline),
)
