"""Options several commands share."""

from __future__ import annotations

import argparse

SET_HELP = "override one config value (repeatable), e.g. --set train.steps=50"


def add_set(parser: argparse.ArgumentParser, help: str = SET_HELP) -> None:
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help=help)


def workers(text: str) -> int:
    """--nproc: one number. A range is refused: a node starts the workers it has devices for, and a live
    run's range (--nnodes MIN:MAX) already counts workers (a node whose worker fails goes on with fewer)."""
    if ":" in text:
        raise argparse.ArgumentTypeError(
            f"{text!r}: --nproc takes one number, the workers this node starts; for a run that goes on with "
            f"fewer workers give --nnodes MIN:MAX (a live run's range counts workers: a node whose worker fails "
            f"goes on with fewer, and --max-restarts replaces it)")
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number of workers") from None


def add_launch(parser: argparse.ArgumentParser, restarts: str, nproc_default: str = "1") -> None:
    """The flags of a command that starts workers through torch elastic (`shoal train`, `shoal run`)."""
    parser.add_argument("--nproc", type=workers, help=f"worker processes on this node (default {nproc_default}, or "
                        f"what the scheduler says: PET_NPROC_PER_NODE, SM_NUM_GPUS, SLURM_GPUS_ON_NODE)")
    parser.add_argument("--max-restarts", type=int, default=0, help=restarts)
    parser.add_argument("--nnodes", metavar="N", help="nodes in the job (default 1, or what Slurm, a PyTorchJob or "
                                                      "SageMaker says; see docs/your-cluster.md)")
    parser.add_argument("--node-rank", type=int, help="this node's rank; node 0 hosts the rendezvous (default 0, or "
                                                      "the scheduler's)")
    parser.add_argument("--rdzv-endpoint", help="HOST:PORT of node 0, for multi-node jobs (default: the scheduler's)")
    parser.add_argument("--rdzv-timeout", type=float, metavar="SECONDS",
                        help="how long a node waits for node 0's endpoint to answer and for the other nodes to "
                             "join (default 600, as torchrun)")
    parser.add_argument("--ray", nargs="?", const="auto", metavar="ADDRESS",
                        help="run this command as one node per node of a running Ray cluster (auto: the one this "
                             "machine belongs to; or HEAD:6379), --nproc workers each; docs/your-cluster.md")
    parser.add_argument("--cluster", action="store_true",
                        help="run this command as one node per host of the cluster on this machine (`shoal cluster "
                             "up`), --nproc workers each")
