"""`shoal env`: what a bug report needs to know about this machine; `--check`: whether it trains."""

from __future__ import annotations

import argparse

from shoal.errors import UserError


def add_parser(sub) -> None:
    e = sub.add_parser("env", help="print shoal, torch, CUDA, NCCL and Python versions, the GPUs, the backend a run "
                                   "would use, the extras installed and the cached planner profiles; --check "
                                   "runs a few seconds' check that this machine trains")
    e.add_argument("--check", action="store_true", help="check the collectives across --nproc workers, each "
                   "worker's matmul rate and one training step of a tiny GPT; exit code 1 if any check fails")
    e.add_argument("--nproc", type=int, help="workers for --check: one per GPU (default: every GPU; on a CPU "
                                             "machine 2)")
    e.add_argument("--out", help=argparse.SUPPRESS)  # a launched worker's result file (env/check.py)


def env(args: argparse.Namespace) -> int:
    from shoal import dist

    if dist.is_launched() and args.out:  # one of --check's workers
        from shoal.env.check import worker

        worker(args.out)
        return 0
    from shoal.env import facts as machine

    facts = machine.gather()
    if args.nproc is not None and not args.check:
        raise UserError("--nproc: the number of workers `shoal env --check` starts; add --check")
    nproc = args.nproc if args.nproc is not None else (len(facts.gpus) or 2)
    if nproc < 1:
        raise UserError(f"--nproc {nproc}: give at least 1 worker")
    if facts.gpus and nproc > len(facts.gpus):
        raise UserError(f"--nproc {nproc}: this machine has {len(facts.gpus)} GPU(s), and the check runs one "
                        f"worker per GPU (NCCL refuses two on one); use --nproc {len(facts.gpus)} or fewer")
    if not args.check:
        print("\n".join(machine.render(facts)))
        for line in machine.problems(facts):
            print(f"PROBLEM     {line}")
        return 0
    from shoal.env.check import run

    return run(facts, nproc)
