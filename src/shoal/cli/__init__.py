"""The `shoal` command, one module per group of commands, each adding its own subcommands. User errors
become one line on stderr and exit code 2; no traceback."""

from __future__ import annotations

import argparse
import sys

from shoal.cli import cluster, env, parity, plan, run, runs, train
from shoal.errors import UserError

COMMANDS = {"train": train.train, "run": run.run, "checkpoints": runs.checkpoints, "export": runs.export,
            "report": runs.report, "parity": parity.parity, "launch": cluster.launch_job, "cluster": cluster.cluster,
            "probe": plan.probe, "plan": plan.plan, "env": env.env}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal", description="Distributed training for PyTorch from one config.")
    sub = parser.add_subparsers(dest="command", required=True)
    train.add_parser(sub)
    run.add_parser(sub)
    runs.add_parsers(sub)
    parity.add_parser(sub)
    cluster.add_parsers(sub)
    plan.add_parsers(sub)
    env.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        if args.command != "env":  # `shoal env` reports an unsupported torch among the rest
            from shoal.compat import require_supported_torch

            require_supported_torch()
        return COMMANDS[args.command](args)
    except UserError as e:
        print(f"shoal: error: {e}", file=sys.stderr)
        return 2
