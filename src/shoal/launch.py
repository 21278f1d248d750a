"""Start the worker processes through torch.distributed.elastic, the machinery behind torchrun.

One node: a c10d rendezvous on a free loopback port. Several nodes: every node runs the same command
with --nnodes, --rdzv-endpoint HOST:PORT (node 0's address) and its --node-rank; node 0 hosts the
rendezvous store (explicitly: the hostname heuristic fails inside containers and namespaces, see
TORCH-CPU-FACTS "Multi-host").
"""

from __future__ import annotations

import os
import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from shoal.errors import UserError


def launch(worker_argv: list[str], nproc: int, nnodes: int = 1, node_rank: int = 0,
           rdzv_endpoint: str | None = None, threads: int | None = None, max_restarts: int = 0) -> int:
    """Run `python <worker_argv>` on nproc local workers; returns the exit code for the CLI."""
    check_launch_args(nproc, nnodes, node_rank, rdzv_endpoint, max_restarts)
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)  # inherited by the workers before torch starts
    endpoint = rdzv_endpoint or "127.0.0.1:0"
    config = LaunchConfig(
        min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=nproc,
        run_id=f"shoal-{endpoint}", role="shoal",
        rdzv_backend="c10d", rdzv_endpoint=endpoint,
        rdzv_configs={"is_host": node_rank == 0},
        max_restarts=max_restarts, monitor_interval=0.1, start_method="spawn",
    )
    try:
        elastic_launch(config, entrypoint=sys.executable)(*worker_argv)
    except ChildFailedError as e:
        return report_failures(e)
    except SignalException as e:  # the launcher itself was asked to stop; workers saved and stopped
        print(f"shoal: interrupted by {signal.Signals(e.sigval).name}", file=sys.stderr)
        return 128 + e.sigval
    return 0


def check_launch_args(nproc: int, nnodes: int, node_rank: int, rdzv_endpoint: str | None, max_restarts: int) -> None:
    if nproc < 1 or nnodes < 1:
        raise UserError(f"--nproc ({nproc}) and --nnodes ({nnodes}) must be >= 1")
    if max_restarts < 0:
        raise UserError(f"--max-restarts ({max_restarts}) must be >= 0")
    if nnodes > 1 and not rdzv_endpoint:
        raise UserError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT (node 0's address)")
    if not 0 <= node_rank < nnodes:
        raise UserError(f"--node-rank {node_rank} must be in [0, {nnodes - 1}] for --nnodes {nnodes}")


def report_failures(e: ChildFailedError) -> int:
    """One line per failed rank (its own traceback is already on stderr); exit 2 for user errors."""
    codes = []
    for rank, failure in sorted(e.failures.items()):
        msg = failure.message if isinstance(failure.message, str) else failure.message.get("message", "")
        codes.append(failure.exitcode)
        why = msg.strip().splitlines()[-1] if msg and msg.strip() else f"signal or exit code {failure.exitcode}"
        print(f"shoal: rank {rank} (pid {failure.pid}) failed with exit code {failure.exitcode}: {why}",
              file=sys.stderr)
    return 2 if codes and all(c == 2 for c in codes) else 1
