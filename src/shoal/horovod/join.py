"""`hvd.join()`: a process that ran out of data keeps taking part in the others' optimizer steps until
every process has joined.

As in Horovod, a joined process contributes zeros to the gradient all-reduces of the processes still
training (an average still divides by the number of all processes). It does so for the one
DistributedOptimizer of the process (exchange.py, [Note: join flag]); Horovod's own join takes part
in any allreduce, but refuses allgather, broadcast, alltoall and reducescatter once a process joined,
and in practice joins are about the optimizer's steps. Any other collective the others issue before
they join would wait for the joined process until the timeout.
"""

from __future__ import annotations

import torch

from shoal.errors import UserError
from shoal.horovod import runtime
from shoal.horovod.gather import allgather_async, barrier
from shoal.horovod.handles import synchronize
from shoal.horovod.optimizer import LIVE


def join(device: int = -1) -> int:
    """Wait until every process has joined; returns the rank that joined last (the one that shadowed
    the fewest of the others' steps; the highest such rank on a tie)."""
    if runtime.size() == 1:
        return runtime.rank()
    comm = runtime.runtime().comm  # optimizers made before an earlier init exchange on a group that is gone
    optimizers = [o for o in LIVE if o._exchange is not None and o._exchange.comm is comm]
    if len(optimizers) > 1:
        raise UserError(f"hvd.join(): this process has {len(optimizers)} DistributedOptimizers; a joined process "
                        f"takes part in the steps of one")
    shadowed = 0
    if optimizers:
        while optimizers[0].shadow_step():
            shadowed += 1
    else:
        barrier()
    counts = synchronize(allgather_async(torch.tensor([shadowed]), "hvd.join")).tolist()
    fewest = min(counts)
    return max(r for r, c in enumerate(counts) if c == fewest)
