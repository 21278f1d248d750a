"""Start the worker processes through torch.distributed.elastic, the machinery behind torchrun.

One node: a c10d rendezvous on a free loopback port. Several nodes: every node runs the same command
with --nnodes, --rdzv-endpoint HOST:PORT (node 0's address) and its --node-rank; node 0 hosts the
rendezvous store (explicitly: the hostname heuristic fails inside containers and network namespaces;
measured with two namespaces here, both nodes time out after 60 s without `is_host` on node 0).
"""

from __future__ import annotations

import os
import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from shoal.errors import UserError


def launch(worker_argv: list[str], nproc: int, nnodes: tuple[int, int] = (1, 1), node_rank: int = 0,
           rdzv_endpoint: str | None = None, threads: int | None = None, max_restarts: int = 0) -> int:
    """Run `python <worker_argv>` on nproc local workers; returns the exit code for the CLI."""
    check_launch_args(nproc, nnodes, node_rank, rdzv_endpoint, max_restarts)
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)  # inherited by the workers before torch starts
    endpoint = rdzv_endpoint or "127.0.0.1:0"
    config = LaunchConfig(
        min_nodes=nnodes[0], max_nodes=nnodes[1], nproc_per_node=nproc,
        run_id=f"shoal-{endpoint}", role="shoal",
        rdzv_backend="c10d", rdzv_endpoint=endpoint,
        rdzv_configs={"is_host": node_rank == 0},
        max_restarts=max_restarts, monitor_interval=0.1, start_method="spawn",
    )
    try:
        elastic_launch(config, entrypoint=sys.executable)(*worker_argv)
    except ChildFailedError as e:
        return report_failures(e)
    except RendezvousError as e:
        print(f"shoal: could not form the job at the rendezvous {endpoint}: {str(e).splitlines()[0]} "
              f"(is node 0 running, with the same --nnodes?)", file=sys.stderr)
        return 1
    except SignalException as e:  # the launcher itself was asked to stop; workers saved and stopped
        print(f"shoal: interrupted by {signal.Signals(e.sigval).name}", file=sys.stderr)
        return 128 + e.sigval
    return 0


def parse_nnodes(text: str) -> tuple[int, int]:
    """--nnodes as (min, max) nodes. An elastic range MIN:MAX (torchrun's syntax) is refused: with torch
    2.13 a node joining a running c10d job hangs both agents in re-rendezvous (each waits 60 s on the
    other's store keys, role_info / MASTER_ADDR), reproduced with plain torchrun and a 10-line script
    (upstream: pytorch/pytorch#123678, scale-up with c10d). Runs still resize through checkpoints."""
    if ":" in text:
        raise UserError(f"--nnodes {text}: elastic node ranges are not supported yet; give a fixed number of nodes "
                        f"(a run still resumes on any world size from its checkpoints)")
    try:
        n = int(text)
    except ValueError:
        raise UserError(f"--nnodes {text!r}: expected a number of nodes, for example --nnodes 2") from None
    if n < 1:
        raise UserError(f"--nnodes ({n}) must be >= 1")
    return n, n


def check_launch_args(nproc: int, nodes: tuple[int, int], node_rank: int, rdzv_endpoint: str | None,
                      max_restarts: int) -> None:
    nnodes = nodes[1]
    if nproc < 1:
        raise UserError(f"--nproc ({nproc}) must be >= 1")
    if max_restarts < 0:
        raise UserError(f"--max-restarts ({max_restarts}) must be >= 0")
    if nnodes > 1 and not rdzv_endpoint:
        raise UserError(f"--nnodes {':'.join(map(str, sorted(set(nodes))))} needs --rdzv-endpoint HOST:PORT "
                        f"(node 0's address)")
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
