"""The `shoal` command, one module per group of commands, each adding its own subcommands. User errors
become one line on stderr and exit code 2; no traceback."""

from __future__ import annotations

import argparse
import os
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


def entry() -> None:
    """The `shoal` command and `python -m shoal`: main(), then the process's end. A `shoal train` launcher ends
    at once, after flushing its output (os._exit: the same as its workers, [Note: exit] in dist.py): its work is
    done when its workers are, and finalizing an interpreter that holds torch and its compiler stack took
    ~0.75 s here (`python -c "import torch, torch._dynamo"`: 2.9 s against 2.1 s ending with os._exit)."""
    code = main(command_line=True)
    if sys.argv[1:2] == ["train"]:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def main(argv: list[str] | None = None, command_line: bool = False) -> int:
    """A shoal command; `command_line`: this process is that command (entry), not a Python caller of it."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv, args.command_line = argv, command_line
    try:
        # `shoal env` reports an unsupported torch among the rest; `shoal train` checks it once it has started its
        # workers' server, which imports torch meanwhile ([Note: early fork server] in launch/forkserver.py)
        if args.command not in ("env", "train"):
            from shoal.compat import require_supported_torch

            require_supported_torch()
        return COMMANDS[args.command](args)
    except UserError as e:
        print(f"shoal: error: {e}", file=sys.stderr)
        return 2
