"""`shoal parity A.toml B.toml`: two layouts of one run, trained side by side and compared (parity.py)."""

from __future__ import annotations

import argparse

from shoal.cli.options import add_set
from shoal.errors import UserError


def add_parser(sub) -> None:
    p = sub.add_parser("parity", help="train two configs (two layouts of one run) side by side and compare "
                                      "their loss and gradient norm step by step")
    p.add_argument("config_a")
    p.add_argument("config_b")
    p.add_argument("--steps", type=int, default=20, help="steps to compare (default 20)")
    p.add_argument("--rtol", type=float, help="largest relative difference accepted (default: 1e-5 for fp32, "
                                              "2e-2 when either config computes in bf16, 1e-2 for fp16, 5e-2 for fp8)")
    p.add_argument("--nproc", metavar="A,B", help='processes for each config (default: dp x tp x pp; needed when '
                                                  'parallel.dp = "auto")')
    add_set(p, "override a config value in both configs (repeatable)")


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
