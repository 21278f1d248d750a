"""Commands about a run's results: `shoal checkpoints`, `shoal export`, `shoal report`."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parsers(sub) -> None:
    c = sub.add_parser("checkpoints", help="list a run's checkpoints with step, world size, size and validity")
    rp = sub.add_parser("report", help="one self-contained HTML page of runs (loss, throughput, step time breakdown, "
                                       "memory, bytes sent, checkpoints, recoveries); several run dirs overlay")
    rp.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    rp.add_argument("--out", help="the page to write (default: RUN_DIR/report.html for one run, ./report.html for "
                                  "several); each figure is also written beside it as <name>-<figure>.png")
    c.add_argument("run_dir")
    e = sub.add_parser("export", help="write a checkpoint's model weights as one safetensors file, or (hf models) "
                                      "a Hugging Face directory")
    e.add_argument("run_dir")
    e.add_argument("--step", type=int, help="the checkpoint's step (default: the newest valid one)")
    e.add_argument("--out", required=True, help="output file, e.g. model.safetensors (--format hf: a new directory)")
    e.add_argument("--format", choices=("safetensors", "hf"), default="safetensors",
                   help="safetensors: one file of the model's weights; hf: config.json + model.safetensors (LoRA "
                        "merged) + the run's tokenizer, for from_pretrained")


def checkpoints(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from shoal.checkpoint.export import table_rows

    rows = table_rows(Path(args.run_dir))
    table = Table("step", "world size", "size", "saved at", "status", title=f"checkpoints of {args.run_dir}")
    for row in rows:
        table.add_row(*row)
    console = Console()
    if not console.is_terminal:
        console.width = 200  # a pipe or a log file: do not wrap the problem text
    console.print(table if rows else f"no checkpoints in {args.run_dir}")
    return 0


def report(args: argparse.Namespace) -> int:
    from shoal.report.page import render

    runs = [Path(p) for p in args.run_dirs]
    out = Path(args.out) if args.out else report_path(runs)
    written = render(runs, out)
    if not args.out and len(runs) > 1:
        print(f"several runs: the page goes to the current directory ({out}); --out chooses another place")
    print(f"wrote {written[0]} ({len(written) - 1} figures, also as PNG files beside it)")
    return 0


def report_path(runs: list[Path]) -> Path:
    """Where `shoal report` writes without --out: into the run dir of one run (a report is part of that
    run's results); for several, which belong to no one run, the current directory."""
    return runs[0] / "report.html" if len(runs) == 1 else Path("report.html")


def export(args: argparse.Namespace) -> int:
    from shoal.checkpoint.export import export_hf, export_weights

    ckpt = (export_hf if args.format == "hf" else export_weights)(Path(args.run_dir), Path(args.out), args.step)
    what = "a Hugging Face model directory" if args.format == "hf" else "model weights"
    print(f"wrote {args.out}: {what} of {ckpt.path} (step {ckpt.step})")
    return 0
