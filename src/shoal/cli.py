"""The `shoal` command. User errors become one line on stderr and exit code 2; no traceback."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from shoal.errors import UserError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal", description="Distributed training for PyTorch from one config.")
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a model from a TOML config")
    t.add_argument("config", nargs="?", help="TOML config file (defaults for every key if omitted)")
    t.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value (repeatable), e.g. --set train.steps=50")
    t.add_argument("--run-dir", help="where results go (default: runs/<config>-<digest of what the config trains>, "
                                    "so the same command finds and continues the same run)")
    t.add_argument("--resume", default="auto", metavar="auto|never|PATH",
                   help="auto (default): continue from the run dir's newest complete checkpoint; never: start "
                        "fresh (an earlier run in the run dir is moved aside, not deleted); PATH: that checkpoint "
                        "folder")
    t.add_argument("--nproc", type=int, default=1, help="worker processes on this node (default 1)")
    t.add_argument("--max-restarts", type=int, default=0,
                   help="restart the worker group this many times after a failure; it resumes from the newest "
                        "checkpoint (default 0)")
    t.add_argument("--nnodes", default="1", metavar="N", help="nodes in the job (default 1)")
    t.add_argument("--node-rank", type=int, default=0, help="this node's rank; node 0 hosts the rendezvous")
    t.add_argument("--rdzv-endpoint", help="HOST:PORT of node 0, for multi-node jobs")
    c = sub.add_parser("checkpoints", help="list a run's checkpoints with step, world size, size and validity")
    c.add_argument("run_dir")
    e = sub.add_parser("export", help="write a checkpoint's model weights as one safetensors file")
    e.add_argument("run_dir")
    e.add_argument("--step", type=int, help="the checkpoint's step (default: the newest valid one)")
    e.add_argument("--out", required=True, help="output file, e.g. model.safetensors")
    p = sub.add_parser("parity", help="train two configs (two layouts of one run) side by side and compare "
                                      "their loss and gradient norm step by step")
    p.add_argument("config_a")
    p.add_argument("config_b")
    p.add_argument("--steps", type=int, default=20, help="steps to compare (default 20)")
    p.add_argument("--rtol", type=float, help="largest relative difference accepted (default: 1e-5 for fp32, "
                                              "2e-2 when either config computes in bf16, 1e-2 for fp16)")
    p.add_argument("--nproc", metavar="A,B", help='processes for each config (default: dp x tp x pp; needed when '
                                                  'parallel.dp = "auto")')
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value in both configs (repeatable)")
    return parser


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


def export(args: argparse.Namespace) -> int:
    from shoal.checkpoint.export import export_weights

    ckpt = export_weights(Path(args.run_dir), Path(args.out), args.step)
    print(f"wrote {args.out}: model weights of {ckpt.path} (step {ckpt.step})")
    return 0


def train(args: argparse.Namespace) -> int:
    from shoal import dist
    from shoal.config import load_config

    cfg = load_config(args.config, args.set)
    if dist.is_launched():  # we are a worker (torchrun, or our own launcher below)
        from shoal import worker

        worker.main(cfg, args.run_dir, args.config, args.resume)  # does not return
    import torch

    from shoal.launch import check_launch_args, launch, parse_nnodes
    from shoal.preflight import check_job
    from shoal.rundir import RunDir, default_run_dir
    from shoal.worker import RESUME_COMMAND, choose_run_dir, finished_message, threads_per_worker

    nodes = parse_nnodes(args.nnodes)
    check_launch_args(args.nproc, nodes, args.node_rank, args.rdzv_endpoint, args.max_restarts)
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(args.config, cfg)
    # every world size the job may take must be a valid layout; everything that can be checked is,
    # before any worker starts
    job = check_job(cfg, [args.nproc * n for n in range(nodes[0], nodes[1] + 1)], cuda=torch.cuda.is_available(),
                    run_dir=run_dir, resume=args.resume, quiet=True)
    if job.finished and RunDir(run_dir).summary.exists():
        print(finished_message(run_dir, job.resume_step, cfg.train.steps))
        return 0
    if args.node_rank == 0:
        choose_run_dir(str(run_dir), args.config, cfg, args.resume, first_attempt=True)
    worker_argv = ["-m", "shoal", "train", *([args.config] if args.config else []),
                   *[a for s in args.set for a in ("--set", s)], "--run-dir", str(run_dir), "--resume", args.resume]
    os.environ[RESUME_COMMAND] = resume_command(args.argv)
    return launch(worker_argv, args.nproc, nodes, args.node_rank, args.rdzv_endpoint,
                  threads=threads_per_worker(cfg, args.nproc), max_restarts=args.max_restarts)


def resume_command(argv: list[str]) -> str:
    """The command that continues this run: the one given, without a --resume other than auto (the
    run dir it names, or the stable default it derives, holds the checkpoints)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--resume":
            skip = True
        elif not a.startswith("--resume="):
            out.append(a)
    return shlex.join(["shoal", *out])


def parity(args: argparse.Namespace) -> int:
    from shoal.parity import parity as run_parity

    nprocs = (None, None)
    if args.nproc:
        try:
            a, b = (int(x) for x in args.nproc.split(","))
        except ValueError:
            raise UserError(f"--nproc {args.nproc!r}: expected two numbers A,B, for example --nproc 1,2") from None
        if min(a, b) < 1:
            raise UserError(f"--nproc {args.nproc}: both must be >= 1")
        nprocs = (a, b)
    return run_parity(args.config_a, args.config_b, args.steps, args.rtol, nprocs, args.set)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        return {"train": train, "checkpoints": checkpoints, "export": export, "parity": parity}[args.command](args)
    except UserError as e:
        print(f"shoal: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
